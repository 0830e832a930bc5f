"""RMSNorm variants used by Qwen3.5 / Qwen3.6, in plain PyTorch operators.

Two different weight conventions live in the same model, and mixing them up is the classic bug:

* ``gemma_rms_norm`` / ``gemma_fused_add_rms_norm`` -- the ``(1 + weight)`` form. vLLM 0.32.0
  builds Qwen3.5's ``input_layernorm``, ``post_attention_layernorm``, the final ``model.norm``
  and the full-attention ``q_norm`` / ``k_norm`` from ``GemmaRMSNorm`` (imported as
  ``Qwen3_5RMSNorm`` / ``Qwen3NextRMSNorm``): the checkpoint stores ``weight`` centred on 0 and
  the scale applied is ``1 + weight``, in float32.
* ``rms_norm_gated`` -- the plain ``weight`` form (``RMSNormGated``, initialised to ones) that
  the Gated DeltaNet layer applies to its core-attention output per value head, followed by the
  output gate: ``rms_norm(x) * weight * silu(z)`` (``norm_before_gate=True``).

Numerics follow vLLM's native implementations (``vllm.ir.ops.layernorm`` and
``RMSNormGated.forward_static``): statistics and the weight multiply in float32, one rounding
to the activation dtype at the end. The fused residual variant adds in float32, returns the sum
rounded to the activation dtype as the new residual, and normalises the *unrounded* float32 sum,
exactly like ``fused_add_rms_norm``.

Every function is a fixed sequence of elementwise / reduction kernels with static shapes, so it
is safe inside CUDA graph capture and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "gemma_fused_add_rms_norm",
    "gemma_rms_norm",
    "rms_norm",
    "rms_norm_gated",
]


def _normalize_fp32(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last dim, for a float32 input."""
    var = x32.pow(2).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(var + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Plain RMSNorm ``x / rms(x) * weight`` over the last dim.

    Args:
        x: ``[..., hidden]`` activations (any float dtype).
        weight: ``[hidden]`` scale, or ``None`` for no affine.
        eps: variance epsilon.

    Returns:
        ``[..., hidden]`` in ``x.dtype``.
    """
    out = _normalize_fp32(x.float(), eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5 decoder-layer RMSNorm: ``x / rms(x) * (1 + weight)``.

    Args:
        x: ``[..., hidden]`` activations.
        weight: ``[hidden]`` checkpoint weight (centred on 0; the applied scale is ``1 + w``).
        eps: ``config.rms_norm_eps``.

    Returns:
        ``[..., hidden]`` in ``x.dtype``.
    """
    return (_normalize_fp32(x.float(), eps) * (weight.float() + 1.0)).to(x.dtype)


def gemma_fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then ``(1 + weight)`` RMSNorm, as ``GemmaRMSNorm(x, residual)``.

    Args:
        x: ``[..., hidden]`` sub-layer output.
        residual: ``[..., hidden]`` running residual stream.
        weight: ``[hidden]`` checkpoint weight (applied as ``1 + w``).
        eps: ``config.rms_norm_eps``.

    Returns:
        ``(out, new_residual)``: ``new_residual = (x + residual)`` rounded to ``x.dtype``;
        ``out`` normalises the float32 sum (not the rounded one), in ``x.dtype``.
    """
    s = x.float() + residual.float()
    out = (_normalize_fp32(s, eps) * (weight.float() + 1.0)).to(x.dtype)
    return out, s.to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    activation: str = "silu",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gated DeltaNet output norm: ``rms_norm(x) * weight * act(z)``, per head.

    This is ``RMSNormGated(head_v_dim, norm_before_gate=True, group_size=None)``: the norm runs
    over the last dim (one value head), the weight is the plain form (no ``1 +``), and the gate
    is applied after the norm.

    Args:
        x: ``[..., head_v_dim]`` core attention output (e.g. ``[T, HV, V]``).
        z: ``[..., head_v_dim]`` output gate from ``in_proj_qkvz`` (same shape as ``x``).
        weight: ``[head_v_dim]``.
        eps: ``config.rms_norm_eps``.
        activation: ``"silu"`` (Qwen3.5; ``"swish"`` is accepted as an alias) or ``"sigmoid"``.
        out_dtype: result dtype, default ``x.dtype``.

    Returns:
        Same shape as ``x``.
    """
    if activation in ("silu", "swish"):
        gate = F.silu(z.float())
    elif activation == "sigmoid":
        gate = torch.sigmoid(z.float())
    else:
        raise ValueError(f"unsupported activation {activation!r}")
    out = _normalize_fp32(x.float(), eps) * weight.float() * gate
    return out.to(out_dtype or x.dtype)
