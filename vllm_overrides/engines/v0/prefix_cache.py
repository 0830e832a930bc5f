"""Hybrid prefix caching on vLLM 0.6.3's V0 engine: GDN state checkpoints at KV block boundaries.

Why: V0's prefix cache resumes a prompt from its cached KV blocks, but a Gated-DeltaNet layer
needs its conv and recurrent states *at* the resume point, and V0 keeps none. A hit is
therefore taken only where both exist: the cached KV blocks ``0..k-1`` and a saved GDN state
after block ``k-1`` (a *checkpoint*). Attention and GDN then resume exactly at ``k * block``.

Where checkpoints are saved (at most two per sequence, in the prefill chunk that reaches them):

* the prompt's last full block boundary ``floor(L / block) * block`` (a repeated prompt, and an
  agent's next turn, which extends this prompt, resume there);
* the end of the prompt's first message block (the first ``<|im_end|>``, floored to a block:
  system prompt + tool list, which every session of the same agent shares);
* when the prompt ends on a block boundary and no junction is saved, one block before its end
  (an identical prompt can resume at most there: one token must be computed).

Keyed by the content hash of the KV block that ends at the boundary (vLLM's chained prefix hash,
so the key names the whole prefix), stored in a bounded pool (``VO_GDN_CHECKPOINTS`` slots, LRU;
victims whose KV block is no longer cached go first). A hit looks for the longest cached prefix
whose last block has a checkpoint, so an evicted checkpoint or KV block shrinks the hit to a
boundary that still has both, or to none.

How it is wired (one engine process holds the scheduler and the driver worker; the registry is
an attribute of their shared ``CacheConfig``):

1. ``resume_prefix_hit`` (patch 0014, ``Scheduler._schedule_prefills`` after the blocks are
   allocated): picks the hit, advances the sequence's ``num_computed_tokens`` to it and
   shrinks the chunk, so the scheduler itself skips the cached tokens (no one-token "full hit"
   chunks, which would overwrite cached KV with values computed from a GDN state that does not
   exist), and counts them for ``usage.prompt_tokens_details.cached_tokens``.
2. ``plan_chunk`` (patch 0014, ``Scheduler.schedule``): clips the computed-block list to what
   the scheduler already counted (the GPU runner must not skip further) and plans the chunk's
   checkpoint load and saves.
3. ``step_plan`` (our attention metadata builder, driver worker): the plan rows of the step's
   prefills, in batch order, as a plain list field of the attention metadata, so TP ranks
   1..N-1 get it in the broadcast dict.
4. The model (``qwen3_5.py`` / ``gdn_state.py``) copies loaded checkpoints into the sequences'
   state slots before the forward, and each GDN layer writes its states at the planned offsets.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm.vllm_overrides.prefix_cache")

ATTR = "vo_gdn_checkpoints"  # the registry's attribute on the engine's CacheConfig
ENV_POOL = "VO_GDN_CHECKPOINTS"
DEFAULT_POOL = 32
MAX_SAVES_PER_SEQ = 2
END_OF_MESSAGE = "<|im_end|>"
# One plan row per prefill chunk: [load pool slot, save offset, save slot, save offset, save
# slot]; -1 = none. Offsets count tokens of the chunk's query (0 < offset <= query length).
PLAN_WIDTH = 1 + 2 * MAX_SAVES_PER_SEQ
NO_PLAN = [-1] * PLAN_WIDTH


def pool_size() -> int:
    """Checkpoint slots per rank (``VO_GDN_CHECKPOINTS``; 0 turns hybrid prefix caching off)."""
    raw = os.environ.get(ENV_POOL, "").strip()
    if not raw:
        return DEFAULT_POOL
    try:
        n = int(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_POOL} must be an integer, got {raw!r}") from exc
    if n < 0:
        raise ValueError(f"{ENV_POOL} must be >= 0, got {n}")
    return n


def checkpoint_bytes(
    num_gdn_layers: int,
    conv_dim: int,
    conv_kernel: int,
    num_v_heads: int,
    head_v_dim: int,
    head_k_dim: int,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int = 4,
) -> int:
    """Bytes of one GDN checkpoint on one rank: every GDN layer's conv state
    ``[conv_dim, kernel - 1]`` (model dtype) and recurrent state ``[HV, V, K]`` (float32).

    Per-rank sizes: ``conv_dim = 2 * H_k/tp * K + HV/tp * V``, ``num_v_heads = HV / tp``.
    Qwen3.6-35B-A3B at TP 4, fp16: 30 * (2048 * 3 * 2 + 8 * 128 * 128 * 4) = 16,097,280 bytes
    (15.35 MiB). The per-sequence state slots have the same size.
    """
    conv = conv_dim * (conv_kernel - 1) * conv_dtype_bytes
    ssm = num_v_heads * head_v_dim * head_k_dim * ssm_dtype_bytes
    return num_gdn_layers * (conv + ssm)


def checkpoint_pool_bytes(per_checkpoint: int, slots: int | None = None) -> int:
    """Bytes of the whole checkpoint pool on one rank (``slots`` defaults to :func:`pool_size`)."""
    return per_checkpoint * (pool_size() if slots is None else slots)


# --------------------------------------------------------------------------------------------
# The registry (engine process: scheduler + driver worker)
# --------------------------------------------------------------------------------------------


@dataclass
class CheckpointRegistry:
    """Which block-boundary GDN states exist, in which pool slot; the step's plans."""

    slots: int
    block_size: int
    model_path: str | None = None
    media_token_ids: tuple[int, ...] = ()
    by_hash: OrderedDict[int, int] = field(default_factory=OrderedDict)  # LRU, oldest first
    free: list[int] = field(default_factory=list)
    pinned: set[int] = field(default_factory=set)  # loaded or saved in the step being built
    pending_loads: dict[tuple[str, int], int] = field(default_factory=dict)
    plans: dict[tuple[str, int, int], list[int]] = field(default_factory=dict)
    im_end_id: int | None = None  # None: not looked up yet; -1: none
    hits: int = 0
    saves: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.slots - 1, -1, -1))  # pop() hands out low slots first

    # ---- pool ---------------------------------------------------------------------------

    def lookup(self, content_hash: int | None) -> int | None:
        if content_hash is None:
            return None
        return self.by_hash.get(content_hash)

    def touch(self, content_hash: int) -> None:
        self.by_hash.move_to_end(content_hash)

    def _take_slot(self, is_cached: Any) -> int | None:
        if self.free:
            return self.free.pop()
        victim = None
        # A checkpoint whose KV block was evicted can never be hit again: reuse it first.
        for h, s in self.by_hash.items():
            if s not in self.pinned and not is_cached(h):
                victim = h
                break
        if victim is None:
            for h, s in self.by_hash.items():  # least recently used first
                if s not in self.pinned:
                    victim = h
                    break
        if victim is None:
            return None
        return self.by_hash.pop(victim)

    def register(self, content_hash: int, is_cached: Any) -> int | None:
        """A pool slot for a new checkpoint at the block with ``content_hash`` (None: the pool
        is all pinned by this step)."""
        slot = self._take_slot(is_cached)
        if slot is None:
            return None
        self.by_hash[content_hash] = slot
        self.pinned.add(slot)
        self.saves += 1
        return slot

    # ---- plans --------------------------------------------------------------------------

    def take_plan(self, request_id: str, seq_id: int, context_len: int) -> list[int]:
        return self.plans.pop((request_id, seq_id, context_len), NO_PLAN)

    def clear(self) -> None:
        """Forget every checkpoint (no hit until states are saved again; the KV cache stays)."""
        self.by_hash.clear()
        self.free = list(range(self.slots - 1, -1, -1))
        self.end_step()

    def end_step(self) -> None:
        self.plans.clear()
        self.pending_loads.clear()
        self.pinned.clear()


