#!/usr/bin/env python3
"""Whole decode step of one TP4 rank of Qwen3.6-35B-A3B from our native ops (issue 14, item 1).

One rank's step, in the model's order: 40 layers (layers 3, 7, ..., 39 gated full attention,
the rest Gated DeltaNet), each with its ``(1 + w)`` RMSNorms and fused residual adds, its
projections (``kernels.linear``: the decode GEMV; ``F.linear`` with ``--gemv cublas``), its
mixer and the MoE block (router, routed experts, shared expert with its sigmoid gate), then
the final norm and the LM-head shard. Weights are random, states
and caches have their real shapes. The ops are ``vllm_overrides.native.kernels``:

* ``torch``: ``kernels.set_backend("torch")``, the PyTorch-only native ops;
* ``cuda``: ``kernels.set_backend("cuda")``, the fused kernels (skipped with the reason when the
  extension does not load);
* ``fla``: as ``cuda`` (``torch`` when the extension does not load; the row says which) but the
  GDN core is a plain torch conv update + gates + FLA's ``fused_recurrent_gated_delta_rule``
  (Triton) with the final state copied back into the cache slots (fla-core returns it, it does
  not update the cache in place).

Stand-ins (the same in every variant): attention over the KV cache is torch SDPA over a
contiguous per-sequence cache ``[B, kv_heads, context, 256]`` (the new token's k/v written in
place at position context-1 with ``index_copy_``; the 4 q heads of the one kv head go in as 4
query rows, which is exact GQA for one new token) instead of vLLM's paged attention kernel;
the q/k norms, the RoPE on the 64 rotary dims and the gate split are the serving code's
``kernels.qk_norm_rope_gate`` (patch 0010; PyTorch ops in the torch variant). Left out: the
embedding lookup, sampling, and every collective -- on one GPU there is no all-reduce; a TP4
step has 2 per layer + 1 for the LM head (81), counted in the output.

Per case (batch x context x variant): ms per step eager (wall time of N steps / N, CUDA sync
around) and under CUDA-graph replay (one captured step; the reason when capture fails), kernel
launches per step (torch.profiler: CUDA kernels + memcpy/memset of one step, and of one layer of
each type), the floor (weight bytes read per step + state/KV bytes, over the copy bandwidth
measured in this run) and tokens/s. A step decodes one token for each of the B sequences, so
ms/step is each sequence's ms/token and tokens/s = B / step time.

GPU (no vLLM needed: plain torch, optional fla)::

    NATIVE_KERNELS_JIT=1 python3 worklogs/decode_step_bench.py --out $OUT

``--smoke``: tiny shapes on the CPU in seconds (launches are then top-level CPU operators).

``--prefill [T,...]`` (issue 15): the whole *prefill* step instead (:class:`PrefillStep`, same
weights and layers): one sequence of T new tokens (default 16384,65536), "fresh" (zero states,
empty cache) and "resume" (``--prefill-cached`` tokens already in the KV cache and the GDN
states; default as many as T). Per layer the engine's prefill path: GDN projections,
``kernels.gdn_conv_prep`` (conv + post-conv prep; ``torch``: ``gdn.causal_conv1d_prefill`` +
``gdn.post_conv_prep``), the chunk rule (``torch``:
``gdn.chunk_gated_delta_rule``; ``cuda``: ``kernels.chunk_gated_delta_rule`` where it exists;
``fla``: FLA's ``chunk_gated_delta_rule``), ``kernels.rms_norm_gated``; attention: q/k norm +
RoPE + gate, causal torch SDPA over cache + new tokens (stands in for vLLM's prefill attention);
MoE ``moe.sparse_moe_block`` (``cuda``/``fla``: ``kernels.moe_prefill`` where it exists); the LM
head on the last token. Reports ms, tokens/s, the GEMM-FLOP floor at the bf16 ``torch.mm`` rate
measured in the run, a per-part breakdown (each part timed alone + the profiler's top kernels)
and a paper estimate for the target card with the replay's TTFT percentiles. Eager only.
Writes ``prefill_step_bench.{json,txt}``::

    NATIVE_KERNELS_JIT=1 FLA_FLASH_QLA=0 python3 worklogs/decode_step_bench.py --prefill \
        --out $OUT/prefill --budget-s 420
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "worklogs"))

import numpy as np  # noqa: E402
import perf_metrics as pm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_bench import Timer, log  # noqa: E402

from vllm_overrides.native import gdn  # noqa: E402
from vllm_overrides.native import kernels as kn  # noqa: E402
from vllm_overrides.native import moe as moe_mod  # noqa: E402

VARIANTS = ("torch", "cuda", "fla")
NOTES = [
    "one TP4 rank, one GPU: all-reduce left out (2 per layer + 1 LM-head all-gather per step)",
    "attention: torch SDPA over a contiguous [B, kv, ctx, D] cache, new k/v written with "
    "index_copy_ at ctx-1 (stands in for vLLM's paged attention)",
    "q/k norm + RoPE + gate split: kernels.qk_norm_rope_gate (as served, patch 0010); "
    "embedding lookup and sampling left out",
    "ms/step = each sequence's ms/token; tokens/s = B * 1000 / ms",
    "floor: weight bytes (routed experts: expected distinct experts under uniform routing) "
    "+ GDN state read/write + KV read, over the measured copy GB/s (read+write bytes)",
]


@dataclass(frozen=True)
class Shapes:
    """Per-rank shapes at TP4 (defaults: Qwen3.6-35B-A3B)."""

    hidden: int = 2048
    layers: int = 40
    attn_every: int = 4  # layers 3, 7, ... are full attention
    k_heads: int = 4
    v_heads: int = 8
    head_k: int = 128
    head_v: int = 128
    conv: int = 4
    q_heads: int = 4
    kv_heads: int = 1
    head_dim: int = 256
    rotary: int = 64
    rope_theta: float = 1e7
    experts: int = 256
    top_k: int = 8
    inter: int = 128
    shared_inter: int = 128
    vocab: int = 248320 // 4
    eps: float = 1e-6

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.head_k + self.v_heads * self.head_v

    def is_attn(self, i: int) -> bool:
        return (i + 1) % self.attn_every == 0


SMOKE = Shapes(
    hidden=64, layers=4, k_heads=2, v_heads=4, head_k=16, head_v=16, head_dim=32, rotary=8,
    experts=16, top_k=4, inter=16, shared_inter=16, vocab=512,
)  # fmt: skip


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An unquantised linear layer as the engine runs it: ``kernels.linear`` (the decode GEMV for
    <= 8 rows; patch 0011, ``GEMV_NATIVE``) or, with ``--gemv cublas``, ``F.linear``. The LM
    head stays ``F.linear`` (vLLM's LM head does not go through the patched linear method)."""
    return kn.linear(x, w) if GEMV == "native" else F.linear(x, w)


