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


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_DIR / "build" / "hf_oracle.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(compute_all()))
    print(f"wrote {dest}")
