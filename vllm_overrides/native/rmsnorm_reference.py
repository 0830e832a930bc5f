"""Naive float64 references for :mod:`vllm_overrides.native.rmsnorm` (tests only)."""

from __future__ import annotations

import math

import torch

__all__ = ["gemma_fused_add_rms_norm_reference", "gemma_rms_norm_reference"]


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, float64."""
    x64 = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(x64)
    for r in range(x64.shape[0]):
        out[r] = x64[r] / math.sqrt(float((x64[r] ** 2).mean()) + eps) * (1.0 + weight.double())
    return out.view(x.shape)


def gemma_fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(gemma_rms_norm(s), s)`` in float64."""
    s = x.double() + residual.double()
    return gemma_rms_norm_reference(s, weight, eps), s