def keeps_prefix_caching(hf_config: Any) -> bool:
    """Whether a multimodal model keeps V0's prefix caching (patch 0015): vLLM 0.6.3 turns it
    off for every multimodal model because its block hashes cover token ids only, and image
    pads are the same ids for any image. Our input processor (``qwen3_5_mm``) puts ids derived
    from the image's pixels at its positions, so the block hashes see the image; and any plain
    image / video pad id still in a prompt (one that bypassed it) stops the hit before it
    (:func:`first_media`)."""
    from .config import MODEL_TYPE

    return getattr(hf_config, "model_type", None) == MODEL_TYPE


def first_media(token_ids: Sequence[int], media_token_ids: Sequence[int]) -> int:
    """Position of the first image / video pad token (``len(token_ids)`` when none)."""
    first = len(token_ids)
    for t in media_token_ids:
        try:
            first = min(first, token_ids.index(t, 0, first))  # type: ignore[call-arg]
        except ValueError:
            continue
    return first


def attach(cache_config: Any, model_path: str | None, hf_config: Any = None) -> int:
    """Give the engine's ``CacheConfig`` a registry (the model calls this at construction, in
    every rank; only the engine process's scheduler and driver worker use it). Returns the
    pool size the model must allocate (0: prefix caching off or no pool)."""
    if cache_config is None or not getattr(cache_config, "enable_prefix_caching", False):
        return 0
    slots = pool_size()
    # The plan reaches the model (and the other TP ranks) only through our attention
    # backend's metadata; vLLM's own backends would drop it.
    why = None
    if slots == 0:
        why = f"{ENV_POOL}=0: no GDN checkpoints"
    elif os.environ.get("VO_ATTENTION", "").strip().lower() == "vllm":
        why = "VO_ATTENTION=vllm: vLLM's attention metadata cannot carry the checkpoint plan"
    if why is not None:
        logger.warning(
            "%s, so V0's prefix caching is turned off for this hybrid model (a hit would resume "
            "attention without the GDN states of its prefix)",
            why,
        )
        cache_config.enable_prefix_caching = False
        return 0
    block = int(cache_config.block_size)
    media = tuple(
        int(t)
        for t in (getattr(hf_config, "image_token_id", None),
                  getattr(hf_config, "video_token_id", None))
        if t is not None
    )  # fmt: skip
    reg = CheckpointRegistry(
        slots=slots, block_size=block, model_path=model_path, media_token_ids=media
    )
    setattr(cache_config, ATTR, reg)
    logger.info(
        "hybrid prefix caching: GDN checkpoints at %d-token block boundaries, pool of %d",
        block, slots,
    )  # fmt: skip
    return slots


