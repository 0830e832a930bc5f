#!/usr/bin/env python3
"""The MoE prefill GEMMs alone, one TP4 shard of Qwen3.6-35B-A3B (E 256, H 2048, I 128, top-8,
bf16 or the target's fp16, 16K tokens): our grouped GEMMs (``moe_grouped_gemm``) beside
torch._grouped_mm on the same routing, each timed by CUDA-graph replay, and the whole
``moe_prefill`` per method. For A/B runs of a kernel change: run it from each tree (its own JIT
build).

It also prints the ceiling of the stock design (route, permute, two ``torch._grouped_mm``, act,
combine): the two library GEMMs as measured plus the permute, act and combine at the copy
floor of the bytes they must move (the copy rate measured in the same run), the routing as
measured. No kernel of that design can make the whole op faster than that.

    NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 python3 worklogs/remote_scripts/moe_gemm_probe.py
    ncu --kernel-name regex:moe_grouped_gemm --section SpeedOfLight --section Occupancy \
        --section WarpStateStats python3 worklogs/remote_scripts/moe_gemm_probe.py --once
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from cuda_graph_timing import graph_replay_ms  # this script's folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worklogs/: the copy rate
from decode_step_bench import copy_gbps  # noqa: E402

from vllm_overrides.native import kernels  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--label", default="")
    p.add_argument("--json", default="")
    p.add_argument("--once", action="store_true", help="each of our GEMMs once, eager (for ncu)")
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="float16: the target's"
    )
    p.add_argument(
        "--runs",
        default="",
        help="comma-separated column blocks a block walks (moe_grouped_gemm's run) to time our"
        " GEMMs at besides the kernel's own choice, e.g. 1,2,4,8,16",
    )
    p.add_argument(
        "--split",
        default="",
        help="comma-separated stream counts: also time moe_prefill with the tokens cut into that"
        " many parts, each on its own stream, so one part's row movement can overlap another's"
        " GEMMs (e.g. 2,4)",
    )
    a = p.parse_args()
    assert kernels.extension_loaded(), kernels._load_error
    dev, dt = torch.device("cuda"), getattr(torch, a.dtype)
    torch.manual_seed(0)
    T, E, H, I, k = a.T, 256, 2048, 128, 8  # noqa: E741
    x = torch.randn(T, H, device=dev).to(dt)
    logits = torch.randn(T, E, device=dev).to(dt)
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dt)
    w2 = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dt)
    ops = torch.ops.vo_kernels
    w, ids, counts, slot = ops.moe_route_count(logits, k, True)
    src, ws, inverse, ends, tiles = ops.moe_order(w, ids, counts, slot)
    xs, ws_p, _, ends_p = ops.moe_permute(x, w, ids, counts, slot)
    act = ops.moe_grouped_gemm(x, src, w13, ends, tiles, ws)
    if a.once:
        ops.moe_grouped_gemm(act, None, w2, ends, tiles, None)
        torch.cuda.synchronize()
        return 0
    # torch._grouped_mm is bf16-only on the H200 (fp16 takes a loop with host copies, which a
    # graph cannot capture): the stock cases and its ceiling are bf16's.
    stock = dt == torch.bfloat16
    if stock:
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends_p)
        act_p = ops.moe_act(h, ws_p)
        y = torch._grouped_mm(act_p, w2.transpose(1, 2), offs=ends_p)
    P = T * k
    up, down = 4 * P * H * I, 2 * P * H * I
    cases: dict[str, tuple[Callable[[], object], float]] = {
        "route": (lambda: ops.moe_route_count(logits, k, True), 0.0),
        "order": (lambda: ops.moe_order(w, ids, counts, slot), 0.0),
        "permute": (lambda: ops.moe_permute(x, w, ids, counts, slot), 0.0),
        "wmma_gate_up": (lambda: ops.moe_grouped_gemm(x, src, w13, ends, tiles, ws), up),
        "wmma_down": (lambda: ops.moe_grouped_gemm(act, None, w2, ends, tiles, None), down),
    }
    if stock:
        cases |= {
            "stock_gate_up": (lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends_p), up),
            "act": (lambda: ops.moe_act(h, ws_p), 0.0),
            "stock_down": (lambda: torch._grouped_mm(act_p, w2.transpose(1, 2), offs=ends_p), down),
            "combine": (lambda: ops.moe_combine(y, inverse, k, None, None), 0.0),
        }
    for r in (int(v) for v in a.runs.split(",") if v):
        cases[f"wmma_gate_up_run{r}"] = (
            lambda r=r: ops.moe_grouped_gemm(x, src, w13, ends, tiles, ws, r),
            up,
        )
        cases[f"wmma_down_run{r}"] = (
            lambda r=r: ops.moe_grouped_gemm(act, None, w2, ends, tiles, None, r),
            down,
        )
    for m in ("grouped", "wmma") if stock else ("wmma",):
        cases[f"moe_prefill_{m}"] = (
            lambda m=m: kernels.moe_prefill(x, logits, k, True, w13, w2, None, m),
            up + down,
        )
        for n in (int(v) for v in a.split.split(",") if v):
            cases[f"moe_prefill_{m}_split{n}"] = (
                lambda m=m, n=n: split_streams(
                    lambda xi, li: kernels.moe_prefill(xi, li, k, True, w13, w2, None, m),
                    x,
                    logits,
                    n,
                ),
                up + down,
            )
    out = {
        "label": a.label,
        "T": T,
        "dtype": a.dtype,
        "gpu": torch.cuda.get_device_name(),
        "cases": {},
    }
    for name, (fn, _) in cases.items():  # a split must give the whole op's result
        if "_split" in name:
            whole = cases[name.split("_split")[0]][0]()
            err = (fn().float() - whole.float()).abs().max().item()
            out["cases"][name] = {"max_abs_diff_vs_whole": err}
            print(f"{name}: max |split - whole| = {err:.3g}")
    print(f"{'case':<22} {'graph ms':>9} {'TF/s':>7}")
    for name, (fn, fl) in cases.items():
        ms = graph_replay_ms(fn, rounds=5, replays=a.reps)
        row = {"graph_ms": ms, **({"TFps": fl / (ms * 1e-3) / 1e12} if fl else {})}
        out["cases"][name] = out["cases"].get(name, {}) | row
        print(f"{name:<22} {ms:9.4f} {row.get('TFps', float('nan')):7.1f}")
    if stock:
        out["stock_ceiling"] = ceiling(out["cases"], T, P, H, I, up + down, copy_gbps(dev, False))
        c = out["stock_ceiling"]
        print(
            f"stock design ceiling: {c['ms']:.4f} ms = {c['TFps']:.1f} TF/s (GEMMs"
            f" {c['gemms_ms']:.4f}, route {c['route_ms']:.4f}, copy floors: permute"
            f" {c['permute_floor_ms']:.4f}, act {c['act_floor_ms']:.4f}, combine"
            f" {c['combine_floor_ms']:.4f} at {c['copy_GBps']:.0f} GB/s)"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


_streams: list[torch.cuda.Stream] = []


def split_streams(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    logits: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """``fn`` on ``n`` consecutive token parts, part i on side stream i, joined back on the
    current stream: what the whole op would take if its parts overlapped (capturable)."""
    while len(_streams) < n:
        _streams.append(torch.cuda.Stream())
    main = torch.cuda.current_stream()
    outs = []
    for xi, li, s in zip(x.chunk(n), logits.chunk(n), _streams, strict=False):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(fn(xi, li))
    for s in _streams[:n]:
        main.wait_stream(s)
    return torch.cat(outs)


def ceiling(
    cases: dict[str, dict[str, float]],
    T: int,
    P: int,
    H: int,
    inter: int,
    flops: float,
    gbps: float,
) -> dict[str, float]:
    """The fastest the stock design can be: library GEMMs and routing as measured, the three
    data movers at the copy floor of their 16-bit bytes (read + written, as ``copy_gbps``)."""
    floor = {  # bytes each must read and write
        "permute": (T * H + P * H) * 2,  # x's rows in, every (token, expert) row out
        "act": (P * 2 * inter + P * inter) * 2,  # gate/up in, the product out
        "combine": (P * H + T * H) * 2,  # every expert row in, one row a token out
    }
    res = {f"{n}_floor_ms": b / (gbps * 1e9) * 1e3 for n, b in floor.items()}
    res["gemms_ms"] = cases["stock_gate_up"]["graph_ms"] + cases["stock_down"]["graph_ms"]
    res["route_ms"] = cases["route"]["graph_ms"]
    res["ms"] = sum(res.values())
    res["TFps"] = flops / (res["ms"] * 1e-3) / 1e12
    res["copy_GBps"] = gbps
    return res


if __name__ == "__main__":
    raise SystemExit(main())
