#!/usr/bin/env python3
"""Transient device memory of the platform line's PyTorch op paths at one forward's size.

    python worklogs/v0_activation_probe.py [--tokens 8192] [--seqs 16] [--out probe.json]

What `make preflight`'s V0 memory model charges as the profiling forward's activation peak
(vllm_overrides/preflight.py, ``V0_ACTIVATION``) is measured here, per TP4 rank of
Qwen3.6-35B-A3B in fp16, as ``torch.cuda.max_memory_allocated`` above what was allocated before
the call (inputs and weights excluded, outputs included), for each op family the V0 model runs
on a chunk of ``--tokens`` tokens split into ``--seqs`` sequences (V0's ``profile_run`` shape):

* ``moe``: router sort + routed experts (per-expert loop, the card's torch 2.1 has no
  ``_grouped_mm``) + gather combine + shared expert (``vllm_overrides.native.moe``);
* ``gdn_chunk``: the chunked gated delta rule, PyTorch path (``native.gdn``);
* ``attention_profile``: prefill attention of the profile's sequences (no cache);
* ``attention_long``: one chunk of ``--tokens`` new tokens over a 65,536-token cached context;
* ``vision``: the vision tower (``engines/v0/qwen3_5_vision.py``, replicated on every rank, not
  sharded) on the square image V0's profile puts into a ``--tokens`` step (``dummy_data``:
  ``isqrt(tokens - 2)`` merged tokens a side).

Needs a CUDA device (the allocator's counters); the card's allocator is PyTorch's too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_overrides.native import gdn, moe  # noqa: E402
from vllm_overrides.native import paged_attention as pa  # noqa: E402

H, E, K_TOP, I_RANK, IS_RANK = 2048, 256, 8, 128, 128  # hidden, experts, top-k, per-rank inter
QH, KVH, HD = 4, 1, 256  # attention heads per rank
GK, GV, DK = 4, 8, 128  # GDN key / value heads per rank, head dim


def peak(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    del out
    return int(used)


def vision(tokens: int, dev: torch.device, dt: torch.dtype) -> tuple[int, int]:
    """Peak of the vision tower's forward (Qwen3.6's tower sizes) on the profile's image."""
    import math
    from types import SimpleNamespace

    from vllm_overrides.engines.v0.qwen3_5_vision import Qwen3_5VisionTransformer

    vc = SimpleNamespace(hidden_size=1152, num_heads=16, spatial_merge_size=2, in_channels=3,
                         temporal_patch_size=2, patch_size=16, num_position_embeddings=2304,
                         depth=27, intermediate_size=4304, out_hidden_size=2048,
                         rope_parameters=None)  # fmt: skip
    tower = Qwen3_5VisionTransformer(vc).to(device=dev, dtype=dt).eval()
    side = math.isqrt(tokens - 2)  # merged tokens a side
    h = w = 2 * side
    pixels = torch.randn(h * w, 3 * 2 * 16 * 16, device=dev, dtype=dt)
    with torch.inference_mode():
        used = peak(lambda: tower(pixels, [(1, h, w)]))
    return used, side * side


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev, dt, T = torch.device("cuda"), torch.float16, args.tokens
    torch.manual_seed(0)
    res: dict[str, object] = {"tokens": T, "seqs": args.seqs}
    res["device"] = torch.cuda.get_device_name()

    x = torch.randn(T, H, device=dev, dtype=dt)
    router = torch.randn(E, H, device=dev, dtype=dt) * 0.02
    w13 = torch.randn(E, 2 * I_RANK, H, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(E, H, I_RANK, device=dev, dtype=dt) * 0.02
    sgu = torch.randn(2 * IS_RANK, H, device=dev, dtype=dt) * 0.02
    sd = torch.randn(H, IS_RANK, device=dev, dtype=dt) * 0.02
    sg = torch.randn(1, H, device=dev, dtype=dt) * 0.02
    moe._CSR_OK[(dev.type, torch.cuda.current_device(), dt)] = False  # gather: the larger

    def moe_block() -> torch.Tensor:
        return moe.sparse_moe_block(x, router, w13, w2, K_TOP, True, sgu, sd, sg,
                                    prefill_method="loop")  # fmt: skip

    res["moe"] = peak(moe_block)

    q = torch.randn(1, T, GK, DK, device=dev, dtype=dt)
    k = torch.randn(1, T, GK, DK, device=dev, dtype=dt)
    v = torch.randn(1, T, GV, DK, device=dev, dtype=dt)
    g = -torch.rand(1, T, GV, device=dev, dtype=torch.float32)
    beta = torch.rand(1, T, GV, device=dev, dtype=dt)
    per = T // args.seqs
    cu = torch.arange(0, T + 1, per, device=dev, dtype=torch.long)

    def gdn_chunk() -> object:
        return gdn.chunk_gated_delta_rule(q, k, v, g, beta, None, None, True, cu,
                                          use_qk_l2norm_in_kernel=True)  # fmt: skip

    res["gdn_chunk"] = peak(gdn_chunk)

    aq = torch.randn(T, QH, HD, device=dev, dtype=dt)
    ak = torch.randn(T, KVH, HD, device=dev, dtype=dt)
    av = torch.randn(T, KVH, HD, device=dev, dtype=dt)

    def attn_profile() -> torch.Tensor:
        return pa.prefill_attention(aq, ak, av, None, None, None, [per] * args.seqs,
                                    [0] * args.seqs, HD**-0.5)  # fmt: skip

    res["attention_profile"] = peak(attn_profile)
    ctx, bs = 65_536, 16
    blocks = (ctx + T) // bs
    kv = torch.randn(pa.kv_cache_shape(blocks, bs, KVH, HD), device=dev, dtype=dt)
    kc, vc = pa.split_kv_cache(kv)
    table = torch.arange(blocks, device=dev, dtype=torch.int32).view(1, -1)

    def attn_long() -> torch.Tensor:
        return pa.prefill_attention(aq, ak, av, kc, vc, table, [T], [ctx], HD**-0.5)

    res["attention_long"] = peak(attn_long)
    res["vision"], res["vision_tokens"] = vision(T, dev, dt)
    res["per_token"] = {
        name: round(res[name] / T, 1)  # type: ignore[operator]
        for name in ("moe", "gdn_chunk", "attention_profile", "attention_long", "vision")
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
