"""One input GEMM per GDN layer (``vllm_overrides.native.gdn_in_proj``, patch 0003) on a stand-in
layer that borrows upstream's ``forward_cuda`` and ``split_ba``: the merged forward hands the core
op and the output projection exactly what upstream's two-GEMM forward does, both projection
weights become views of one tensor, and the original weight storages are freed."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vllm_overrides.engines.v1_0_32 import native_switch as engine
from vllm_overrides.native import gdn_in_proj

qwen_gdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
Upstream = qwen_gdn.QwenGatedDeltaNetAttention


class _Proj(torch.nn.Module):
    """What the merge reads off ``MergedColumnParallelLinear`` (unquantised, TP 1, CPU GEMM
    dispatch skipped as ``gdn_in_proj.forward_method`` asks)."""

    def __init__(self, out: int, hidden: int, bias: bool = False) -> None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        super().__init__()
        # Small integers: every summation order gives the same float32 result, so "exactly
        # equal" tests the split, not the BLAS blocking of two GEMM shapes.
        self.weight = torch.nn.Parameter(
            torch.randint(-3, 4, (out, hidden)).float(), requires_grad=False
        )
        self.bias = torch.nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.gather_output = False
        self.quant_method = UnquantizedLinearMethod()
        self.cpu_linear = F.linear

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.quant_method.apply(self, x, self.bias), None


class _OtherMethod:
    """Stands in for a quantised linear method (anything but ``UnquantizedLinearMethod``)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Any = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class _Layer:
    """The attributes upstream's ``forward_cuda`` / ``split_ba`` and the merge read."""

    forward_cuda = Upstream.forward_cuda
    split_ba = Upstream.split_ba

    def __init__(self, H: int = 32, nk: int = 2, nv: int = 4, K: int = 8, V: int = 8) -> None:
        self.hidden_size, self.num_k_heads, self.num_v_heads = H, nk, nv
        self.head_k_dim, self.head_v_dim = K, V
        self.key_dim, self.value_dim = nk * K, nv * V
        self.tp_size, self.tp_rank = 1, 0
        self.gqa_interleaved_layout = False
        self.enable_fused_gdn_spec_decode = False
        self.speculative_config = None
        self.disable_tp_for_ba_proj = False
        self.prefix = "model.layers.0.linear_attn"
        self.in_proj_qkvz = _Proj(2 * self.key_dim + 2 * self.value_dim, H)
        self.in_proj_ba = _Proj(2 * nv, H)
        self._forward_method = self.forward_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_method(x)

    def _output_projection(self, core_attn_out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (core_attn_out * z).flatten(-2)  # depends on both, elementwise: exact


@pytest.fixture
def core_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    """Replace the core op: record its inputs, write a function of all of them."""
    calls: list[tuple[torch.Tensor, ...]] = []

    def fake_core(
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        layer_name: Any,
    ) -> None:
        calls.append((mixed_qkv.clone(), b.clone(), a.clone()))
        n, hv, v = out.shape
        out.copy_(mixed_qkv[:, : hv * v].reshape(n, hv, v) * b[..., None] - a[..., None])

    monkeypatch.setattr(torch.ops.vllm, "qwen_gdn_attention_core", fake_core)
    monkeypatch.setattr(engine, "GDN_NATIVE", True)
    return calls


@pytest.mark.parametrize("T", [1, 5])  # one decode token; a batch (upstream copies b and a)
def test_merged_forward_equals_two_gemms(T: int, core_calls: list) -> None:
    layer = _Layer()
    x = torch.randint(-3, 4, (T, layer.hidden_size)).float()
    want = layer.forward_cuda(x)
    layer._forward_method = engine.gdn_forward_method(layer)
    assert layer._forward_method != layer.forward_cuda
    first = layer.forward(x)  # merges, then runs the merged forward
    again = layer.forward(x)  # the rebound merged forward
    assert layer._forward_method.func is gdn_in_proj.merged_forward
    assert torch.equal(first, want) and torch.equal(again, want)
    up, ours = core_calls[0], core_calls[-1]
    for u, o in zip(up, ours, strict=True):
        assert u.shape == o.shape and torch.equal(u, o)
    # The projections themselves, exactly, against two separate linears on the old weights.
    wq, wb = layer.in_proj_qkvz.weight, layer.in_proj_ba.weight
    merged = layer._forward_method.args[1]
    proj = F.linear(x, merged)
    assert torch.equal(proj[:, : wq.shape[0]], F.linear(x, wq))
    assert torch.equal(proj[:, wq.shape[0] : wq.shape[0] + wb.shape[0]], F.linear(x, wb))


def test_weights_become_views_of_one_tensor_and_originals_are_freed(core_calls: list) -> None:
    layer = _Layer(H=24, nv=3)  # 2*3 ba rows: the merged row needs zero padding to 16 bytes
    wq, wb = layer.in_proj_qkvz.weight, layer.in_proj_ba.weight
    before_q, before_b = wq.detach().clone(), wb.detach().clone()
    old = [weakref.ref(w.untyped_storage()) for w in (wq, wb)]
    layer._forward_method = engine.gdn_forward_method(layer)
    with torch.inference_mode():  # vLLM runs the model (and so the merge) in inference mode
        layer.forward(torch.randn(3, 24))
    gc.collect()
    assert all(r() is None for r in old), "an original weight storage is still alive"
    merged = layer._forward_method.args[1]
    nq, nb, H, es = wq.shape[0], wb.shape[0], 24, merged.element_size()
    assert (merged.shape[0] * es) % 16 == 0 and merged.shape[0] >= nq + nb
    assert torch.count_nonzero(merged[nq + nb :]) == 0
    for w, off in ((wq, 0), (wb, nq * H * es)):
        assert w.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
        assert w.data_ptr() == merged.data_ptr() + off
        end = w.data_ptr() + w.numel() * es
        assert end <= merged.data_ptr() + merged.numel() * es
        assert not w.is_inference()  # a later weight reload may still write into it
    assert wq.untyped_storage().nbytes() == merged.numel() * es  # one storage, nothing else
    assert torch.equal(wq, before_q) and torch.equal(wb, before_b)
    assert isinstance(wq, torch.nn.Parameter) and isinstance(wb, torch.nn.Parameter)


@pytest.mark.parametrize("case", ["interleaved", "quantized", "bias", "fused_spec"])
def test_unsupported_layers_run_upstream_with_one_log_line(
    case: str, core_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[str] = []
    monkeypatch.setattr(gdn_in_proj, "_logged", set())
    monkeypatch.setattr(gdn_in_proj.logger, "info", lambda msg, *a: logged.append(msg % a))
    layers = [_Layer(), _Layer()]
    for layer in layers:
        if case == "interleaved":
            layer.gqa_interleaved_layout = True
        elif case == "quantized":
            layer.in_proj_ba.quant_method = _OtherMethod()
        elif case == "bias":
            layer.in_proj_qkvz = _Proj(layer.in_proj_qkvz.weight.shape[0], 32, bias=True)
        else:
            layer.enable_fused_gdn_spec_decode = True
    ptrs = [(ly.in_proj_qkvz.weight.data_ptr(), ly.in_proj_ba.weight.data_ptr()) for ly in layers]
    x = torch.randn(2, 32)  # float32: upstream's fused spec-decode branch is bf16 only
    for layer in layers:
        layer._forward_method = engine.gdn_forward_method(layer)
        if case != "interleaved":  # (the stand-in lacks Qwen3-Next's unpacking)
            want = layer.forward_cuda(x)
            assert torch.equal(layer.forward(x), want)
        assert layer._forward_method == layer.forward_cuda
    assert ptrs == [
        (ly.in_proj_qkvz.weight.data_ptr(), ly.in_proj_ba.weight.data_ptr()) for ly in layers
    ]
    assert len(logged) == 1, logged


def test_switch_off_keeps_upstream_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "GDN_NATIVE", False)
    layer = _Layer()
    method = layer._forward_method
    assert engine.gdn_forward_method(layer) is method
