"""Independent oracle: Hugging Face transformers' own Qwen3.5-MoE forward pass, greedy.

Run as a script to (re)compute the reference continuations into a JSON cache:
``python tests/native_engine/hf_oracle.py OUT.json``. The prompts are token-id lists drawn from
the regular vocabulary with a fixed seed, so no chat template or tokenizer round trip is involved.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO_DIR / "build" / "tiny-model"
REGULAR_TOKENS = 248_044  # ids below this are ordinary BPE tokens
PROMPT_LENGTHS = (20, 500, 2000)
MAX_NEW = 64


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, REGULAR_TOKENS) for _ in range(length)]


def prompts() -> dict[str, list[int]]:
    """Named prompts: one per length, a shared-prefix pair (prefix-cache hit), four for the batch."""
    out = {f"len{n}": prompt_ids(n, seed=n) for n in PROMPT_LENGTHS}
    # Same first 1,000 tokens as len2000 (prefix cache), different tail.
    out["prefix_hit"] = out["len2000"][:1000] + prompt_ids(300, seed=7)
    for i in range(4):
        out[f"batch{i}"] = prompt_ids(40 + 30 * i, seed=100 + i)
    return out


def hf_greedy(ids: list[int], max_new: int = MAX_NEW, model: Any = None) -> dict[str, Any]:
    """Greedy continuation in float32 with the chosen tokens' log-probabilities and the gap to
    the runner-up at each step (to judge near-ties)."""
    import torch

    model = model or load_model()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(ids) :].tolist()
    logprobs, gaps = [], []
    for step, scores in enumerate(out.scores):
        lp = torch.log_softmax(scores[0].float(), dim=-1)
        top2 = torch.topk(lp, 2).values
        logprobs.append(float(lp[new[step]]))
        gaps.append(float(top2[0] - top2[1]))
    return {"tokens": new, "logprobs": logprobs, "top2_gap": gaps}


_MODEL: Any = None


def load_model() -> Any:
    global _MODEL
    if _MODEL is None:
        import torch
        from transformers import Qwen3_5MoeForConditionalGeneration

        torch.manual_seed(0)
        _MODEL = Qwen3_5MoeForConditionalGeneration.from_pretrained(
            TINY_MODEL, dtype=torch.float32
        ).eval()
        _MODEL.generation_config.eos_token_id = None
    return _MODEL


def compute_all() -> dict[str, Any]:
    model = load_model()
    return {name: {"prompt": ids, **hf_greedy(ids, model=model)} for name, ids in prompts().items()}


# ---- image prompts (the vision tower and interleaved MRoPE) -------------------------------------

IMAGE_TOKEN, VISION_START, VISION_END = 248_056, 248_053, 248_054
# Image sizes are multiples of patch 16 x merge 2 = 32 and at least the processor's 65,536 pixels,
# so no resize happens: transformers 5's torchvision resize and a PIL one give the same pixels.
IMAGE_PROMPTS: dict[str, dict[str, Any]] = {
    # One image between short texts.
    "image_one": {"texts": [12, 9], "images": [["quadrants", 256, 256]]},
    # Two images; with a 256-token chunk budget the first image's tokens (from index 201) cross
    # the first chunk boundary.
    "image_two": {"texts": [200, 30, 20], "images": [["gradient", 256, 320], ["noise", 288, 256]]},
}


def make_image(kind: str, height: int, width: int) -> Any:
    """A deterministic RGB ``uint8`` array ``[height, width, 3]`` (numpy only, so both venvs
    build the same pixels)."""
    import numpy as np

    if kind == "quadrants":  # four flat colours, like the evaluator's four-quadrant image
        img = np.zeros((height, width, 3), dtype=np.uint8)
        h2, w2 = height // 2, width // 2
        img[:h2, :w2] = (255, 0, 0)
        img[:h2, w2:] = (0, 255, 0)
        img[h2:, :w2] = (0, 0, 255)
        img[h2:, w2:] = (255, 255, 0)
        return img
    if kind == "gradient":
        y = np.linspace(0, 255, height)[:, None]
        x = np.linspace(0, 255, width)[None, :]
        return np.stack([y + 0 * x, 0 * y + x, (y + x) / 2], axis=-1).astype(np.uint8)
    if kind == "noise":
        return np.random.RandomState(height * 1000 + width).randint(
            0, 256, (height, width, 3), dtype=np.uint8
        )
    raise ValueError(kind)


def image_prompt(name: str) -> list[int]:
    """Token ids with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image (what the
    chat template gives; the processor expands each pad to the image's token count)."""
    spec = IMAGE_PROMPTS[name]
    ids: list[int] = []
    for i, n in enumerate(spec["texts"]):
        ids += prompt_ids(n, seed=500 + 10 * i + len(name))
        if i < len(spec["images"]):
            ids += [VISION_START, IMAGE_TOKEN, VISION_END]
    return ids


def compute_images() -> dict[str, Any]:
    """Greedy continuations of the image prompts through transformers' processor and model."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    model = load_model()
    proc = AutoImageProcessor.from_pretrained(TINY_MODEL)
    out: dict[str, Any] = {}
    for name, spec in IMAGE_PROMPTS.items():
        images = [Image.fromarray(make_image(*s)) for s in spec["images"]]
        feats = proc(images=images, return_tensors="pt")
        grid = feats["image_grid_thw"]
        counts = (grid.prod(-1) // proc.merge_size**2).tolist()
        ids, k = [], 0
        for t in image_prompt(name):
            if t == IMAGE_TOKEN:
                ids += [IMAGE_TOKEN] * counts[k]
                k += 1
            else:
                ids.append(t)
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(
                input_ids,
                pixel_values=feats["pixel_values"],
                image_grid_thw=grid,
                mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = gen.sequences[0, len(ids) :].tolist()
        lps = [torch.log_softmax(s[0].float(), -1) for s in gen.scores]
        out[name] = {
            "prompt": image_prompt(name),
            "images": spec["images"],
            "expanded": ids,
            "image_grid_thw": grid.tolist(),
            "tokens": new,
            "logprobs": [float(lp[t]) for lp, t in zip(lps, new, strict=True)],
            "top2_gap": [float(v[0] - v[1]) for v in (torch.topk(lp, 2).values for lp in lps)],
        }
    return out


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_DIR / "build" / "hf_oracle.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({**compute_all(), **compute_images()}))
    print(f"wrote {dest}")