def registry_of(cache_config: Any) -> CheckpointRegistry | None:
    reg = getattr(cache_config, ATTR, None)
    if reg is None or not getattr(cache_config, "enable_prefix_caching", False):
        return None
    return reg


# --------------------------------------------------------------------------------------------
# Scheduler side (patch 0014)
# --------------------------------------------------------------------------------------------


def _gpu_cached(scheduler: Any) -> Any:
    """``content_hash -> bool``: whether the GPU allocator still caches a block with it."""
    try:
        from vllm.utils import Device

        cached = scheduler.block_manager.block_allocator._allocators[Device.GPU]._cached_blocks
    except (AttributeError, KeyError, ImportError):  # another allocator: treat all as cached
        return lambda h: True
    return lambda h: h in cached


def _block_hashes(scheduler: Any, seq: Any) -> list[int | None]:
    table = scheduler.block_manager.block_tables.get(seq.seq_id)
    if table is None:
        return []
    return [b.content_hash for b in table.blocks]


def resume_prefix_hit(scheduler: Any, seq_group: Any, num_new_tokens: int) -> int:
    """After a waiting prompt's blocks were allocated: resume it at the longest cached block
    boundary that has a GDN checkpoint. Returns the chunk size to schedule."""
    reg = registry_of(scheduler.cache_config)
    if reg is None:
        return num_new_tokens
    seqs = seq_group.get_seqs()
    if len(seqs) != 1:
        return num_new_tokens
    seq = seqs[0]
    if seq.data.get_num_computed_tokens() != 0:
        return num_new_tokens
    computed = scheduler.block_manager.get_common_computed_block_ids([seq])
    if not computed:
        return num_new_tokens
    hashes = _block_hashes(scheduler, seq)
    # A plain image / video pad id (not replaced by qwen3_5_mm's content-derived ids) means
    # the block hashes past it do not see the image: never resume past it.
    top = min(len(computed), len(hashes))
    if reg.media_token_ids:
        top = min(top, first_media(seq.get_token_ids(), reg.media_token_ids) // reg.block_size)
    # computed never holds the sequence's last block, so every boundary here is < its length.
    for k in range(top, 0, -1):
        slot = reg.lookup(hashes[k - 1])
        if slot is None:
            continue
        hit = k * reg.block_size
        reg.touch(hashes[k - 1])  # type: ignore[arg-type]
        reg.pinned.add(slot)
        reg.pending_loads[(seq_group.request_id, seq.seq_id)] = slot
        reg.hits += 1
        seq.data.update_num_computed_tokens(hit)
        from vllm_overrides.engines.v0 import prefix_stats

        # The scheduler now skips these tokens itself (the runner sees a context of `hit`), so
        # patch 0012's runner-rule count adds nothing for them: count them here.
        prompt = seq.get_prompt_len()
        done = getattr(seq_group, prefix_stats.ATTR, 0)
        setattr(seq_group, prefix_stats.ATTR, max(done, min(hit, prompt)))
        return max(1, min(num_new_tokens, seq.data.get_num_uncomputed_tokens()))
    return num_new_tokens


def _im_end_id(reg: CheckpointRegistry) -> int:
    if reg.im_end_id is not None:
        return reg.im_end_id
    reg.im_end_id = -1
    if reg.model_path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(reg.model_path)
            found = tok.convert_tokens_to_ids(END_OF_MESSAGE)
            if isinstance(found, int) and found != tok.unk_token_id:
                reg.im_end_id = found
        except Exception as exc:  # noqa: BLE001 - no tokenizer: no junction checkpoints
            logger.warning("no %s token (%s): no system-block checkpoints", END_OF_MESSAGE, exc)
    logger.info("hybrid prefix caching: %s id %d", END_OF_MESSAGE, reg.im_end_id)
    return reg.im_end_id


def save_boundaries(token_ids: Sequence[int], block: int, im_end_id: int) -> list[int]:
    """The block boundaries a sequence of ``token_ids`` saves GDN states at (at most
    :data:`MAX_SAVES_PER_SEQ`, most useful first)."""
    n = len(token_ids)
    last = n // block * block
    out: list[int] = []
    if last > 0:
        out.append(last)
    if im_end_id >= 0:
        try:
            junction = list(token_ids[:last]).index(im_end_id) + 1
        except ValueError:
            junction = 0
        j = junction // block * block
        if 0 < j < last:
            out.append(j)
    if last == n and n - block > 0 and len(out) < MAX_SAVES_PER_SEQ:
        out.append(n - block)
    return out[:MAX_SAVES_PER_SEQ]


def plan_chunk(
    scheduler: Any, seq_group: Any, token_chunk_size: int, computed: list[int]
) -> list[int]:
    """For a scheduled prefill chunk: plan its checkpoint load and saves; return the
    computed-block list clipped to the tokens the scheduler counts as computed (the runner
    then skips nothing beyond them)."""
    reg = registry_of(scheduler.cache_config)
    if reg is None or not seq_group.is_prefill():
        return computed
    seqs = seq_group.get_seqs()
    if len(seqs) != 1:
        return computed
    seq = seqs[0]
    bs = reg.block_size
    ctx = seq.data.get_num_computed_tokens()
    clipped = list(computed[: ctx // bs])
    end = ctx + token_chunk_size
    row = list(NO_PLAN)
    load = reg.pending_loads.pop((seq_group.request_id, seq.seq_id), None)
    if load is not None:
        row[0] = load
    tokens = seq.get_token_ids()
    hashes = _block_hashes(scheduler, seq)
    is_cached = _gpu_cached(scheduler)
    limit = first_media(tokens, reg.media_token_ids) if reg.media_token_ids else len(tokens)
    n_saves = 0
    for x in sorted(save_boundaries(tokens, bs, _im_end_id(reg))):
        # A state past the first image could never be resumed from (resume_prefix_hit).
        if not ctx < x <= min(end, limit) or x // bs > len(hashes):
            continue
        h = hashes[x // bs - 1]
        if h is None:
            continue
        if reg.lookup(h) is not None:
            reg.touch(h)  # this prefix already has its state (an earlier identical prefix)
            continue
        slot = reg.register(h, is_cached)
        if slot is None:
            continue
        row[1 + 2 * n_saves] = x - ctx
        row[2 + 2 * n_saves] = slot
        n_saves += 1
    if row != NO_PLAN:
        reg.plans[(seq_group.request_id, seq.seq_id, ctx)] = row
    return clipped


# --------------------------------------------------------------------------------------------
# Driver worker side: into the attention metadata (broadcast to the other ranks)
# --------------------------------------------------------------------------------------------


def step_plan(cache_config: Any, inter_data_list: Sequence[Any]) -> list[list[int]] | None:
    """The plan rows of the step's prefill sequences in batch order (None: nothing to do)."""
    reg = registry_of(cache_config)
    if reg is None:
        return None
    rows: list[list[int]] = []
    for inter in inter_data_list:
        if not inter.is_prompt:
            continue
        for j, seq_id in enumerate(inter.seq_ids):
            rows.append(reg.take_plan(inter.request_id, seq_id, inter.context_lens[j]))
    reg.end_step()
    if all(r == NO_PLAN for r in rows):
        return None
    return rows
