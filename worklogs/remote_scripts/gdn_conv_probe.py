#!/usr/bin/env python3
"""GDN prefill front end alone (``kernels.gdn_conv_prep``: the causal conv1d + q/k L2 norms +
gates), one TP4 shard of Qwen3.6-35B-A3B (H 4, HV 8, K = V = 128, so D = 2048), one fresh
sequence: GPU time per kernel by torch.profiler against its copy floor (the bytes it must move
at the copy rate the step benchmark's ``copy_gbps`` measures in the same run), for A/B runs of
a kernel change.

    NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 \\
        python3 worklogs/remote_scripts/gdn_conv_probe.py --T 16384 --reps 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worklogs/: the copy rate
from decode_step_bench import copy_gbps  # noqa: E402
from profiler_timing import kernel_us  # noqa: E402

from vllm_overrides.native import kernels  # noqa: E402

H, HV, K, V, W = 4, 8, 128, 128, 4


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--json", default="")
    a = p.parse_args()
    dt, dev, T = getattr(torch, a.dtype), torch.device("cuda"), a.T
    torch.manual_seed(0)
    D = 2 * H * K + HV * V
    # x: a column slice of a wider projection output, as mixed_qkv is in the engine.
    x = torch.randn(T, D + 1024, device=dev, dtype=dt)[:, :D]
    w = torch.randn(D, W, device=dev, dtype=dt) * 0.5
    store = torch.randn(2, W - 1, D, device=dev, dtype=dt)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    slots = torch.tensor([1], device=dev, dtype=torch.long)
    has_init = torch.tensor([False], device=dev)
    ga = torch.randn(T, HV, device=dev, dtype=dt)
    gb = torch.randn(T, HV, device=dev, dtype=dt)
    A_log = torch.zeros(HV, device=dev)
    dt_bias = torch.zeros(HV, device=dev)

    def run() -> tuple:
        return kernels.gdn_conv_prep(
            x, w, None, store.transpose(1, 2), cu, slots, has_init, "silu", ga, gb, A_log,
            dt_bias, H, K, V, apply_l2norm=True,
        )  # fmt: skip

    run()
    assert "gdn_conv_prep" in kernels.FUSED_USED, "the fused kernel did not serve"
    rows = kernel_us(run, a.reps)
    copy_GBps = copy_gbps(dev, smoke=False)
    # Read x, a, b; write q, k, v, g, beta (float32).
    moved = T * D * dt.itemsize * 2 + T * HV * (2 * dt.itemsize + 2 * 4)
    floor_us = moved / copy_GBps / 1e3
    total = sum(rows.values())
    for n, t in sorted(rows.items(), key=lambda r: -r[1]):
        print(f"{t:9.1f} us  {n}")
    print(
        f"{total:9.1f} us  total per call (T={T}, D={D}, {a.dtype}); copy floor {floor_us:.1f} us "
        f"({moved / 1e6:.1f} MB at {copy_GBps:.0f} GB/s) = {total / floor_us:.2f}x"
    )
    out = {
        "T": T, "D": D, "dtype": a.dtype, "us_per_call": rows, "total_us": total,
        "floor_us": floor_us, "copy_GBps": copy_GBps,
    }  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
