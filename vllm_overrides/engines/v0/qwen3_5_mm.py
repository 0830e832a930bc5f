"""Images for Qwen3.5 / Qwen3.6 on vLLM 0.6.3's V0 engine: prompts, profiling and per-chunk inputs.

Where each step happens and why there:

* **Admission** (:func:`input_processor`, the engine's input processor, at ``add_request``):
  every image is resized and cut into patches here, and each ``<|image_pad|>`` of the prompt is
  expanded to the image's token count. A bad image (no area, aspect ratio above 200, not an
  image, more pads than images) fails this one request with a ``ValueError`` before it is ever
  scheduled -- the engine step never sees it. The request's ``multi_modal_data["image"]`` becomes
  a list of :class:`Qwen3_5Image` (patches, grid, where its tokens start in the prompt).
* **Each step** (:func:`compute_multi_modal_input`, called by patch 0014 from V0's model-input
  builder for every scheduled sequence group that carries images): V0 hands a prompt's images to
  *every* prefill chunk of it (and to its decode steps while any prefill is scheduled), and its
  own MRoPE code gives the positions of the whole rest of the prompt to a chunk (the
  "chunk/prefix misalignment" that killed a peer's engine). Here a chunk ``[context, seq_len)``
  gets exactly its own 3-D positions, and only the images whose tokens it contains, with the
  embedding row and the batch index of each of its image tokens. An image that crosses a chunk
  boundary is encoded in both chunks; each chunk takes its own rows.
* **The model** (``Qwen3_5MoeForConditionalGeneration.forward``) encodes the images a step
  needs and writes their rows at those batch indices over the token embeddings.

Image token ids (prefix caching): V0 hashes a block by its token ids only, so two different
images of the same size after the same text would share cached blocks (KV and GDN states of the
wrong image). The model never reads the ids at image positions (the tower's rows replace their
embeddings, and :func:`compute_multi_modal_input` finds images by their spans, not by ids), so
the input processor writes there ids drawn from a hash of the image's pixels, from the
embedding rows that no tokenizer token uses (ids ``len(tokenizer)`` .. ``vocab_size - 1``): the
same image gives the same ids (a real hit), a different one different ids. Those ids are never
sampled text; a request's ``prompt_token_ids`` show them instead of ``<|image_pad|>``.

3-D positions (Qwen3.5's interleaved MRoPE; text tokens carry one position on all three axes):
an image whose first token is at prompt index ``s`` starts at ``base = s + shift`` (``shift``:
what the earlier images moved the positions) and its token at grid cell ``(r, c)`` gets
``(base, base + r, base + c)``; the image advances the position by ``max(h, w)`` instead of its
``h * w`` tokens, so ``shift`` grows by ``max(h, w) - h * w``. Generated tokens continue at
``index + shift`` (V0's ``mrope_position_delta``, which the runner applies to decode steps).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .qwen3_5_vision import Qwen3_5ImageProcessor

logger = logging.getLogger(__name__)

# Keys of the per-step multimodal kwargs the model reads.
MM_KEYS = ("pixel_values", "image_grid_thw", "image_rows", "image_token_index")


@dataclass
class Qwen3_5Image:
    """One processed image of a prompt."""

    pixel_values: torch.Tensor  # [t*h*w, C*T*P*P], patches in merge-block order
    grid_thw: tuple[int, int, int]  # patches
    merge: int
    start: int  # prompt index of its first token

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid_thw
        return t, h // self.merge, w // self.merge

    @property
    def num_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w


@functools.lru_cache(maxsize=8)
def image_processor(model_dir: str, max_pixels: int | None = None) -> Qwen3_5ImageProcessor:
    """The checkpoint's processor; ``max_pixels`` (``--mm-processor-kwargs '{"max_pixels": N}'``,
    which vLLM 0.6.3 passes to every callback below) lowers its largest image for an operator
    who wants the vision tower's cost bounded."""
    proc = Qwen3_5ImageProcessor.from_pretrained(model_dir)
    if max_pixels is not None:
        if max_pixels < proc.min_pixels:
            raise ValueError(f"max_pixels {max_pixels} is below min_pixels {proc.min_pixels}")
        proc.max_pixels = min(proc.max_pixels, int(max_pixels))
    return proc


def _hf_config(ctx: Any) -> Any:
    return ctx.model_config.hf_config


@functools.lru_cache(maxsize=8)
def _free_id_range(tokenizer: str, vocab_size: int, revision: str | None) -> tuple[int, int]:
    """Embedding rows no tokenizer token uses: ``[len(tokenizer), vocab_size)``."""
    from transformers import AutoTokenizer

    used = len(AutoTokenizer.from_pretrained(tokenizer, revision=revision))
    return used, vocab_size


