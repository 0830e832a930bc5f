#!/usr/bin/env python3
"""Repro (open, issue 13): GDN states kept at mid-prompt chunk ends are not served back when
vLLM runs its engine core and worker in separate processes (the server's default), although
vLLM's own scheduler, driven in one process, serves them.

    python worklogs/mp_cache_repro.py --mp 1   # the server's layout (MultiprocExecutor)
    python worklogs/mp_cache_repro.py --mp 0   # engine core + worker in this process

Two prompts from the quick8 dataset share their system prompt + tool list (12,227 tokens; the
first ``<|im_end|>`` at 12,218). With patch 0008 the first prompt's prefill stops at the
block-floored system end (12,032 at block 256) and vLLM keeps that GDN state as a junction;
the second prompt should be served 12,032 tokens from the cache. Measured on dev-cpu (tiny
model, bf16, GDN_NATIVE=1, enforce_eager, max_model_len 65,536, text only):
``--mp 0``: 0 then 12,032 cached; ``--mp 1``: 0 then 0. ``worklogs/cache_sim.py`` (the
scheduler and KV cache manager alone) agrees with ``--mp 0``. The same pattern explains the
pre-issue-13 server's losses on quick8 (replay-boundary states written by a chunk that the
prompt's next chunk continued). States written inside a prompt's *final* chunk (patch 0007's
prefill checkpoint) are served in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "worklogs"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mp", choices=("0", "1"), default="1")
    ap.add_argument("--dataset", type=Path, default=Path("/tmp/perfdata/quick8.jsonl"))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = args.mp
    for key, value in (("GDN_NATIVE", "1"), ("RMSNORM_NATIVE", "1"), ("MOE_NATIVE", "1"),
                       ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")):
        os.environ.setdefault(key, value)  # fmt: skip
    if not args.dataset.exists():
        import generate_official_like_dataset as gen

        gen.main(["--preset", "quick8", "--out", str(args.dataset)])
    import cache_sim
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs, _ = cache_sim.render_dataset(args.dataset, 2, Path("/tmp/cache_sim_tokens"))
    llm = LLM(
        model=str(REPO / "build" / "tiny-model"), dtype="bfloat16", max_model_len=65_536,
        enable_prefix_caching=True, max_num_batched_tokens=8192, enforce_eager=True,
        limit_mm_per_prompt={"image": 0, "video": 0},
    )  # fmt: skip
    cached = []
    for r in reqs:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=[int(x) for x in r["ids"]])],
            SamplingParams(max_tokens=2, temperature=0),
            use_tqdm=False,
        )
        cached.append(out[0].num_cached_tokens)
    print(json.dumps({"mp": args.mp, "prompt_tokens": [len(r["ids"]) for r in reqs],
                      "cached_tokens": cached}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