def gdn_in_proj(h: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``q|k|v``, ``z``, ``b``, ``a`` of a GDN layer: one GEMM (the engine's) or, with
    ``--gdn-in-proj split``, upstream's two (``in_proj_qkvz``, ``in_proj_ba``)."""
    if GDN_IN_PROJ == "merged":
        return list(linear(h, w).split(sizes, dim=-1))
    n = sizes[0] + sizes[1]
    qkvz = linear(h, w[:n]).split(sizes[:2], dim=-1)
    return [*qkvz, *linear(h, w[n:]).split(sizes[2:], dim=-1)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# MoE decode: "routed" (the engine's: routing inside the up kernel, 2 launches) or "separate"
# (routing kernel + experts, 3 launches), for an A/B of the fused routing (--moe-decode).
MOE_DECODE = "routed"
# GDN input projections: one GEMM over [qkvz; ba] (the engine's, native/gdn_in_proj.py) or
# upstream's two.
GDN_IN_PROJ = "merged"
# GDN output norm at decode: inside the decode kernel (the engine's, decode-only batches,
# engine.gdn_decode_normed) or its own launch (kernels.rms_norm_gated).
GDN_NORM = "fused"
# Unquantised linear layers: "native" (kernels.linear, the engine with GEMV_NATIVE) or "cublas".
GEMV = "native"


class DecodeStep:
    """Weights of every layer and the states of one (batch, context) case; :meth:`step` runs it."""

    def __init__(self, s: Shapes, dtype: torch.dtype, dev: torch.device) -> None:
        self.s, self.dtype, self.dev = s, dtype, dev
        self.fla: Callable[..., Any] | None = None  # set: FLA does the GDN core

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            t = torch.randn(*shape, device=dev, dtype=dtype)
            return t.mul_(scale if scale is not None else shape[-1] ** -0.5)

        def moe() -> dict[str, torch.Tensor]:
            E, H, inter, Is = s.experts, s.hidden, s.inter, s.shared_inter
            return {
                "router": w(E, H), "w13": w(E, 2 * inter, H), "w2": w(E, H, inter),
                "sh_gu": w(2 * Is, H), "sh_down": w(H, Is), "sh_gate": w(1, H),
            }  # fmt: skip

        H, HVV = s.hidden, s.v_heads * s.head_v
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(s.layers):
            lw = {"in_norm": w(H, scale=0.1), "post_norm": w(H, scale=0.1), **moe()}
            if s.is_attn(i):
                qkv = 2 * s.q_heads * s.head_dim + 2 * s.kv_heads * s.head_dim
                lw.update(
                    qkv=w(qkv, H), q_norm=w(s.head_dim, scale=0.1), k_norm=w(s.head_dim, scale=0.1),
                    o_proj=w(H, s.q_heads * s.head_dim),
                )  # fmt: skip
            else:
                lw.update(
                    in_proj=w(s.conv_dim + HVV + 2 * s.v_heads, H), conv=w(s.conv_dim, s.conv),
                    A_log=torch.empty(s.v_heads, device=dev).uniform_(1.0, 16.0).log_(),
                    dt_bias=torch.randn(s.v_heads, device=dev) * 0.5,
                    gnorm=1.0 + w(s.head_v, scale=0.1), out_proj=w(H, HVV),
                )  # fmt: skip
            self.layers.append(lw)
        self.final_norm = w(H, scale=0.1)
        self.lm_head = w(s.vocab, H)
        inv = 1.0 / s.rope_theta ** (torch.arange(0, s.rotary, 2, device=dev) / s.rotary)
        self.inv_freq = inv.float()

    # -- states of one case ------------------------------------------------------------------

    def set_case(self, B: int, ctx: int) -> None:
        s, dev, dt = self.s, self.dev, self.dtype
        self.B, self.ctx = B, ctx
        self.free_case()
        self.x = torch.randn(B, s.hidden, device=dev, dtype=dt)
        self.slots = torch.arange(1, B + 1, device=dev, dtype=torch.int32)  # slot 0: null block
        self.cu = torch.arange(B + 1, device=dev, dtype=torch.long)
        self.positions = torch.full((B,), ctx - 1, device=dev, dtype=torch.long)
        self.pos_idx = torch.tensor([ctx - 1], device=dev)
        freqs = torch.arange(ctx, device=dev).float()[:, None] * self.inv_freq
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(dt)  # [ctx, rotary]
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(s.layers):
            if s.is_attn(i):
                shape = (B, s.kv_heads, ctx, s.head_dim)
                self.kv[i] = (
                    torch.randn(shape, device=dev, dtype=dt),
                    torch.randn(shape, device=dev, dtype=dt),
                )
            else:
                # vLLM's conv cache is [slots, W-1, D]; the kernels get the transposed view
                buf = torch.randn(B + 1, s.conv - 1, s.conv_dim, device=dev, dtype=dt)
                self.conv[i] = buf.transpose(1, 2)
                self.ssm[i] = torch.randn(
                    B + 1, s.v_heads, s.head_v, s.head_k, device=dev, dtype=torch.float32
                ).mul_(0.05)

    def states(self) -> list[torch.Tensor]:
        """The GDN states a step updates (conv: the transposed views)."""
        return [*self.ssm.values(), *self.conv.values()]

    def free_case(self) -> None:
        self.conv, self.ssm, self.kv = {}, {}, {}

    # -- the step -----------------------------------------------------------------------------

    def attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        s, lw, B = self.s, self.layers[i], h.shape[0]
        nh, nkv, D = s.q_heads, s.kv_heads, s.head_dim
        qkv = linear(h, lw["qkv"])
        q_gate, k, v = qkv.split([2 * nh * D, nkv * D, nkv * D], dim=-1)
        # q and gate interleaved per head; (1 + w) norms, partial NeoX RoPE, the gate split:
        # the serving code's op (patch 0010), one launch on the fused kernels.
        q, k, gate = kn.qk_norm_rope_gate(
            q_gate, k, lw["q_norm"], lw["k_norm"], self.cos_sin, self.positions, s.eps,
            nh, nkv, D, s.rotary,
        )  # fmt: skip
        q = q.view(B, nh, D)
        kc, vc = self.kv[i]
        kc.index_copy_(2, self.pos_idx, k.view(B, nkv, 1, D))
        vc.index_copy_(2, self.pos_idx, v.reshape(B, nkv, 1, D))
        # the q heads of one kv head as query rows: exact GQA for one new token, no mask
        o = F.scaled_dot_product_attention(q.view(B, nkv, nh // nkv, D), kc, vc, scale=D**-0.5)
        o = o.reshape(B, nh * D) * torch.sigmoid(gate.reshape(B, nh * D))
        return linear(o, lw["o_proj"])

    def gated_deltanet(self, i: int, h: torch.Tensor) -> torch.Tensor:
        s, lw, B = self.s, self.layers[i], h.shape[0]
        HV, V = s.v_heads, s.head_v
        mixed_qkv, z, b, a = gdn_in_proj(h, lw["in_proj"], [s.conv_dim, HV * V, HV, HV])
        scale = s.head_k**-0.5
        if self.fla is None:
            core = torch.empty(B, HV, V, device=h.device, dtype=h.dtype)
            zv = z.reshape(B, HV, V)
            fused = GDN_NORM == "fused"
            kn.gdn_decode(
                mixed_qkv, a, b, self.conv[i], lw["conv"], None, lw["A_log"], lw["dt_bias"],
                self.ssm[i], core, self.slots, s.k_heads, scale,
                z=zv if fused else None, norm_weight=lw["gnorm"] if fused else None,
                norm_eps=s.eps,
            )  # fmt: skip
            if fused:
                return linear(core.reshape(B, HV * V), lw["out_proj"])
        else:
            conv = self.conv[i]
            x = gdn.causal_conv1d_decode(mixed_qkv, conv, lw["conv"], None, "silu", self.slots)
            q, k, v = gdn.split_mixed_qkv(x, s.k_heads, s.head_k, V)
            g, beta = gdn.gdn_gating(lw["A_log"], a, lw["dt_bias"], b)
            state = self.ssm[i][1 : B + 1]  # the slots are 1..B
            o, final = self.fla(
                q[None], k[None], v[None], g=g[None], beta=beta[None], scale=scale,
                initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                state_v_first=True, cu_seqlens=self.cu,
            )  # fmt: skip
            state.copy_(final)
            core = o[0]
        y = kn.rms_norm_gated(core, z.reshape(B, HV, V), lw["gnorm"], s.eps)
        return linear(y.reshape(B, HV * V), lw["out_proj"])

    def moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        lw = self.layers[i]
        shared = (lw["sh_gu"], lw["sh_down"], lw["sh_gate"])
        logits = linear(h, lw["router"])
        if MOE_DECODE == "separate":  # the routing launch, then the experts (before 279761c)
            weights, ids = kn.moe_route(logits, self.s.top_k, True)
            return kn.moe_decode(h, weights, ids, lw["w13"], lw["w2"], shared=shared)
        # As the engine (native_moe_experts): routing inside the experts' up kernel.
        return kn.moe_decode_routed(h, logits, self.s.top_k, True, lw["w13"], lw["w2"], shared)

    def layer(
        self, i: int, x: torch.Tensor, res: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lw, eps = self.layers[i], self.s.eps
        if res is None:  # first layer: plain norm, the residual is the input
            h, res = kn.gemma_rms_norm(x, lw["in_norm"], eps), x
        else:
            h, res = kn.gemma_rms_norm(x, lw["in_norm"], eps, res)
        h = self.attention(i, h) if self.s.is_attn(i) else self.gated_deltanet(i, h)
        # (TP4: all-reduce here)
        h, res = kn.gemma_rms_norm(h, lw["post_norm"], eps, res)
        return self.moe(i, h), res  # (TP4: all-reduce of the MoE output)

    def head(self, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h, _ = kn.gemma_rms_norm(x, self.final_norm, self.s.eps, res)
        return F.linear(h, self.lm_head)  # (TP4: all-gather of the vocab shards)

    def step(self) -> torch.Tensor:
        x, res = self.x, None
        for i in range(self.s.layers):
            x, res = self.layer(i, x, res)
        return self.head(x, res)

    def parts(self) -> dict[str, Callable[[], Any]]:
        """One layer of each type (not the first: fused residual add), one MoE block, the head."""
        s, x = self.s, self.x
        gdn_i = next(i for i in range(1, s.layers) if not s.is_attn(i))
        attn_i = next(i for i in range(s.layers) if s.is_attn(i))
        return {
            "gdn_layer": lambda: self.layer(gdn_i, x, x),
            "attn_layer": lambda: self.layer(attn_i, x, x),
            "moe_block": lambda: self.moe(gdn_i, x),
            "head": lambda: self.head(x, x),
        }

    # -- bytes ------------------------------------------------------------------------------

    def bytes_per_step(self) -> dict[str, float]:
        s, B = self.s, self.B
        touched = s.experts * (1 - (1 - s.top_k / s.experts) ** B) / s.experts
        weights = nbytes(self.final_norm) + nbytes(self.lm_head)
        for lw in self.layers:
            for name, t in lw.items():
                weights += nbytes(t) * (touched if name in ("w13", "w2") else 1.0)
        state = 2 * sum(nbytes(t) * B / (B + 1) for t in self.ssm.values())
        state += 2 * sum(nbytes(t) * B / (B + 1) for t in self.conv.values())
        kv = sum(nbytes(k) + nbytes(v) for k, v in self.kv.values())
        return {"weights": weights, "gdn_state_rw": state, "kv_read": kv}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], Any], n: int, dev: torch.device, reps: int = 3) -> list[float]:
    """Wall time of ``n`` calls / ``n`` (synchronised before and after), ``reps`` times."""
    out = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync(dev)
        out.append((time.perf_counter() - t) * 1e3 / n)
    return out


def copy_gbps(dev: torch.device, smoke: bool) -> float:
    """Device copy bandwidth, bytes read + written per second (as kernel_bench's floor)."""
    src = torch.randn((1 << 18) if smoke else (1 << 28), device=dev)  # 1 GiB float32 on GPU
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = min(wall_ms(lambda: dst.copy_(src), 3 if smoke else 20, dev))
    return 2 * nbytes(src) / (ms * 1e-3) / 1e9


# Top-level operators that launch no device kernel (views, metadata, allocation).
NO_KERNEL_OPS = {
    f"aten::{n}"
    for n in (
        "view as_strided slice select narrow transpose t permute unsqueeze squeeze expand "
        "split split_with_sizes chunk unbind detach alias reshape _reshape_alias view_as "
        "flatten unflatten empty empty_like empty_strided movedim numpy_T lift_fresh"
    ).split()
}


def count_launches(fn: Callable[[], Any], dev: torch.device, top: int = 12) -> dict[str, Any]:
    """GPU: CUDA kernels and memcpy/memset of one call (torch.profiler), and the `top` kernels
    by device time. CPU (smoke): top-level operators, views included, as a stand-in."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(dev)
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    if not cuda:
        ops = [e for e in prof.events() if e.cpu_parent is None and "::" in e.name]
        work = [e for e in ops if e.name not in NO_KERNEL_OPS]
        # "launches": every top-level operator; "compute_ops": those that would launch work on
        # a device (views and allocations left out) -- the CPU stand-in for kernel launches.
        return {"launches": len(ops), "copies": 0, "compute_ops": len(work)}
    dev_ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum(1 for e in dev_ev if e.name.startswith(("Memcpy", "Memset")))
    # Device busy time by kernel (what the GPU does, apart from waiting for the host).
    by_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in dev_ev:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
        calls[e.name] = calls.get(e.name, 0) + 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "launches": len(dev_ev), "copies": copies, "device_us": sum(by_name.values()),
        "top_kernels_us": {k[:90]: round(v, 1) for k, v in ranked},
        "top_kernels_calls": {k[:90]: calls[k] for k, _ in ranked},
    }  # fmt: skip


def load_fla() -> tuple[Callable[..., Any] | None, str]:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule, ""
    except Exception as exc:  # noqa: BLE001 - recorded as the skip reason
        return None, f"fla did not import: {type(exc).__name__}: {exc}"[:300]


def run_variant(
    m: DecodeStep, variant: str, fla: Callable[..., Any] | None, args: argparse.Namespace,
    bw: float,
) -> dict[str, Any]:  # fmt: skip
    dev, B = m.dev, m.B
    # One step from the same GDN states under the PyTorch ops and under this variant (the KV
    # cache's only write is the new token's row, which a step writes before it reads it).
    saved = [t.clone() for t in m.states()]
    kn.set_backend("torch")
    m.fla = None
    ref = m.step().float()
    for t, c in zip(m.states(), saved, strict=True):
        t.copy_(c)
    del saved
    kn.set_backend("cuda" if variant != "torch" and kn.extension_loaded() else "torch")
    m.fla = fla if variant == "fla" else None
    res: dict[str, Any] = {"backend": kn.backend_for(m.x)}
    if kn._emulated and res["backend"] == "cuda":
        res["backend"] = "cuda (CPU emulation)"
    logits = m.step().float()
    res["logits_finite"] = bool(torch.isfinite(logits).all())
    res["logits_rel_err_vs_torch"] = float((logits - ref).norm() / ref.norm())
    for _ in range(args.warmup):
        m.step()
    reps = wall_ms(m.step, args.steps, dev)
    res["eager_ms"] = statistics.median(reps)
    res["eager_ms_reps"] = reps
    res["tokens_per_s_eager"] = B * 1e3 / res["eager_ms"]
    step = count_launches(m.step, dev)
    parts = {k: count_launches(fn, dev) for k, fn in m.parts().items()}
    res["launches"] = {
        "step": step["launches"],
        "memcpy_memset": step["copies"],
        "per_layer_avg": step["launches"] / m.s.layers,
        **{k: c["launches"] for k, c in parts.items()},
    }
    if "device_us" in step:  # GPU busy time of one eager step, and where it goes
        res["device_ms"] = step["device_us"] / 1e3
        res["top_kernels_us"] = step["top_kernels_us"]
    if "compute_ops" in step:  # CPU: the stand-in for kernel launches (views left out)
        res["compute_ops"] = {
            "step": step["compute_ops"],
            "per_layer_avg": step["compute_ops"] / m.s.layers,
            **{k: c["compute_ops"] for k, c in parts.items()},
        }
    try:
        res["graph_ms"] = Timer(dev, smoke=False).graph([m.step], 200.0)
        res["tokens_per_s_graph"] = B * 1e3 / res["graph_ms"]
        res["eager_over_graph"] = res["eager_ms"] / res["graph_ms"]
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        res["graph_ms"] = None
        res["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        sync(dev)
    b = m.bytes_per_step()
    res["bytes"] = b
    res["floor_ms"] = sum(b.values()) / (bw * 1e9) * 1e3
    res["eager_over_floor"] = res["eager_ms"] / res["floor_ms"]
    return res


def skip_reason(variant: str, dev: torch.device, fla_error: str) -> str | None:
    if variant == "torch":
        return None
    if variant == "cuda" and kn._emulated and dev.type == "cpu":
        return None  # --emulate: the fused kernels' source on host threads (op counts only)
    if dev.type != "cuda":
        return "needs a CUDA device (CPU run)"
    if variant == "cuda" and not kn.extension_loaded():
        return f"vo_native_kernels not loaded: {kn._load_error}"
    if variant == "fla" and fla_error:
        return fla_error
    return None


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def git(*a: str) -> str:
    try:
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:  # noqa: BLE001
        return ""


def meta(args: argparse.Namespace, s: Shapes, dev: torch.device) -> dict[str, Any]:
    m: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": args.commit or git("rev-parse", "HEAD") or "unknown",
        "dirty_tree": (
            bool(git("status", "--porcelain", "--untracked-files=no"))
            if git("rev-parse", "HEAD")
            else None  # no git checkout here (e.g. a copied tree): pass --commit
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": (
            torch.cuda.get_device_name(0) if dev.type == "cuda" else f"cpu {platform.machine()}"
        ),
        "dtype": args.dtype,
        "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "env": {
            k: os.environ.get(k)
            for k in ("NATIVE_KERNELS_JIT", "FLA_FLASH_QLA", "CUDA_VISIBLE_DEVICES")
        },
        "shapes": asdict(s),
        "allreduce_left_out_per_step": 2 * s.layers + 1,
        "notes": NOTES,
    }
    try:
        import fla

        m["fla"] = fla.__version__
    except Exception:  # noqa: BLE001
        m["fla"] = None
    return m


def host_profile(m: DecodeStep, n: int, case: tuple[int, int]) -> dict[str, Any]:
    """cProfile of ``n`` eager steps: Python-level time per step by function (the host side of
    an eager step, which decides its speed where launches are cheap for the GPU)."""
    import cProfile
    import io
    import pstats

    sync(m.dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        m.step()
    prof.disable()
    sync(m.dev)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({
            "function": f"{Path(file).name}:{line}({fn})", "calls_per_step": nc / n,
            "self_us_per_step": tt / n * 1e6, "cum_us_per_step": ct / n * 1e6,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["self_us_per_step"])
    total = sum(r["self_us_per_step"] for r in rows)
    head = (
        f"host profile, batch {case[0]}, context {case[1]}, {n} steps: {total / 1e3:.2f} ms/step\n"
    )
    return {"case": list(case), "steps": n, "total_ms_per_step": total / 1e3, "top": rows[:40],
            "text": head + buf.getvalue()}  # fmt: skip


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    head = [
        f"decode step, one TP4 rank ({m['shapes']['layers']} layers), {m['device']}, "
        f"torch {m['torch']}, {m['dtype']}, commit {m['commit'][:12]}",
        f"copy bandwidth {_f(results.get('copy_GBps'), '.0f')} GB/s; all-reduce left out: "
        f"{m['allreduce_left_out_per_step']} per step",
    ]
    cols = ["B", "ctx", "variant", "eager ms", "dev ms", "graph ms", "e/g", "tok/s", "launch/step",
            "/layer", "gdn L", "attn L", "moe", "head", "floor ms", "e/floor",
            "err vs torch"]  # fmt: skip
    rows = [cols]
    for c in results["cases"]:
        lead = [str(c["batch"]), str(c["context"]), c["variant"]]
        if "eager_ms" not in c:
            rows.append(lead + [f"({c.get('skipped') or c.get('error', '?')})"[:90]])
            continue
        n = c["launches"]
        rows.append(lead + [
            _f(c["eager_ms"], ".3f"), _f(c.get("device_ms"), ".3f"), _f(c["graph_ms"], ".3f"),
            _f(c.get("eager_over_graph")),
            _f(c["tokens_per_s_eager"], ".1f"), str(n["step"]), _f(n["per_layer_avg"], ".1f"),
            str(n["gdn_layer"]), str(n["attn_layer"]), str(n["moe_block"]), str(n["head"]),
            _f(c["floor_ms"], ".3f"), _f(c["eager_over_floor"], ".1f"),
            _f(c["logits_rel_err_vs_torch"], ".1e"),
        ])  # fmt: skip
    full = [r for r in rows if len(r) == len(cols)]
    widths = [max(len(r[i]) for r in full) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=False)) for r in rows]
    errs = [f"graph {c['batch']}/{c['context']}/{c['variant']}: {c['graph_error']}"
            for c in results["cases"] if c.get("graph_error")]  # fmt: skip
    notes = [f"note: {n}" for n in m["notes"]]
    notes.append("note: dev ms = GPU busy time of one eager step (torch.profiler kernel time)")
    return "\n".join(head + lines + errs + notes) + "\n"


# ---------------------------------------------------------------------------------------------
# Whole prefill step (issue 15, part 3)
# ---------------------------------------------------------------------------------------------

PREFILL_NOTES = [
    "one TP4 rank, one GPU: all-reduce left out (2 per layer + 1 LM-head all-gather per step)",
    "attention: torch SDPA (causal; lower-right causal over cached context + new tokens when "
    "resuming) stands in for vLLM's prefill attention; new k/v copied into a contiguous "
    "[1, kv, ctx, D] cache first (stands in for reshape_and_cache)",
    "GDN per layer: kernels.gdn_conv_prep (torch: gdn.causal_conv1d_prefill + "
    "gdn.post_conv_prep; cuda, fla: the fused conv + prep kernels) + chunk rule (torch: "
    "gdn.chunk_gated_delta_rule; cuda: kernels.chunk_gated_delta_rule where it exists; fla: as "
    "cuda but FLA's chunk_gated_delta_rule) + kernels.rms_norm_gated; fresh = zero initial states, "
    "resume = initial conv/SSM states from the cache",
    "MoE: moe.sparse_moe_block (the engine's prefill path); cuda and fla variants: "
    "kernels.moe_prefill where it exists (routing through kernels.moe_route when it takes top-k "
    "ids)",
    "LM head on the last token only; one step prefills T tokens of one sequence "
    "(tokens/s = T * 1000 / ms); eager only",
    "GEMM-FLOP floor: projections, router, routed experts (T * top_k rows), shared expert, "
    "attention QK^T and PV (causal pairs), LM head (1 row), at the bf16 matmul rate measured "
    "in this run (large torch.mm); the GDN chunk core's own matmuls are not in the floor",
]

# The target card (paper estimate). Each figure with where it comes from.
TARGET_CARD = {
    "name": "Iluvatar BI-V100 (TP4: one rank per card)",
    "dtype": "float16 (PLATFORM.md: bf16 is far slower there; teams run --dtype half)",
    # The copy rate, and what a TP4 prefill adds to one rank's step (all-reduces, chunk
    # re-reads): perf_metrics.CARD_TP4, the one place of those figures.
    **pm.CARD_TP4,
    "peak_fp16_TFps": 147.0,
    "peak_fp16_TFps_source": "vendor figure as reported at launch (147 TFLOPS fp16/bf16, 37 fp32, "
    "32 GB HBM2 at 1.2 TB/s): https://geektopia.es/es/technology/2021/04/05/noticias/amp/"
    "la-empresa-china-tianshu-zhixin-empieza-la-produccion-de-su-gpgpu-a-7-nm-alcanza-los-37-"
    "tflops.html (via TechPowerUp); not in PLATFORM.md, not measured here -- an assumption",
    "matmul_efficiency": 0.5,
    "matmul_efficiency_source": "assumption (fraction of the fp16 peak a large GEMM reaches; "
    "no measurement on the card is known)",
    "launch_us": 7.0,
    "launch_us_source": "/work/shared/PLATFORM.md (~7 us per small fused kernel launch, eager)",
    "caveat": "the non-GEMM rest is scaled by copy bandwidth alone: the GDN chunk core's float32 "
    "(TF32 on the H200) GEMMs -- the card has no TF32 -- and kernels tuned for the H200 may "
    "scale worse",
}
REPLAY_SIM = REPO / "worklogs" / "results" / "cache-sim-replay881.json"
# Fallback when the simulator file is missing: PLATFORM.md's replay figures.
REPLAY_PLATFORM = {"median": 13_000, "mean": 25_700, "max": 254_336}


class PrefillStep(DecodeStep):
    """One TP4 rank prefilling ``T`` new tokens of one sequence, optionally after ``cached``
    tokens already in the KV cache and GDN states (the "resume" case). Same weights and layer
    structure as :class:`DecodeStep`; the mixers and the MoE take the engine's prefill paths."""

    def __init__(self, s: Shapes, dtype: torch.dtype, dev: torch.device) -> None:
        super().__init__(s, dtype, dev)
        self.chunk_fn: Callable[..., Any] = gdn.chunk_gated_delta_rule
        self.moe_fn: Callable[..., Any] | None = None  # kernels.moe_prefill in the cuda variant
        self.sdpa_gqa = True  # SDPA's enable_gqa works here (probed in set_case)

    def set_case(self, T: int, cached: int) -> None:  # type: ignore[override]
        s, dev, dt = self.s, self.dev, self.dtype
        self.free_case()
        self.T, self.cached, self.B, self.ctx = T, cached, 1, cached + T
        L = cached + T
        self.x = torch.randn(T, s.hidden, device=dev, dtype=dt)
        self.slots = torch.tensor([1], device=dev, dtype=torch.long)  # slot 0: null block
        self.qsl = torch.tensor([0, T], device=dev, dtype=torch.long)
        self.has_init = torch.tensor([cached > 0], device=dev)
        self.positions = torch.arange(cached, L, device=dev, dtype=torch.long)
        freqs = torch.arange(L, device=dev).float()[:, None] * self.inv_freq
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(dt)  # [L, rotary]
        for i in range(s.layers):
            if s.is_attn(i):
                shape = (1, s.kv_heads, L, s.head_dim)
                self.kv[i] = (
                    torch.randn(shape, device=dev, dtype=dt),
                    torch.randn(shape, device=dev, dtype=dt),
                )
            else:
                buf = torch.randn(2, s.conv - 1, s.conv_dim, device=dev, dtype=dt)
                self.conv[i] = buf.transpose(1, 2)
                self.ssm[i] = torch.randn(
                    2, s.v_heads, s.head_v, s.head_k, device=dev, dtype=torch.float32
                ).mul_(0.05)
        self.sdpa_gqa = self._probe_gqa()

    def free_case(self) -> None:
        super().free_case()
        self.x = self.cos_sin = self.positions = None  # type: ignore[assignment]

    def _probe_gqa(self) -> bool:
        """Whether SDPA takes the 1 kv head for the 4 q heads as is (``enable_gqa``) with the
        mask this case needs; else k/v are repeated per q head."""
        s, dev, dt = self.s, self.dev, self.dtype
        q = torch.randn(1, s.q_heads, 8, s.head_dim, device=dev, dtype=dt)
        kv = torch.randn(1, s.kv_heads, 8 + (4 if self.cached else 0), s.head_dim, device=dev,
                         dtype=dt)  # fmt: skip
        try:
            self._sdpa(q, kv, kv, gqa=True)
            return True
        except Exception:  # noqa: BLE001 - fall back to repeated k/v
            return False

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """Causal attention of the ``Tq`` new tokens (the last ``Tq`` positions) over ``Lk``."""
        Tq, Lk = q.shape[2], k.shape[2]
        if not gqa and k.shape[1] != q.shape[1]:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        kw: dict[str, Any] = {"scale": q.shape[-1] ** -0.5}
        if gqa and k.shape[1] != q.shape[1]:
            kw["enable_gqa"] = True
        with self._fused_sdpa():
            if Tq == Lk:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(Tq, Lk)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    def _fused_sdpa(self) -> Any:
        """On CUDA: flash / memory-efficient / cuDNN attention only -- never the math backend,
        whose [heads, T, T+C] score matrix would not fit at 64K (an error instead)."""
        import contextlib

        if self.dev.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            backends.append(SDPBackend.CUDNN_ATTENTION)
        return sdpa_kernel(backends)

    # -- the mixers -------------------------------------------------------------------------

    def attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        s, lw, T, C = self.s, self.layers[i], h.shape[0], self.cached
        nh, nkv, D = s.q_heads, s.kv_heads, s.head_dim
        qkv = F.linear(h, lw["qkv"])
        q_gate, k, v = qkv.split([2 * nh * D, nkv * D, nkv * D], dim=-1)
        q, k, gate = kn.qk_norm_rope_gate(
            q_gate, k, lw["q_norm"], lw["k_norm"], self.cos_sin, self.positions, s.eps,
            nh, nkv, D, s.rotary,
        )  # fmt: skip
        kc, vc = self.kv[i]
        kc[0, :, C:].copy_(k.view(T, nkv, D).transpose(0, 1))
        vc[0, :, C:].copy_(v.reshape(T, nkv, D).transpose(0, 1))
        o = self._sdpa(q.view(T, nh, D).transpose(0, 1)[None], kc, vc, self.sdpa_gqa)
        o = o[0].transpose(0, 1).reshape(T, nh * D) * torch.sigmoid(gate.reshape(T, nh * D))
        return F.linear(o, lw["o_proj"])

    def gdn_prep(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections, conv (state updated) and post-conv prep: ``(q, k, v, g, beta, z)``."""
        s, lw = self.s, self.layers[i]
        HV, V = s.v_heads, s.head_v
        mixed_qkv, z, b, a = gdn_in_proj(h, lw["in_proj"], [s.conv_dim, HV * V, HV, HV])
        # The engine's call: fused conv + prep where the extension serves (cuda, fla), else
        # gdn.causal_conv1d_prefill + gdn.post_conv_prep (torch).
        q, k, v, g, beta = kn.gdn_conv_prep(
            mixed_qkv, lw["conv"], None, self.conv[i], self.qsl, self.slots, self.has_init,
            "silu", a, b, lw["A_log"], lw["dt_bias"], s.k_heads, s.head_k, V,
        )  # fmt: skip
        return q, k, v, g, beta, z

    def gdn_core(
        self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The chunk rule from this case's initial state; the final state back in its slot."""
        h0 = self.ssm[i].index_select(0, self.slots)
        h0 = torch.where(self.has_init.view(-1, 1, 1, 1), h0, torch.zeros_like(h0))
        args = (q[None], k[None], v[None], g[None], beta[None])
        if self.fla is not None:
            o, final = self.fla(
                *args, scale=self.s.head_k**-0.5, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=False, state_v_first=True, cu_seqlens=self.qsl,
            )  # fmt: skip
        else:
            o, final = self.chunk_fn(
                *args, initial_state=h0, output_final_state=True, cu_seqlens=self.qsl,
                use_qk_l2norm_in_kernel=False,
            )  # fmt: skip
        self.ssm[i].index_copy_(0, self.slots, final.to(torch.float32))
        return o[0]

    def gated_deltanet(self, i: int, h: torch.Tensor) -> torch.Tensor:
        s, lw, T = self.s, self.layers[i], h.shape[0]
        HV, V = s.v_heads, s.head_v
        q, k, v, g, beta, z = self.gdn_prep(i, h)
        core = self.gdn_core(i, q, k, v, g, beta).to(h.dtype)
        y = kn.rms_norm_gated(core, z.reshape(T, HV, V), lw["gnorm"], s.eps)
        return F.linear(y.reshape(T, HV * V), lw["out_proj"])

    def moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        lw, k = self.layers[i], self.s.top_k
        shared = (lw["sh_gu"], lw["sh_down"], lw["sh_gate"])
        if self.moe_fn is not None:
            return call_moe_prefill(self.moe_fn, h, lw, k)
        return moe_mod.sparse_moe_block(h, lw["router"], lw["w13"], lw["w2"], k, True, *shared)

    def step(self) -> torch.Tensor:
        x, res = self.x, None
        for i in range(self.s.layers):
            x, res = self.layer(i, x, res)
        assert res is not None
        return self.head(x[-1:], res[-1:])  # the LM head on the last token only

    def parts(self) -> dict[str, Callable[[], Any]]:
        """Each part once (GPU-timed separately): the mixers, their cores, one MoE block."""
        s, x = self.s, self.x
        gi = next(i for i in range(1, s.layers) if not s.is_attn(i))
        ai = next(i for i in range(s.layers) if s.is_attn(i))
        prep = self.gdn_prep(gi, x)
        T, nh, D = x.shape[0], s.q_heads, s.head_dim
        q = torch.randn(1, nh, T, D, device=self.dev, dtype=self.dtype)
        kc, vc = self.kv[ai]
        return {
            "gdn_mixer": lambda: self.gated_deltanet(gi, x),
            "gdn_chunk_core": lambda: self.gdn_core(gi, *prep[:5]),
            "attn_mixer": lambda: self.attention(ai, x),
            "attn_sdpa": lambda: self._sdpa(q, kc, vc, self.sdpa_gqa),
            "moe_block": lambda: self.moe(gi, x),
            "head": lambda: self.head(x[-1:], x[-1:]),
        }

    # -- FLOPs ------------------------------------------------------------------------------

    def matmul_flops(self) -> dict[str, float]:
        """The step's matmul FLOPs by part (2 per multiply-add)."""
        s, T, C = self.s, self.T, self.cached
        H, HVV = s.hidden, s.v_heads * s.head_v
        n_attn = sum(s.is_attn(i) for i in range(s.layers))
        n_gdn = s.layers - n_attn
        gdn_l = 2 * T * H * (s.conv_dim + HVV + 2 * s.v_heads) + 2 * T * HVV * H
        qkv = 2 * s.q_heads * s.head_dim + 2 * s.kv_heads * s.head_dim
        pairs = T * C + T * (T + 1) / 2  # causal (query, key) pairs
        attn_proj = 2 * T * H * qkv + 2 * T * s.q_heads * s.head_dim * H
        attn_core = 2 * 2 * s.q_heads * s.head_dim * pairs  # QK^T and PV
        router = 2 * T * H * s.experts
        experts = 2 * T * s.top_k * (H * 2 * s.inter + s.inter * H)
        shared = 2 * T * (H * 2 * s.shared_inter + s.shared_inter * H + H)
        return {
            "gdn_projections": n_gdn * gdn_l,
            "attn_projections": n_attn * attn_proj,
            "attn_qk_pv": n_attn * attn_core,
            "moe_router": s.layers * router,
            "moe_experts": s.layers * experts,
            "moe_shared": s.layers * shared,
            "lm_head": 2 * H * s.vocab,
            # per one layer / block, for the parts' own floors
            "per_gdn_mixer": gdn_l,
            "per_attn_mixer": attn_proj + attn_core,
            "per_attn_sdpa": attn_core,
            "per_moe_block": router + experts + shared,
        }


def call_moe_prefill(
    fn: Callable[..., Any], h: torch.Tensor, lw: dict[str, torch.Tensor], top_k: int
) -> torch.Tensor:
    """Call ``kernels.moe_prefill`` whatever its exact signature, by parameter name: routing
    through ``kernels.moe_route`` when it takes top-k weights/ids (as the decode path does),
    the logits when it takes logits; the shared expert added here unless it takes it."""
    import inspect

    params = inspect.signature(fn).parameters
    shared = (lw["sh_gu"], lw["sh_down"], lw["sh_gate"])
    avail: dict[str, Any] = {
        "x": h, "hidden_states": h, "w13": lw["w13"], "w2": lw["w2"], "top_k": top_k,
        "renormalize": True, "shared": shared, "router_weight": lw["router"],
        "shared_gate_up": shared[0], "shared_down": shared[1], "shared_gate": shared[2],
    }  # fmt: skip
    if {"router_logits", "logits", "gating_output"} & set(params):
        logits = F.linear(h, lw["router"])
        avail.update(router_logits=logits, logits=logits, gating_output=logits)
    if {"topk_weights", "topk_ids"} & set(params):
        w, ids = kn.moe_route(F.linear(h, lw["router"]), top_k, True)
        avail.update(topk_weights=w, topk_ids=ids)
    kwargs = {n: avail[n] for n in params if n in avail}
    missing = [
        n for n, p in params.items()
        if p.default is p.empty and n not in kwargs
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # fmt: skip
    if missing:
        raise TypeError(f"kernels.moe_prefill{inspect.signature(fn)}: no value for {missing}")
    out = fn(**kwargs)
    if not {"shared", "shared_gate_up"} & set(params):
        out = out + moe_mod.shared_expert(h, *shared)
    return out


def load_fla_chunk() -> tuple[Callable[..., Any] | None, str]:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule, ""
    except Exception as exc:  # noqa: BLE001 - recorded as the skip reason
        return None, f"fla did not import: {type(exc).__name__}: {exc}"[:300]


def matmul_tfps(dev: torch.device, dtype: torch.dtype, smoke: bool) -> float:
    """Large square ``torch.mm`` rate (TF/s), best of the reps: the floor's matmul rate."""
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    torch.mm(a, b)
    ms = min(wall_ms(lambda: torch.mm(a, b), 2 if smoke else 20, dev))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def part_ms(fn: Callable[[], Any], dev: torch.device, smoke: bool) -> float:
    fn()
    return statistics.median(wall_ms(fn, 1, dev, reps=2 if smoke else 3))


def run_prefill_variant(
    m: PrefillStep, variant: str, fla: Callable[..., Any] | None, args: argparse.Namespace,
    tfps: float, refs: dict[tuple[int, int], torch.Tensor],
) -> dict[str, Any]:  # fmt: skip
    dev, T = m.dev, m.T
    saved = [t.clone() for t in m.states()]

    def restore() -> None:
        for t, c in zip(m.states(), saved, strict=True):
            t.copy_(c)

    key = (m.T, m.cached)
    if key not in refs:  # one PyTorch-ops step per case, from the same states
        kn.set_backend("torch")
        m.fla, m.chunk_fn, m.moe_fn = None, gdn.chunk_gated_delta_rule, None
        refs[key] = m.step().float()
        restore()
    ref = refs[key]
    fused = variant != "torch" and (kn.extension_loaded() or kn._emulated)
    kn.set_backend("cuda" if fused else "torch")
    m.fla = fla if variant == "fla" else None
    kfn = getattr(kn, "chunk_gated_delta_rule", None)
    m.chunk_fn = kfn if variant == "cuda" and kfn is not None else gdn.chunk_gated_delta_rule
    mfn = getattr(kn, "moe_prefill", None)
    m.moe_fn = mfn if variant != "torch" and mfn is not None else None
    res: dict[str, Any] = {"backend": kn.backend_for(m.x), "attn_sdpa_gqa": m.sdpa_gqa}
    if kn._emulated and res["backend"] == "cuda":
        res["backend"] = "cuda (CPU emulation)"
    res["gdn_chunk_impl"] = (
        "fla.chunk_gated_delta_rule" if m.fla is not None
        else f"{m.chunk_fn.__module__.rsplit('.', 1)[-1]}.chunk_gated_delta_rule"
    )  # fmt: skip
    res["moe_impl"] = "kernels.moe_prefill" if m.moe_fn else "moe.sparse_moe_block"
    kn.FUSED_USED.clear()
    logits = m.step().float()
    restore()
    res["fused_ops_used"] = sorted(kn.FUSED_USED)  # the kernels.* ops that took a fused kernel
    res["logits_finite"] = bool(torch.isfinite(logits).all())
    res["logits_rel_err_vs_torch"] = float((logits - ref).norm() / ref.norm())
    for _ in range(args.warmup):
        m.step()
    reps = wall_ms(m.step, 1, dev, reps=args.prefill_reps)
    restore()
    res["ms"] = statistics.median(reps)
    res["ms_reps"] = reps
    res["tokens_per_s"] = T * 1e3 / res["ms"]
    if dev.type == "cuda":  # the step's transient buffers over what it starts with (issue 13)
        sync(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        m.step()
        sync(dev)
        res["peak_transient_mib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        restore()
    prof = count_launches(m.step, dev, top=args.top_kernels)
    res["launches"] = prof["launches"]
    if "device_us" in prof:
        res["device_ms"] = prof["device_us"] / 1e3
        res["top_kernels_us"] = prof["top_kernels_us"]
        res["top_kernels_calls"] = prof["top_kernels_calls"]
    elif "compute_ops" in prof:
        res["compute_ops"] = prof["compute_ops"]
    fl = m.matmul_flops()
    total = sum(v for k, v in fl.items() if not k.startswith("per_"))
    res["matmul_flops"] = fl
    res["gemm_tflop"] = total / 1e12
    res["floor_ms"] = total / (tfps * 1e12) * 1e3
    res["ms_over_floor"] = res["ms"] / res["floor_ms"]
    parts = {k: part_ms(fn, dev, args.smoke) for k, fn in m.parts().items()}
    restore()
    s = m.s
    n_attn = sum(s.is_attn(i) for i in range(s.layers))
    count = {"gdn_mixer": s.layers - n_attn, "attn_mixer": n_attn, "moe_block": s.layers,
             "head": 1, "gdn_chunk_core": s.layers - n_attn, "attn_sdpa": n_attn}  # fmt: skip
    res["parts_ms"] = parts
    res["parts_step_share"] = {k: parts[k] * count[k] / res["ms"] for k in parts}
    res["parts_floor_ms"] = {
        "gdn_mixer": fl["per_gdn_mixer"] / (tfps * 1e9),
        "attn_mixer": fl["per_attn_mixer"] / (tfps * 1e9),
        "attn_sdpa": fl["per_attn_sdpa"] / (tfps * 1e9),
        "moe_block": fl["per_moe_block"] / (tfps * 1e9),
    }
    # the rest of the step: 2 norms per layer, the residual adds, the final norm
    res["rest_ms"] = res["ms"] - sum(parts[k] * count[k] for k in
                                     ("gdn_mixer", "attn_mixer", "moe_block", "head"))  # fmt: skip
    return res


def target_estimate(
    row: dict[str, Any], tfps: float, bw: float, card: dict[str, Any]
) -> dict[str, float]:
    """Paper estimate of one measured step on the target card: the GEMM-floor part scaled by
    the matmul rates, the rest (memory-bound elementwise work, gathers, the GDN core) by the
    copy bandwidths, and never below the host's launch time at the card's per-launch cost."""
    rate = card["peak_fp16_TFps"] * card["matmul_efficiency"]
    floor = row["floor_ms"]
    gemm = floor * tfps / rate
    rest = max(row["ms"] - floor, 0.0) * bw / card["copy_GBps"]
    launches = row["launches"] * card["launch_us"] / 1e3
    ms = max(gemm + rest, launches)
    return {"ms": ms, "tokens_per_s": row["tokens"] * 1e3 / ms, "gemm_part_ms": gemm,
            "rest_part_ms": rest, "launch_bound_ms": launches,
            "gemm_floor_ms": row["gemm_tflop"] * 1e12 / (rate * 1e12) * 1e3}  # fmt: skip


def replay_lengths() -> dict[str, Any]:
    """Per-request prompt and cached tokens of replay881 (the cache simulator's run at the
    shipped mnbt 8192, no checkpoints), else PLATFORM.md's summary figures."""
    try:
        d = json.loads(REPLAY_SIM.read_text())
        run = next(r for r in d["runs"]
                   if r["config"]["mnbt"] == 8192 and not r["config"]["checkpoint"])  # fmt: skip
        recs = [r for r in run["records"] if r.get("status") == "ok"]
        return {
            "source": f"{REPLAY_SIM.relative_to(REPO)} (cache_sim.py, replay881 seed 0, "
            f"mnbt 8192, simulated platform prefix cache, hit {run['hit']:.3f})",
            "prompt": [r["prompt_tokens"] for r in recs],
            "cached": [r["cached_tokens"] for r in recs],
        }
    except Exception as exc:  # noqa: BLE001 - fall back to the platform's figures
        return {"source": f"PLATFORM.md replay figures ({type(exc).__name__} reading "
                f"{REPLAY_SIM.name})", "summary": REPLAY_PLATFORM}  # fmt: skip


# The variants whose kernels the card can run, the engine's own first: it has no Triton, so
# FLA's kernels never serve there, however fast they are here.
CARD_VARIANTS = ("cuda", "torch")


def ttft_estimate(rows: list[dict[str, Any]], card: dict[str, Any], dtype: str) -> dict[str, Any]:
    """TTFT (prefill time only) of the replay's prompts from the fresh-prompt rows of the first
    of :data:`CARD_VARIANTS` measured: per-token cost ``a`` and attention cost ``b`` per causal
    pair fitted to ``t(T) = a T + b T^2 / 2`` (least squares; ``b >= 0``); a request with ``C``
    cached and ``N`` new tokens takes ``a N + b (N C + N^2 / 2)``. ``caveats`` says where the
    rows are not the card's path (its dtype, its MoE GEMMs) or the fit is short of lengths.
    Resumed rows of that variant are set against the card model (``resumed_vs_model``) and,
    with the fresh ones, fitted to a second, pessimistic card model (``target_all_rows``).
    ``tp4`` adds to the card model what one rank's step leaves out (``pm.tp4_overhead_s``) at
    each of the card's assumed link rates."""
    from perf_metrics import fit_prefill_cost, percentile, prefill_seconds

    card = {**TARGET_CARD, **card}  # a run recorded before a card figure was added takes today's

    def timed(mode: str) -> list[dict[str, Any]]:  # rows of that mode with here and card ms
        return [r for r in rows if r.get("mode") == mode and "ms" in r and "target" in r]

    fresh = timed("fresh")
    by_v: dict[str, list[dict[str, Any]]] = {}
    for r in fresh:
        by_v.setdefault(r["variant"], []).append(r)
    variant = next((v for v in CARD_VARIANTS if v in by_v), None)
    if variant is None:
        return {"error": "no fresh-prompt row of a variant the card runs ("
                + ", ".join(CARD_VARIANTS) + "; fla needs Triton, which the card lacks)"}
    pts = by_v[variant]
    ours = any("moe_grouped_gemm" in r.get("fused_ops_used", ()) for r in pts)
    caveats = []
    if dtype != "float16":
        caveats.append(f"measured in {dtype}; the card runs float16")
    if variant == "cuda" and not ours:
        caveats.append("MoE GEMMs by a library here (torch._grouped_mm or one mm an expert); "
                       "the card's torch 2.1 has no _grouped_mm, so ours serve there "
                       "(MOE_PREFILL_GEMM=wmma measures them)")  # fmt: skip
    if len({r["tokens"] for r in pts}) < 2:
        caveats.append("one prompt length measured: attention's quadratic term is not fitted "
                       "(b = 0), so long prompts read too fast")  # fmt: skip
    out: dict[str, Any] = {
        "variant": variant, "dtype": dtype,
        "moe_gemms": "ours (moe_grouped_gemm)" if ours else "library",
        "caveats": caveats, "card": card, "model": {},
        "gate_ttft_p90_s": 5.0,  # PLATFORM.md, "Score": TTFT P90 <= 5 s
        "left_out": "from measured/target: the TP4 all-reduces and the chunks' weight re-reads "
        "(tp4 adds both at the card's assumed link rates); from all: queueing (replay "
        "concurrency 1), the vision tower",
    }  # fmt: skip
    lens = replay_lengths()
    out["lengths_source"] = lens["source"]
    qs = (50, 90, 99, 100)
    # Resumed prefills (cached tokens before the new ones) check the fresh fit's N C term; where
    # there are some, a second card model fitted to every row says what the TTFT would be if
    # their measured cost (attention over the cache, through the bench's SDPA stand-in) held.
    resumed = [r for r in timed("resume") if r["variant"] == variant]
    fits = [("measured", None, pts), ("target", "target", pts)]
    if resumed:
        fits.append(("target_all_rows", "target", pts + resumed))
    for where, key, fit_rows in fits:
        T = [r["tokens"] for r in fit_rows]
        t = [(r[key]["ms"] if key else r["ms"]) / 1e3 for r in fit_rows]
        a, b = fit_prefill_cost(T, [r.get("cached", 0) for r in fit_rows], t)
        out["model"][where] = {"a_s_per_token": a, "b_s_per_pair": b}

        def ttft(n: float, c: float, a: float = a, b: float = b) -> float:
            return prefill_seconds(a, b, n, c)

        if "prompt" in lens:
            P, Cc = lens["prompt"], lens["cached"]
            cold = [ttft(p, 0) for p in P]
            warm = [ttft(p - c, c) for p, c in zip(P, Cc, strict=True)]
            new = [p - c for p, c in zip(P, Cc, strict=True)]
            res = {
                "prompt_tokens": {f"p{q}": percentile(P, q) for q in qs},
                "uncached_tokens": {f"p{q}": percentile(new, q) for q in qs},
                "ttft_cold_s": {f"p{q}": percentile(cold, q) for q in qs},
                "ttft_with_cache_s": {f"p{q}": percentile(warm, q) for q in qs},
            }  # fmt: skip
        else:
            sm = lens["summary"]
            res = {"prompt_tokens": sm,
                   "ttft_cold_s": {k: ttft(v, 0) for k, v in sm.items()}}  # fmt: skip
        out[where] = res
    card_fit = out["model"]["target"]
    if "prompt" in lens:  # the card model (fresh rows) with what one rank's step leaves out
        chunk, chunk_source = pm.prefill_chunk_tokens()
        tp4: dict[str, Any] = {"chunk_tokens": chunk, "chunk_source": chunk_source,
                               "by_link_GBps": {}}  # fmt: skip
        P, Cc = np.asarray(lens["prompt"], dtype=float), np.asarray(lens["cached"], dtype=float)
        a, b = card_fit["a_s_per_token"], card_fit["b_s_per_pair"]
        cold, warm = prefill_seconds(a, b, P, 0.0), prefill_seconds(a, b, P - Cc, Cc)
        for g in card["link_GBps"]:
            full = {"ttft_cold_s": cold + pm.tp4_overhead_s(P, g, chunk, card),
                    "ttft_with_cache_s": warm + pm.tp4_overhead_s(P - Cc, g, chunk, card)}
            tp4["by_link_GBps"][f"{g:g}"] = {
                name: {f"p{q}": percentile(v, q) for q in qs} for name, v in full.items()}
        out["tp4"] = tp4
    out["resumed_vs_model"] = []
    for r in resumed:
        model_ms = prefill_seconds(card_fit["a_s_per_token"], card_fit["b_s_per_pair"],
                                   r["tokens"], r["cached"]) * 1e3  # fmt: skip
        out["resumed_vs_model"].append(
            {"tokens": r["tokens"], "cached": r["cached"], "card_ms": r["target"]["ms"],
             "model_ms": model_ms, "over_model": r["target"]["ms"] / model_ms})  # fmt: skip
    return out


def render_prefill(results: dict[str, Any]) -> str:
    m = results["meta"]
    card = results["target_card"]
    head = [
        f"prefill step, one TP4 rank ({m['shapes']['layers']} layers), {m['device']}, "
        f"torch {m['torch']}, {m['dtype']}, commit {m['commit'][:12]}",
        f"{m['dtype']} matmul {_f(results.get('matmul_TFps'), '.4g')} TF/s (torch.mm, this run); "
        f"copy {_f(results.get('copy_GBps'), '.0f')} GB/s; all-reduce left out: "
        f"{m['allreduce_left_out_per_step']} per step",
    ]
    cols = ["T", "cached", "variant", "ms", "dev ms", "tok/s", "GEMM TF", "floor ms", "x floor",
            "gdn mix", "chunk", "attn mix", "sdpa", "moe", "rest", "err vs torch",
            "BI-V100 ms", "BI tok/s", "peak MiB"]  # fmt: skip
    rows = [cols]
    for c in results["cases"]:
        lead = [str(c["tokens"]), str(c["cached"]), c["variant"]]
        if "ms" not in c:
            rows.append(lead + [f"({c.get('skipped') or c.get('error', '?')})"[:100]])
            continue
        p, t = c["parts_ms"], c.get("target", {})
        rows.append(lead + [
            _f(c["ms"], ".1f"), _f(c.get("device_ms"), ".1f"), _f(c["tokens_per_s"], ".0f"),
            _f(c["gemm_tflop"], ".2f"), _f(c["floor_ms"], ".1f"), _f(c["ms_over_floor"], ".2f"),
            _f(p["gdn_mixer"], ".2f"), _f(p["gdn_chunk_core"], ".2f"), _f(p["attn_mixer"], ".2f"),
            _f(p["attn_sdpa"], ".2f"), _f(p["moe_block"], ".2f"), _f(c["rest_ms"], ".1f"),
            _f(c["logits_rel_err_vs_torch"], ".1e"), _f(t.get("ms"), ".0f"),
            _f(t.get("tokens_per_s"), ".0f"), _f(c.get("peak_transient_mib"), ".0f"),
        ])  # fmt: skip
    full = [r for r in rows if len(r) == len(cols)]
    widths = [max(len(r[i]) for r in full) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=False)) for r in rows]
    lines.append(
        "parts: ms of ONE gdn mixer (x{g}) / its chunk core / ONE attention mixer (x{a}) / its "
        "SDPA / ONE MoE block (x{n}); rest = step - parts x counts (norms, residual adds); peak "
        "MiB = the step's transient allocations over what it starts with".format(
            g=m["shapes"]["layers"] - m["n_attn"], a=m["n_attn"], n=m["shapes"]["layers"]
        )
    )
    for c in results["cases"]:
        if "top_kernels_us" in c:
            top = list(c["top_kernels_us"].items())[:6]
            lines.append(f"top kernels {c['tokens']}/{c['cached']}/{c['variant']} (us): "
                         + "; ".join(f"{k[:48]} {v:.0f}" for k, v in top))  # fmt: skip
    lines.append(
        f"target card (paper): {card['name']}, {card['dtype']}; copy {card['copy_GBps']:.0f} GB/s "
        f"[{card['copy_GBps_source']}]; fp16 peak {card['peak_fp16_TFps']:.0f} TF/s "
        f"[{card['peak_fp16_TFps_source']}] x efficiency {card['matmul_efficiency']} "
        f"[{card['matmul_efficiency_source']}]; {card['launch_us']} us/launch "
        f"[{card['launch_us_source']}]"
    )
    lines.append(
        "BI-V100 ms = GEMM floor x (matmul rate here / card's) + (ms - floor) x (copy GB/s here "
        "/ card's), at least launches x us/launch; " + card["caveat"]
    )
    tg = results.get("target_step", {})
    for v, t16 in tg.get("by_variant", {}).items():
        lines.append(
            f"issue 15 target, fresh step of {tg['tokens']} tokens <= {tg['max_ms_over_floor']}x "
            f"its GEMM-FLOP floor: {v} {t16['ms_over_floor']:.2f}x "
            f"({'met' if t16['met'] else 'NOT met'})"
        )
    tt = results.get("ttft")
    if tt and "error" not in tt:
        lines.append(f"TTFT paper estimate (prefill only; variant {tt['variant']}, {tt['dtype']}, "
                     f"MoE GEMMs {tt['moe_gemms']}; lengths: {tt['lengths_source']}; gate: P90 "
                     f"<= {tt['gate_ttft_p90_s']} s; left out: {tt['left_out']}):")  # fmt: skip
        lines += [f"  caveat: {c}" for c in tt["caveats"]]
        for r in tt.get("resumed_vs_model", ()):
            lines.append(f"  resumed: {r['tokens']} new after {r['cached']} cached, card "
                         f"{r['card_ms']:.0f} ms = {r['over_model']:.2f}x the target model's "
                         f"{r['model_ms']:.0f} ms")  # fmt: skip
        for where in tt["model"]:
            mdl = tt["model"][where]
            lines.append(f"  {where}: t = {mdl['a_s_per_token'] * 1e6:.2f} us/token x N + "
                         f"{mdl['b_s_per_pair'] * 1e9:.4f} ns/pair x (N C + N^2/2)")  # fmt: skip
            for name, d in tt[where].items():
                vals = ", ".join(f"{k} {_f(v, '.2f' if name.endswith('_s') else '.0f')}"
                                 for k, v in d.items())  # fmt: skip
                lines.append(f"    {name}: {vals}")
        if "tp4" in tt:
            t4, card = tt["tp4"], tt["card"]
            lines.append(
                f"  tp4 = target + {2 * card['layers'] + 1} all-reduces of [N, hidden] fp16 (ring "
                f"over 4 cards at the link rate) + {card['allreduce_latency_us']:.0f} us each a "
                f"chunk [latency: {card['allreduce_latency_us_source']}] + the rank's "
                f"{card['weights_GB']} GB of weights re-read every further "
                f"{t4['chunk_tokens']}-token chunk [{t4['chunk_source']}]; link "
                f"[{card['link_GBps_source']}]:"
            )
            for g, d in t4["by_link_GBps"].items():
                p90 = d["ttft_with_cache_s"]["p90"]
                verdict = "met" if p90 <= tt["gate_ttft_p90_s"] else "NOT met"
                for name, v in d.items():
                    vals = ", ".join(f"{k} {x:.2f}" for k, x in v.items())
                    lines.append(f"    link {g} GB/s, {name}: {vals}")
                lines.append(f"    link {g} GB/s: gate P90 with cache {p90:.2f} s ({verdict})")
    elif tt:
        lines.append(f"TTFT estimate: {tt['error']}")
    notes = [f"note: {n}" for n in m["notes"]]
    return "\n".join(head + lines + notes) + "\n"


def main_prefill(args: argparse.Namespace, s: Shapes, dev: torch.device, t0: float) -> int:
    default = "128,192" if args.smoke else "16384,65536"
    lengths = [int(x) for x in (default if args.prefill == "default" else args.prefill).split(",")]
    modes = [x for x in args.prefill_modes.split(",") if x]
    assert set(modes) <= {"fresh", "resume"}, modes
    variants = [v for v in args.variants.split(",") if v]
    assert set(variants) <= set(VARIANTS), variants
    args.prefill_reps = args.prefill_reps or (2 if args.smoke else 3)
    args.warmup = min(args.warmup, 1)  # a prefill step is long: one warm-up step
    out = Path(args.out) if args.out else None
    card = dict(TARGET_CARD)
    card["peak_fp16_TFps"] = args.target_tflops
    card["matmul_efficiency"] = args.target_mm_eff
    torch.manual_seed(0)
    meta_ = meta(args, s, dev)
    meta_["notes"] = PREFILL_NOTES
    meta_["n_attn"] = sum(s.is_attn(i) for i in range(s.layers))
    meta_["kernels_chunk_gated_delta_rule"] = hasattr(kn, "chunk_gated_delta_rule")
    meta_["kernels_moe_prefill"] = hasattr(kn, "moe_prefill")
    results: dict[str, Any] = {"meta": meta_, "cases": [], "target_card": card}
    if dev.type == "cuda":
        t = time.time()
        meta_["extension_loaded"] = kn.extension_loaded()
        meta_["extension_error"] = kn._load_error
        meta_["extension_load_s"] = round(time.time() - t, 1)
    fla, fla_error = load_fla_chunk() if dev.type == "cuda" and "fla" in variants else (None, "")
    dtype = getattr(torch, args.dtype)
    results["copy_GBps"] = bw = copy_gbps(dev, args.smoke)
    results["matmul_TFps"] = tfps = matmul_tfps(dev, dtype, args.smoke)
    log(f"copy {bw:.0f} GB/s, matmul {tfps:.0f} TF/s; building weights ...")
    m = PrefillStep(s, dtype, dev)

    def save() -> None:
        results["meta"]["total_s"] = round(time.time() - t0, 1)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "prefill_step_bench.json").write_text(json.dumps(results, indent=1))
            (out / "prefill_step_bench.txt").write_text(render_prefill(results))

    cases = [(T, mode, v) for T in lengths for mode in modes for v in variants]
    target_T = lengths[0] if args.smoke else 16384  # the target length
    refs: dict[tuple[int, int], torch.Tensor] = {}
    current: tuple[int, int] | None = None
    for T, mode, v in progress(cases, "prefill_step_bench"):
        cached = 0 if mode == "fresh" else (args.prefill_cached or T)
        row: dict[str, Any] = {"tokens": T, "cached": cached, "mode": mode, "variant": v}
        reason = skip_reason(v, dev, fla_error)
        if reason is not None and v == "cuda" and args.smoke:
            reason = None  # the fused variant's dispatch (kernels.* entry points) still runs
            row["note"] = "CPU smoke: the cuda variant's kernels.* calls on the PyTorch ops"
        if reason is None and time.time() - t0 > args.budget_s:
            reason = f"budget: {args.budget_s:.0f} s spent"
        if reason is not None:
            row["skipped"] = reason
        else:
            try:
                if current != (T, cached):
                    refs.clear()
                    m.set_case(T, cached)
                    current = (T, cached)
                row.update(run_prefill_variant(m, v, fla, args, tfps, refs))
                row["target"] = target_estimate(row, tfps, bw, card)
                if dev.type == "cuda":
                    row["max_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
                    torch.cuda.reset_peak_memory_stats()
            except Exception as exc:  # noqa: BLE001 - keep going with the other cases
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                row["traceback"] = traceback.format_exc()[-2000:]
                m.free_case()
                refs.clear()
                current = None
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        results["cases"].append(row)
        brief = {k: row[k] for k in ("tokens", "cached", "variant", "ms", "tokens_per_s",
                                     "ms_over_floor", "skipped", "error") if k in row}  # fmt: skip
        log(json.dumps(brief)[:400])
        results["ttft"] = ttft_estimate(results["cases"], card, args.dtype)
        results["target_step"] = {  # issue 15: whole prefill step at 16K <= 2.5x its floor
            "tokens": target_T,
            "max_ms_over_floor": 2.5,
            "by_variant": {
                c["variant"]: {
                    "ms_over_floor": c["ms_over_floor"],
                    "met": c["ms_over_floor"] <= 2.5,
                }
                for c in results["cases"]
                if c["tokens"] == target_T and c["mode"] == "fresh" and "ms" in c
            },
        }
        save()
    m.free_case()
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save()
    print(render_prefill(results), flush=True)
    return 0


def progress(items: list[Any], desc: str = "decode_step_bench") -> Iterable[Any]:
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, dynamic_ncols=True)
    except ImportError:
        return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument(
        "--emulate",
        action="store_true",
        help="with --smoke: run the cuda variant on the CPU emulation of the fused kernels "
        "(counts operators per step and layer; its times mean nothing)",
    )
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,32; smoke 1,2)")
    ap.add_argument("--contexts", default=None, help="comma list (default 4096,32768; smoke 64)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of torch,cuda,fla")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--steps", type=int, default=None, help="eager steps per rep (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no case after this")
    ap.add_argument("--commit", default="", help="commit (default: git rev-parse HEAD)")
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="N: cProfile N eager steps of the first cuda case (where the host time goes)",
    )
    ap.add_argument(
        "--prefill",
        nargs="?",
        const="default",
        default=None,
        help="whole-prefill-step mode: comma list of new-token counts (default 16384,65536; "
        "smoke 128,192); writes prefill_step_bench.{json,txt}",
    )
    ap.add_argument(
        "--moe-decode",
        default="routed",
        choices=["routed", "separate"],
        help="MoE decode: routing inside the up kernel (engine) or its own launch",
    )
    ap.add_argument(
        "--gdn-in-proj",
        default="merged",
        choices=["merged", "split"],
        help="GDN input projections: one GEMM (the engine's) or upstream's two",
    )
    ap.add_argument(
        "--gemv",
        default="native",
        choices=["native", "cublas"],
        help="linear layers at <= 8 rows: our GEMV (the engine's, GEMV_NATIVE) or F.linear",
    )
    ap.add_argument(
        "--gdn-norm",
        default="fused",
        choices=["fused", "separate"],
        help="GDN output norm at decode: inside the decode kernel (the engine's) or its own launch",
    )
    ap.add_argument("--prefill-modes", default="fresh,resume", help="subset of fresh,resume")
    ap.add_argument(
        "--prefill-cached",
        type=int,
        default=0,
        help="resume: tokens already in the KV cache / GDN states (default: as many as new)",
    )
    ap.add_argument("--prefill-reps", type=int, default=0, help="timed steps (default 3)")
    ap.add_argument(
        "--top-kernels", type=int, default=12, help="prefill: kernels kept in the JSON, by GPU time"
    )
    ap.add_argument(
        "--target-tflops",
        type=float,
        default=TARGET_CARD["peak_fp16_TFps"],
        help="target card's fp16 matmul peak (paper TTFT estimate)",
    )
    ap.add_argument(
        "--target-mm-eff",
        type=float,
        default=TARGET_CARD["matmul_efficiency"],
        help="fraction of that peak a large GEMM reaches (assumed)",
    )
    args = ap.parse_args(argv)
    global MOE_DECODE, GDN_IN_PROJ, GDN_NORM, GEMV
    MOE_DECODE = args.moe_decode
    GDN_IN_PROJ = args.gdn_in_proj
    GDN_NORM = args.gdn_norm
    GEMV = args.gemv
    t0 = time.time()
    s = SMOKE if args.smoke else Shapes()
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        torch.set_num_threads(1)
        if args.emulate:
            kn.enable_cpu_emulation()
        args.warmup = min(args.warmup, 1)
    if args.prefill:
        return main_prefill(args, s, dev, t0)
    args.steps = args.steps or (2 if args.smoke else 20)
    batches = [int(b) for b in (args.batches or ("1,2" if args.smoke else "1,8,32")).split(",")]
    ctx_default = "64" if args.smoke else "4096,32768"
    contexts = [int(c) for c in (args.contexts or ctx_default).split(",")]
    variants = [v for v in args.variants.split(",") if v]
    assert set(variants) <= set(VARIANTS), variants
    out = Path(args.out) if args.out else None

    torch.manual_seed(0)
    results: dict[str, Any] = {"meta": meta(args, s, dev), "cases": []}
    if dev.type == "cuda":
        t = time.time()
        results["meta"]["extension_loaded"] = kn.extension_loaded()
        results["meta"]["extension_error"] = kn._load_error
        results["meta"]["extension_load_s"] = round(time.time() - t, 1)
    fla, fla_error = load_fla() if dev.type == "cuda" and "fla" in variants else (None, "")
    results["copy_GBps"] = bw = copy_gbps(dev, args.smoke)
    log(f"copy {bw:.0f} GB/s; building weights ...")
    m = DecodeStep(s, getattr(torch, args.dtype), dev)

    def save() -> None:
        results["meta"]["total_s"] = round(time.time() - t0, 1)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "decode_step_bench.json").write_text(json.dumps(results, indent=1))
            (out / "decode_step_bench.txt").write_text(render(results))

    cases = [(ctx, B, v) for ctx in contexts for B in batches for v in variants]
    current: tuple[int, int] | None = None
    for ctx, B, v in progress(cases):
        row: dict[str, Any] = {"batch": B, "context": ctx, "variant": v}
        reason = skip_reason(v, dev, fla_error)
        if reason is None and time.time() - t0 > args.budget_s:
            reason = f"budget: {args.budget_s:.0f} s spent"
        if reason is not None:
            row["skipped"] = reason
        else:
            try:
                if current != (ctx, B):
                    m.set_case(B, ctx)
                    current = (ctx, B)
                row.update(run_variant(m, v, fla, args, bw))
                if args.host_profile and v == "cuda" and "host_profile" not in results:
                    results["host_profile"] = host_profile(m, args.host_profile, (B, ctx))
                    if out is not None:
                        out.mkdir(parents=True, exist_ok=True)
                        (out / "host_profile.txt").write_text(results["host_profile"]["text"])
            except Exception as exc:  # noqa: BLE001 - keep going with the other cases
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                row["traceback"] = traceback.format_exc()[-2000:]
                m.free_case()
                current = None
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        results["cases"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "bytes")})[:400])
        save()
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save()
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
