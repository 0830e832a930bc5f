"""One input GEMM per Gated-DeltaNet layer (``GDN_NATIVE``, patch 0003).

The target card runs the engine eager and has no Triton, so a decode step costs what its kernel
launches and host calls cost. Upstream's ``forward_cuda`` projects the same hidden states twice,
``in_proj_qkvz`` and ``in_proj_ba`` (two GEMM launches, each through the linear layer's Python
stack and vLLM's Parameter ``__torch_function__``), and copies ``b`` and ``a`` with
``.contiguous()`` whenever the batch holds more than one token (two more launches at any
concurrency above one). Here the two weights live in one tensor ``[n_qkvz + n_ba (+ pad), H]``,
both Parameters become views of it (no second copy: the old storages are freed, and at TP4 on
the real model these weights are ~377 MB a rank of what would otherwise be KV cache), one
``F.linear`` yields ``q|k|v|z|b|a``, and ``b``/``a`` reach the core as row-strided views: every
native path reads them by row stride (``kernels.gdn_decode`` / ``gdn_conv_prep`` check only a
unit last-dim stride; the PyTorch fallbacks are elementwise).

In an eager decode-only batch the forward goes one step further: the core output comes back
with the layer's gated output norm applied, from the same decode launch
(:func:`native_switch.gdn_decode_normed`), and only ``out_proj`` follows.

Only the Qwen3.5 layout (``gqa_interleaved_layout=False``) with unquantised, bias-free, plain
projections is merged; everything else runs upstream's ``forward_cuda`` unchanged, with one log
line per reason.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from . import torch_compat

logger = logging.getLogger("vllm.vllm_overrides.native")

_logged: set[str] = set()


def _fallback(layer: Any, reason: str) -> Any:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("GDN_NATIVE: GDN input projections stay two GEMMs (upstream): %s", reason)
    return layer.forward_cuda


def _static_reason(layer: Any) -> str | None:
    """What rules the merge out at ``__init__`` (after both projections are built)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if layer.gqa_interleaved_layout:
        return "gqa_interleaved_layout (Qwen3-Next)"
    for m in (layer.in_proj_qkvz, layer.in_proj_ba):
        if not isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod):
            return "quantized projections"
        if getattr(m, "bias", None) is not None:
            return "projection bias"
        if getattr(m, "gather_output", False):
            return "gather_output projections"
    return None


def _runtime_reason(layer: Any) -> str | None:
    """What rules the merge out at the first forward (weights loaded and post-processed)."""
    import vllm.envs as envs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm, default_unquantized_gemm

    from vllm_overrides.engines.v1_0_32 import native_switch as engine

    if getattr(layer, "enable_fused_gdn_spec_decode", False):
        return "fused GDN spec decode"
    if envs.VLLM_BATCH_INVARIANT:
        return "VLLM_BATCH_INVARIANT"
    qkvz, ba = layer.in_proj_qkvz, layer.in_proj_ba
    for m in (qkvz, ba):
        qm = getattr(m, "quant_method", None)
        if hasattr(m, "base_layer") or not isinstance(qm, UnquantizedLinearMethod):
            return "wrapped projections (LoRA)"
        impls = (default_unquantized_gemm, cpu_unquantized_gemm, engine.native_unquantized_gemm)
        if getattr(qm, "_gemm_impl", None) not in impls:
            return "non-default linear backend"
        if getattr(m, "cpu_linear", F.linear) is not F.linear:
            return "CPU GEMM dispatch packed the weights"
    wq, wb = qkvz.weight, ba.weight
    tp = layer.tp_size
    if (
        wq.dim() != 2
        or wb.dim() != 2
        or wq.shape[1] != wb.shape[1]
        or wq.shape[0] != (layer.key_dim * 2 + layer.value_dim * 2) // tp
        or wb.shape[0] % 2
    ):
        return "unexpected projection weight shapes"
    if wq.dtype != wb.dtype or wq.device != wb.device:
        return "projection weights differ in dtype or device"
    return None


def merge_weights(qkvz: torch.nn.Module, ba: torch.nn.Module) -> torch.Tensor:
    """``[W_qkvz; W_ba; 0-pad]`` in one new tensor; both ``weight`` Parameters become views of it.

    The originals are freed once nothing else holds them (vLLM's GEMM reads ``layer.weight`` at
    call time). Rows are padded with zeros to a 16-byte output row, so the fused prefill kernel's
    alignment check (``kernels.gdn_conv_prep``) holds on ``mixed_qkv``. Built outside inference
    mode, so the weights stay ordinary tensors (a later weight reload may write into them).
    """
    wq, wb = qkvz.weight, ba.weight
    nq, nb = wq.shape[0], wb.shape[0]
    per16 = 16 // wq.element_size() if 16 % wq.element_size() == 0 else 1
    pad = -(nq + nb) % per16
    with torch.inference_mode(False), torch.no_grad():
        parts = [wq.detach(), wb.detach()]
        if pad:
            parts.append(wq.detach().new_zeros(pad, wq.shape[1]))
        merged = torch.cat(parts)
        wq.data = merged[:nq]
        wb.data = merged[nq : nq + nb]
    return merged


