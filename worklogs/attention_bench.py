#!/usr/bin/env python3
"""GPU: our paged attention kernels (csrc/paged_attention.cu) against their floors, one process.

Qwen3.6's attention on one TP4 rank: 4 query heads on 1 kv head, head_dim 256, block size 16,
fp16, eager (one call = what the V0 backend launches for one layer):

* decode at B = 1 over 4K / 32K / 256K cached tokens: time a call, the KV bytes it must read,
  and those bytes over the copy bandwidth measured in the same run (``copy floor``; a device
  copy of 1 GiB, bandwidth = bytes read + written over the time) -- issue 48's target is KV
  bytes / time >= 60 % of that bandwidth at >= 32K;
* prefill: a chunk of 8,192 new tokens over 0 / 32K / 64K cached tokens: time a call, its QK
  and PV FLOPs, and the rate over torch's fp16 matmul rate measured in the same run (an
  8192^3 ``mm``) -- the target is >= 40 %.

The PyTorch path (:mod:`vllm_overrides.native.paged_attention`) is timed beside each kernel.
Blocks are scattered (a random permutation of the cache), as a long-running server's are.

    NATIVE_KERNELS_JIT=1 python worklogs/attention_bench.py [--json OUT.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_overrides.native import kernels  # noqa: E402
from vllm_overrides.native import paged_attention as pa  # noqa: E402

H, KV, D, BS = 4, 1, 256, 16


def timed(fn, iters: int) -> float:  # noqa: ANN001
    """Mean seconds a call, CUDA events around ``iters`` calls after two warm-ups."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / t  # bytes read + written per second


def matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").half()
    b = torch.randn(n, n, device="cuda").half()
    t = timed(lambda: torch.mm(a, b), 10)
    return 2 * n**3 / t


def cache(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = math.ceil(tokens / BS)
    kv = torch.randn(pa.kv_cache_shape(blocks, BS, KV, D), device="cuda").half()
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32)[None]
    kc, vc = pa.split_kv_cache(kv)
    return kc, vc, table


def bench_decode(ctx: int, bw: float, iters: int, torch_path: bool = True) -> dict:
    kc, vc, table = cache(ctx)
    q = torch.randn(1, H, D, device="cuda").half()
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    t_k = timed(lambda: kernels.paged_decode_attention(q, kc, vc, table, lens, scale, ctx), iters)
    assert kernels.PATHS.get("paged_decode") == {"fused"}, kernels.PATHS
    t_t = (
        timed(lambda: pa.decode_attention(q, kc, vc, table, lens, scale, ctx), 3)
        if torch_path
        else 0.0
    )
    kv_bytes = 2 * ctx * KV * D * 2
    floor = kv_bytes / bw
    return {
        "context": ctx, "kernel_ms": t_k * 1e3, "torch_ms": t_t * 1e3,
        "kv_bytes": kv_bytes, "copy_floor_ms": floor * 1e3,
        "kv_bytes_over_time_gbs": kv_bytes / t_k / 1e9,
        "fraction_of_copy_bw": floor / t_k,
    }  # fmt: skip


def bench_prefill(ctx: int, qlen: int, rate: float, iters: int) -> dict:
    kc, vc, table = cache(max(ctx, 1))
    q = torch.randn(qlen, H, D, device="cuda").half()
    k = torch.randn(qlen, KV, D, device="cuda").half()
    v = torch.randn(qlen, KV, D, device="cuda").half()
    scale = D**-0.5
    args = (q, k, v, kc, vc, table, [qlen], [ctx], scale)
    t_k = timed(lambda: kernels.paged_prefill_attention(*args), iters)
    assert kernels.PATHS.get("paged_prefill") == {"fused"}, kernels.PATHS
    t_t = timed(lambda: pa.prefill_attention(*args), iters)
    # Each new token i sees ctx + i + 1 keys: QK and PV, 2 FLOPs a multiply-add, every head.
    pairs = qlen * ctx + qlen * (qlen + 1) // 2
    flops = 2 * 2 * H * D * pairs
    return {
        "context": ctx, "new_tokens": qlen, "kernel_ms": t_k * 1e3, "torch_ms": t_t * 1e3,
        "flops": flops, "kernel_tflops": flops / t_k / 1e12, "torch_tflops": flops / t_t / 1e12,
        "fraction_of_matmul": flops / t_k / rate,
    }  # fmt: skip


def partition_sweep(bw: float, iters: int) -> list[dict]:
    """Decode at 32K / 256K with the partition forced (VO_PAGED_DECODE_PARTITION's knob)."""
    rows = []
    for ctx in (32768, 262144):
        for part in (64, 128, 256, 512):
            kernels.PAGED_DECODE_PARTITION = part
            r = bench_decode(ctx, bw, iters, torch_path=False)
            rows.append({"partition": part, **r})
    kernels.PAGED_DECODE_PARTITION = 0
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    kernels.set_backend("cuda")
    assert kernels.extension_loaded(), kernels._load_error
    it = 5 if args.quick else 50
    bw, rate = copy_bandwidth(), matmul_rate()
    out = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_gbs": bw / 1e9,
        "fp16_matmul_tflops": rate / 1e12,
        "decode": [bench_decode(c, bw, it) for c in (4096, 32768, 262144)],
        "prefill": [bench_prefill(c, 8192, rate, 3) for c in (0, 32768, 65536)],
        "decode_partition_sweep": partition_sweep(bw, it),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
