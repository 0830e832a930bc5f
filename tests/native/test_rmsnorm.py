"""Qwen3.5 RMSNorm variants vs float64 references (CPU)."""

from __future__ import annotations

import torch
from native_util import rel_err

from vllm_overrides.native import rmsnorm
from vllm_overrides.native import rmsnorm_reference as ref

FP32_TOL = 1e-5
BF16_TOL = 1e-2


def test_gemma_rms_norm_one_plus_weight() -> None:
    x = torch.randn(9, 2048)
    w = torch.randn(2048) * 0.1
    assert (
        rel_err(rmsnorm.gemma_rms_norm(x, w, 1e-6), ref.gemma_rms_norm_reference(x, w, 1e-6))
        <= FP32_TOL
    )
    xb = x.to(torch.bfloat16)
    out = rmsnorm.gemma_rms_norm(xb, w.to(torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.gemma_rms_norm_reference(xb, w.to(torch.bfloat16), 1e-6)) <= BF16_TOL
    # zero weight == plain normalisation (the checkpoint stores the offset from 1)
    assert (
        rel_err(rmsnorm.gemma_rms_norm(x, torch.zeros(2048), 1e-6), rmsnorm.rms_norm(x, None, 1e-6))
        <= 1e-7
    )


def test_gemma_fused_add_returns_rounded_residual() -> None:
    x = torch.randn(6, 2048, dtype=torch.bfloat16)
    res = torch.randn(6, 2048, dtype=torch.bfloat16)
    w = (torch.randn(2048) * 0.1).to(torch.bfloat16)
    out, new_res = rmsnorm.gemma_fused_add_rms_norm(x, res, w, 1e-6)
    want, want_res = ref.gemma_fused_add_rms_norm_reference(x, res, w, 1e-6)
    assert new_res.dtype == torch.bfloat16
    assert torch.equal(new_res, (x.float() + res.float()).to(torch.bfloat16))
    assert rel_err(new_res, want_res) <= BF16_TOL
    assert rel_err(out, want) <= BF16_TOL
    o32, r32 = rmsnorm.gemma_fused_add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    w32, wr32 = ref.gemma_fused_add_rms_norm_reference(x.float(), res.float(), w.float(), 1e-6)
    assert rel_err(o32, w32) <= FP32_TOL and rel_err(r32, wr32) <= FP32_TOL


def test_norms_compile_fullgraph() -> None:
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    r = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.randn(256)

    def f(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rmsnorm.gemma_fused_add_rms_norm(x, r, w, 1e-6)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, r)
    want = f(x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
