#!/usr/bin/env python3
"""GDN chunk prefill kernels alone, one TP4 shard of Qwen3.6-35B-A3B (H 4, HV 8, K = V = 128,
bf16 or fp16, one sequence or ``--seqs`` equal ones): per-kernel GPU time by torch.profiler,
for A/B runs of a kernel change and as the target of an Nsight Compute run (``ncu
--kernel-name regex:state_mma ... python3 this``); ``--err`` adds the output's and final
state's errors against float64.

    NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused \\
        python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worklogs/: kernel_bench's error
from kernel_bench import rel  # noqa: E402
from profiler_timing import kernel_us  # noqa: E402

from vllm_overrides.native import gdn, kernels  # noqa: E402
from vllm_overrides.native import gdn_reference as gref  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default="")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--err", action="store_true", help="errors against the float64 reference")
    p.add_argument(
        "--seqs", type=int, default=1, help="T split into this many equal sequences (varlen)"
    )
    a = p.parse_args()
    if not 1 <= a.seqs <= a.T:
        p.error("--seqs must be between 1 and --T")
    dt = getattr(torch, a.dtype)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T, H, HV, K, V = a.T, 4, 8, 128, 128
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1.0, 16.0))
    g, beta = gdn.gdn_gating(
        A_log, torch.randn(T, HV, device=dev) - 2.0, torch.randn(HV, device=dev) * 0.5,
        torch.randn(T, HV, device=dev),
    )  # fmt: skip
    q = torch.randn(1, T, H, K, device=dev, dtype=dt)
    k = torch.randn(1, T, H, K, device=dev, dtype=dt)
    v = torch.randn(1, T, HV, V, device=dev, dtype=dt)
    h0 = torch.randn(a.seqs, HV, V, K, device=dev) * 0.05
    cu = torch.tensor([T * i // a.seqs for i in range(a.seqs + 1)], device=dev, dtype=torch.long)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.chunk_gated_delta_rule(
            q, k, v, g[None], beta[None], initial_state=h0, output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    rows = kernel_us(run, a.reps)
    total = sum(rows.values())
    for n, t in sorted(rows.items(), key=lambda r: -r[1]):
        print(f"{t:9.1f} us  {n}")
    print(f"{total:9.1f} us  total per call (T={T}, {a.seqs} sequence(s), {a.dtype})")
    out = {"T": T, "seqs": a.seqs, "dtype": a.dtype, "us_per_call": rows, "total_us": total}
    if a.err:
        o, fin = run()
        ro, rfin = gref.gated_delta_rule_reference_fast(
            q[0], k[0], v[0], g, beta, cu.tolist(), initial_state=h0, use_qk_l2norm=True
        )
        out["err_out"], out["err_final_state"] = rel(o[0], ro), rel(fin, rfin)
        print(
            f"errors vs float64: output {out['err_out']:.2e}, final state "
            f"{out['err_final_state']:.2e}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
