#!/usr/bin/env python3
"""The decode GEMV (``kernels.linear`` -> ``vo_kernels.dense_linear``) against ``F.linear``
(cuBLAS) at one TP4 rank's decode shapes of Qwen3.6-35B-A3B (issue 14, patch 0011).

Per shape and row count: GPU time per call (CUDA graph of 20 calls replayed, so launch gaps do
not count; once with one weight tensor, L2-resident where it fits, once cycling through copies
that exceed the L2, as a decode step streams its weights), host time per call (back-to-back
eager calls, one sync at the end: the host is the bottleneck there) and the bandwidth the GPU
time implies for the weight bytes. Writes
``gemv_probe.{json,txt}`` to ``--out``. GPU only::

    NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 python3 worklogs/remote_scripts/gemv_probe.py \\
        --out $OUT/gemv
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cuda_graph_timing import graph_replay_ms  # noqa: E402  (this script's folder)
from host_overhead_probe import per_call_us  # noqa: E402  (this script's folder)

from vllm_overrides.native import kernels  # noqa: E402

# (name, N, K) of one TP4 rank: GDN in_proj q|k|v|z|b|a, GDN out_proj, MoE router, attention
# qkv (+ gate) and o_proj, and the LM-head shard (which the engine keeps on F.linear).
SHAPES = [
    ("gdn_in_proj", 3088, 2048),
    ("gdn_out_proj", 2048, 1024),
    ("router", 256, 2048),
    ("attn_qkv", 2560, 2048),
    ("attn_o_proj", 2048, 1024),
    ("lm_head_shard", 62080, 2048),
]


def gpu_us(fn: Callable[[], object]) -> float:
    """us per call, from a graph of 20 calls (the median of 30 replays)."""
    return graph_replay_ms(fn, rounds=30, calls=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    kernels.set_backend("cuda")
    assert kernels.extension_loaded(), kernels._load_error
    dt = getattr(torch, args.dtype)
    rows_out = []
    for name, N, K in SHAPES:
        w = (torch.randn(N, K, device="cuda") * K**-0.5).to(dt)
        for M in [int(m) for m in args.rows.split(",")]:
            x = torch.randn(M, K, device="cuda").to(dt)
            assert torch.ops.vo_kernels.dense_linear_takes(x, w)
            ref = x.double() @ w.double().T
            got = kernels.linear(x, w)
            err = float((got.double() - ref).norm() / ref.norm())
            err_cublas = float((F.linear(x, w).double() - ref).norm() / ref.norm())
            r = {
                "shape": name,
                "N": N,
                "K": K,
                "M": M,
                "rel_err": err,
                "rel_err_cublas": err_cublas,
            }
            # GPU time with the weights streaming from HBM, as in a decode step: the graph's
            # calls cycle through copies of W that together exceed the 50 MB L2.
            copies = [w] + [w.clone() for _ in range(max(1, -(-120 * 2**20 // w.nbytes)) - 1)]
            it = {"i": 0}

            def cold(f: Callable, copies: list = copies, x: torch.Tensor = x, it: dict = it):  # noqa: ANN202
                it["i"] = (it["i"] + 1) % len(copies)
                return f(x, copies[it["i"]])

            for impl, f in (("gemv", kernels.linear), ("cublas", F.linear)):
                g = gpu_us(lambda f=f, cold=cold: cold(f))
                r[f"{impl}_gpu_us_hbm"] = round(g, 2)
                r[f"{impl}_GBps_hbm"] = round(N * K * w.element_size() / g / 1e3, 1)
            for impl, fn in (
                ("gemv", lambda x=x, w=w: kernels.linear(x, w)),
                ("cublas", lambda x=x, w=w: F.linear(x, w)),
            ):
                g = gpu_us(fn)
                r[f"{impl}_gpu_us"] = round(g, 2)
                r[f"{impl}_GBps"] = round(N * K * w.element_size() / g / 1e3, 1)
                r[f"{impl}_host_us"] = round(per_call_us(fn, 1000, 5), 2)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "rows": rows_out,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_probe.json").write_text(json.dumps(out, indent=1))
    head = (
        f"decode GEMV vs F.linear, {out['device']}, torch {out['torch']}, {args.dtype}\n"
        f"{'shape':<14} {'N':>6} {'K':>5} {'M':>2}  {'gemv GPU us':>11} {'cuBLAS GPU us':>13}"
        f"  {'gemv GB/s':>9} {'cuBLAS GB/s':>11}  {'gemv host us':>12} {'cuBLAS host us':>14}"
        f"  {'rel err':>8}  {'gemv/cuBLAS GPU us, W from HBM':>30}"
    )
    lines = [head] + [
        f"{r['shape']:<14} {r['N']:>6} {r['K']:>5} {r['M']:>2}  {r['gemv_gpu_us']:>11.2f} "
        f"{r['cublas_gpu_us']:>13.2f}  {r['gemv_GBps']:>9.0f} {r['cublas_GBps']:>11.0f}  "
        f"{r['gemv_host_us']:>12.2f} {r['cublas_host_us']:>14.2f}  {r['rel_err']:>8.1e}  "
        f"{r['gemv_gpu_us_hbm']:>14.2f} / {r['cublas_gpu_us_hbm']:<13.2f}"
        for r in rows_out
    ]
    (args.out / "gemv_probe.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
