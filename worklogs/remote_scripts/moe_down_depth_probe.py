#!/usr/bin/env python3
"""How many pairs' weight loads the MoE decode down kernel should keep in flight, by token count.

Needs the probe build: commit af48b6e with
worklogs/results/moe-down-depth-h200-2026-12-03/probe_build_on_af48b6e.patch applied, whose op
reads VO_MOE_DOWN_INFLIGHT (the kept tree has one depth, 1: the probe's answer). This script sets
it to 1, 2, 4 and 8 and times kernels.moe_decode (TP4 shard of Qwen3.6-35B-A3B, bf16, top-8,
with and without the shared expert) under CUDA graph replay and eager, 8 rotating inputs.

    python3 worklogs/remote_scripts/moe_down_depth_probe.py --out $OUT/depth.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_overrides.native import kernels, moe  # noqa: E402


def graph_us(calls: list, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps / len(calls))
    return best


def eager_us(calls: list, reps: int = 30) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            for c in calls:
                c()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps / len(calls))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kernels.jit_build()
    kernels.set_backend("cuda")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    E, H, I, k = 256, 2048, 128, 8  # noqa: E741
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dt)
    w2 = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dt)
    sh = (
        (torch.randn(2 * I, H, device=dev) * H**-0.5).to(dt),
        (torch.randn(H, I, device=dev) * I**-0.5).to(dt),
        (torch.randn(1, H, device=dev) * H**-0.5).to(dt),
    )
    rows = []
    for T in (1, 2, 4, 8, 16, 32):
        sets = []
        for _ in range(8):
            x = torch.randn(T, H, device=dev, dtype=dt)
            w, ids = moe.route(torch.randn(T, E, device=dev), k, True)
            sets.append((x, w, ids))
        for shared in (None, sh):
            ref = None
            for depth in (1, 2, 4, 8):
                os.environ["VO_MOE_DOWN_INFLIGHT"] = str(depth)
                calls = [
                    lambda s=s, shared=shared: kernels.moe_decode(*s, w13, w2, shared) for s in sets
                ]
                out = calls[0]()
                ref = out if ref is None else ref
                row = {
                    "T": T,
                    "shared": shared is not None,
                    "depth": depth,
                    "graph_us": graph_us(calls),
                    "eager_us": eager_us(calls),
                    "max_abs_diff_vs_depth1": float((out.float() - ref.float()).abs().max()),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
