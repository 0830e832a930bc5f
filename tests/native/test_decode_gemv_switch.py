"""``GEMV_NATIVE`` (patch 0011): which GEMM an unquantised linear layer gets, and that the native
one computes ``F.linear`` -- on the PyTorch path exactly, on the GEMV (CPU emulation of the kernel
source) within bf16 accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_overrides.engines.v1_0_32 import native_switch as engine
from vllm_overrides.native import kernels

utils = pytest.importorskip("vllm.model_executor.layers.utils")


def test_switch_off_keeps_every_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "GEMV_NATIVE", False)
    for impl in (utils.default_unquantized_gemm, utils.cpu_unquantized_gemm):
        assert engine.unquantized_gemm(impl) is impl


def test_switch_on_replaces_only_the_generic_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "GEMV_NATIVE", True)
    assert engine.unquantized_gemm(utils.default_unquantized_gemm) is (
        engine.native_unquantized_gemm
    )
    # CPU (and ROCm / FlashInfer) GEMMs are not ours to replace.
    assert engine.unquantized_gemm(utils.cpu_unquantized_gemm) is utils.cpu_unquantized_gemm


def test_patched_linear_method_asks_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch 0011 is applied: a new UnquantizedLinearMethod's GEMM comes from the engine."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    seen = []
    monkeypatch.setattr(engine, "unquantized_gemm", lambda impl: seen.append(impl) or "ours")
    assert UnquantizedLinearMethod()._gemm_impl == "ours" and len(seen) == 1


@pytest.mark.parametrize("rows", [1, 5, kernels.GEMV_MAX_ROWS + 1])
def test_native_gemm_equals_linear_on_the_torch_path(rows: int) -> None:
    kernels.set_backend("torch")
    try:
        x, w, b = torch.randn(rows, 48), torch.randn(24, 48), torch.randn(24)
        assert torch.equal(engine.native_unquantized_gemm(None, x, w), F.linear(x, w))
        assert torch.equal(engine.native_unquantized_gemm(None, x, w, b), F.linear(x, w, b))
    finally:
        kernels.set_backend("auto")


def test_native_gemm_runs_the_gemv_kernel_source() -> None:
    """Under emulation the decode rows reach the GEMV (the op reports it) and match F.linear."""
    if torch.cuda.is_available():
        pytest.skip(
            "emulation case: on a GPU the CUDA build is loaded (test_cuda_kernels covers it)"
        )
    kernels.enable_cpu_emulation(warp_size=64)
    kernels.set_backend("cuda")
    try:
        x = torch.randn(kernels.GEMV_MAX_ROWS, 256).bfloat16()
        w = (torch.randn(40, 256) * 0.06).bfloat16()
        assert torch.ops.vo_kernels.dense_linear_takes(x, w)
        got = engine.native_unquantized_gemm(None, x, w)
        want = x.double() @ w.double().T
        assert "dense_linear" in kernels.FUSED_USED
        assert got.dtype == torch.bfloat16 and got.shape == (kernels.GEMV_MAX_ROWS, 40)
        assert (got.double() - want).norm() / want.norm() < 1e-2
    finally:
        kernels.disable_cpu_emulation()
        kernels.set_backend("auto")