def image_token_ids(image: Qwen3_5Image, free: tuple[int, int]) -> list[int]:
    """Ids for an image's positions, a function of its pixels and grid (see the module doc)."""
    lo, hi = free
    h = hashlib.sha256(repr(image.grid_thw).encode())
    h.update(image.pixel_values.float().contiguous().view(torch.uint8).numpy().tobytes())
    digest = h.digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randint(lo, hi, (image.num_tokens,), generator=gen).tolist()


# --------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------


def mrope_positions(images: list[Qwen3_5Image], a: int, b: int) -> tuple[torch.Tensor, int]:
    """``([3, b - a] positions of prompt/output indices [a, b), delta)`` (see the module doc)."""
    out = torch.arange(a, b, dtype=torch.long).unsqueeze(0).repeat(3, 1)
    shift = 0
    for img in sorted(images, key=lambda i: i.start):
        s, n = img.start, img.num_tokens
        _, lh, lw = img.llm_grid
        lo, hi = max(s, a), min(s + n, b)
        if lo < hi:
            j = torch.arange(lo - s, hi - s)
            base = s + shift
            out[0, lo - a : hi - a] = base
            out[1, lo - a : hi - a] = base + (j // lw) % lh
            out[2, lo - a : hi - a] = base + j % lw
        step = max(lh, lw) - n
        shift += step
        # Everything after this image moves by its step (later images overwrite their own).
        after = max(s + n, a) - a
        if after < b - a:
            out[:, after:] += step
    return out, shift


# --------------------------------------------------------------------------------------------
# Admission: the engine's input processor
# --------------------------------------------------------------------------------------------


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def input_processor(ctx: Any, inputs: Any, *, max_pixels: int | None = None) -> Any:
    """Process the request's images and expand each ``<|image_pad|>`` to its token count."""
    mm = inputs.get("multi_modal_data")
    if not mm:
        return inputs
    unsupported = sorted(set(mm) - {"image"})
    if unsupported:
        raise ValueError(f"this model takes images only, not {', '.join(unsupported)}")
    raw = _as_list(mm["image"])
    if raw and all(isinstance(i, Qwen3_5Image) for i in raw):
        return inputs  # already processed (a re-submitted prompt)
    cfg = _hf_config(ctx)
    ids = inputs.get("prompt_token_ids")
    if ids is None:
        raise ValueError("image prompts need token ids")
    pad = cfg.image_token_id
    n_pads = sum(1 for t in ids if t == pad)
    if n_pads != len(raw):
        raise ValueError(f"the prompt has {n_pads} image placeholder(s) for {len(raw)} image(s)")
    proc = image_processor(ctx.model_config.model, max_pixels)
    dtype = ctx.model_config.dtype
    processed = []
    for k, image in enumerate(raw):
        try:
            pv, grid = proc.preprocess(image)
        except ValueError as e:
            raise ValueError(f"image {k + 1}: {e}") from None
        except Exception as e:  # PIL decoding errors of a truncated file and the like
            raise ValueError(f"image {k + 1} could not be processed: {e}") from None
        processed.append((pv.to(dtype), grid))
    mc = ctx.model_config
    free = _free_id_range(mc.tokenizer, mc.hf_text_config.vocab_size, mc.tokenizer_revision)
    new_ids: list[int] = []
    images: list[Qwen3_5Image] = []
    k = 0
    for t in ids:
        if t != pad:
            new_ids.append(t)
            continue
        pv, grid = processed[k]
        img = Qwen3_5Image(pv, grid, proc.merge_size, start=len(new_ids))
        if free[0] < free[1]:
            new_ids.extend(image_token_ids(img, free))
        else:  # no unused rows: every image reads as pads (and V0 cannot tell them apart)
            new_ids.extend([pad] * img.num_tokens)
        images.append(img)
        k += 1
    return {**inputs, "prompt_token_ids": new_ids, "multi_modal_data": {"image": images}}


# --------------------------------------------------------------------------------------------
# Registry callbacks: mapper, max tokens, profiling data
# --------------------------------------------------------------------------------------------


def image_input_mapper(ctx: Any, data: Any) -> Any:
    """Every image of a prompt as model kwargs. V0's runner does not call this for our model
    (patch 0014 builds per-chunk inputs instead); it is what the registry requires."""
    from vllm.multimodal import MultiModalInputs

    images = _as_list(data)
    if not all(isinstance(i, Qwen3_5Image) for i in images):
        raise ValueError("images must go through the model's input processor first")
    rows = torch.arange(sum(i.num_tokens for i in images))
    return MultiModalInputs(
        {
            "pixel_values": torch.cat([i.pixel_values for i in images]),
            "image_grid_thw": torch.tensor([i.grid_thw for i in images]),
            "image_rows": rows,
            "image_token_index": torch.cat(
                [torch.arange(i.start, i.start + i.num_tokens) for i in images]
            ),
        }
    )


def max_image_tokens(ctx: Any, *, max_pixels: int | None = None) -> int:
    return image_processor(ctx.model_config.model, max_pixels).max_tokens()


def dummy_data(
    ctx: Any, seq_len: int, mm_counts: Mapping[str, int], *, max_pixels: int | None = None
) -> tuple[Any, Any]:
    """Profiling: a prompt of ``seq_len`` tokens (V0 profiles one step's worth) holding the
    largest square image whose tokens fit in it, capped by the processor's largest image; the
    other allowed images are empty and sit past the end (V0 asks for ``limit`` items).

    As vLLM's own Qwen2-VL profile does, the image fits the profiled step: an image larger than
    a chunk (up to 16,384 tokens at the checkpoint's 16,777,216 pixels against an 8,192-token
    chunk) needs more activation memory in the tower than was profiled -- about linear in its
    patches, since attention runs in bounded query blocks -- which the memory left outside
    ``--gpu-memory-utilization`` must hold; ``max_pixels`` bounds it."""
    from vllm.sequence import SequenceData

    cfg = _hf_config(ctx)
    proc = image_processor(ctx.model_config.model, max_pixels)
    side = max(1, math.isqrt(max(1, min(proc.max_tokens(), seq_len - 2))))
    px = side * proc.factor
    pv, grid = proc.patchify(torch.zeros(3, px, px, dtype=ctx.model_config.dtype))
    count = max(1, int(mm_counts.get("image", 1)))
    first = Qwen3_5Image(pv, grid, proc.merge_size, start=1)
    empty = Qwen3_5Image(pv[:0], (1, 0, 0), proc.merge_size, start=seq_len + 1)
    n = first.num_tokens
    ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
    ids += [0] * (seq_len - len(ids))
    return SequenceData.from_seqs(ids), {"image": [first] + [empty] * (count - 1)}


# --------------------------------------------------------------------------------------------
# Each step: per-chunk inputs (called by patch 0014)
# --------------------------------------------------------------------------------------------


def compute_multi_modal_input(builder: Any, inter_data: Any, seq_group_metadata: Any) -> bool:
    """Lay out one sequence group's images for this step. False: not our images (vLLM goes on
    with its own code)."""
    mm = seq_group_metadata.multi_modal_data
    images = _as_list(mm.get("image")) if mm else []
    if not images or not all(isinstance(i, Qwen3_5Image) for i in images):
        return False
    from vllm.multimodal import MultiModalInputs

    # This group's first token in the step's flattened batch (groups are laid out in order).
    offset = 0
    for data in builder.inter_data_list:
        if data is inter_data:
            break
        offset += sum(data.query_lens)
    if inter_data.mrope_input_positions is None:
        inter_data.mrope_input_positions = [None] * inter_data.n_seqs
    needed: list[int] = []
    where: list[tuple[int, int, int]] = []  # (image, first row within it, batch index) runs
    lengths: list[int] = []
    for i, seq_id in enumerate(inter_data.seq_ids):
        a, b = inter_data.context_lens[i], inter_data.seq_lens[i]
        pos, delta = mrope_positions(images, a, b)
        inter_data.mrope_input_positions[i] = pos.tolist()
        seq_group_metadata.seq_data[seq_id].mrope_position_delta = delta
        if inter_data.is_prompt:
            for k, img in enumerate(images):
                lo, hi = max(img.start, a), min(img.start + img.num_tokens, b)
                if lo < hi:
                    if k not in needed:
                        needed.append(k)
                    where.append((k, lo - img.start, offset + lo - a))
                    lengths.append(hi - lo)
        offset += inter_data.query_lens[i]
    if not needed:
        return True
    needed.sort()
    first_row = {}
    row = 0
    for k in needed:
        first_row[k] = row
        row += images[k].num_tokens
    rows = torch.cat(
        [torch.arange(n) + first_row[k] + r0 for (k, r0, _), n in zip(where, lengths, strict=True)]
    )
    index = torch.cat([torch.arange(n) + b0 for (_, _, b0), n in zip(where, lengths, strict=True)])
    inter_data.multi_modal_inputs = MultiModalInputs(
        {
            "pixel_values": torch.cat([images[k].pixel_values for k in needed]),
            "image_grid_thw": torch.tensor([images[k].grid_thw for k in needed]),
            "image_rows": rows,
            "image_token_index": index,
        }
    )
    return True


def per_group(value: Any) -> list[torch.Tensor]:
    """A batched multimodal kwarg (stacked tensor or list) as one tensor per sequence group."""
    return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)