def forward_method(layer: Any) -> Any:
    """The forward for a GDN layer whose upstream choice is ``forward_cuda`` (or CPU under
    ``GDN_NATIVE``): ours where the merge can apply, else ``forward_cuda``."""
    from vllm.platforms import current_platform

    reason = _static_reason(layer)
    if reason is not None:
        return _fallback(layer, reason)
    if current_platform.is_cpu():
        # CPU (tests, oracle): upstream packs unquantised weights for oneDNN and drops the plain
        # ones, which cannot be merged; keep them plain so the CPU runs the same merged path.
        layer.in_proj_qkvz._cpu_skip_gemm_dispatch = True
        layer.in_proj_ba._cpu_skip_gemm_dispatch = True
    return functools.partial(_first_forward, layer)


def _first_forward(layer: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Decide once (weights are loaded by the first forward, the profile run), then rebind."""
    if torch_compat.is_compiling():
        return layer.forward_cuda(hidden_states)  # nothing to mutate while Dynamo traces
    reason = _runtime_reason(layer)
    if reason is not None:
        layer._forward_method = _fallback(layer, reason)
        return layer.forward_cuda(hidden_states)
    from vllm.utils.torch_utils import _encode_layer_name

    from vllm_overrides.engines.v1_0_32 import native_switch as engine
    from vllm_overrides.native import kernels

    merged = merge_weights(layer.in_proj_qkvz, layer.in_proj_ba)
    nq = layer.in_proj_qkvz.weight.shape[0]
    nb = layer.in_proj_ba.weight.shape[0]
    qkv = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
    sizes = [qkv, nq - qkv, nb, merged.shape[0] - nq - nb]
    # A batch with speculative tokens goes to upstream's _forward_core (Triton gating), which
    # may assume contiguous b/a: keep upstream's copies when spec decode is configured.
    contiguous = getattr(layer, "speculative_config", None) is not None
    engine._mark("gdn_in_proj_merged")
    # Decode-only batches may take the output norm inside the decode kernel; with the
    # engine's GDN core only (the norm must be the one _output_projection would apply).
    norm = getattr(layer, "norm", None)
    fusable = norm is not None and engine.gdn_norm_fusable(norm)
    normed = engine.gdn_decode_normed if fusable else None
    # The merged GEMM goes where the projections' own GEMM went (patch 0011's GEMV or F.linear).
    gemm = layer.in_proj_qkvz.quant_method._gemm_impl
    linear = kernels.linear if gemm is engine.native_unquantized_gemm else F.linear
    layer._forward_method = functools.partial(
        merged_forward,
        layer,
        merged,
        sizes,
        _encode_layer_name(layer.prefix),
        torch.ops.vllm.qwen_gdn_attention_core,
        contiguous,
        normed,
        linear,
    )
    return layer._forward_method(hidden_states)


def merged_forward(
    layer: Any,
    weight: torch.Tensor,
    sizes: list[int],
    layer_name: Any,
    core: Any,
    contiguous: bool,
    normed: Any,
    linear: Any,
    hidden_states: torch.Tensor,
) -> torch.Tensor:
    """Upstream's Qwen3.5 ``forward_cuda`` with one input GEMM: same splits, same zeroed
    output buffer, same core op, same output projection. Eager decode-only batches may instead
    get the core output with the norm applied from ``normed``
    (:func:`native_switch.gdn_decode_normed`: one launch for core and norm)."""
    n = hidden_states.size(0)
    mixed_qkv, z, ba, _ = linear(hidden_states, weight).split(sizes, dim=-1)
    z = z.reshape(n, -1, layer.head_v_dim)
    b, a = layer.split_ba(ba)
    if contiguous:
        b, a = b.contiguous(), a.contiguous()
    if normed is not None and not torch_compat.is_compiling():
        out = normed(layer, mixed_qkv, b, a, z)
        if out is not None:
            return layer.out_proj(out.flatten(-2))[0]
    # Zeros, not empty: see upstream's note (vllm PR 28182).
    core_attn_out = torch.zeros(
        (n, layer.num_v_heads // layer.tp_size, layer.head_v_dim),
        dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    core(mixed_qkv, b, a, core_attn_out, layer_name=layer_name)
    return layer._output_projection(core_attn_out, z)
