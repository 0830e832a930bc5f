"""Helpers shared by the native kernel tests."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``||out - ref|| / ||ref||`` in float64 (NaN counts as failure)."""
    ref = ref.double()
    err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))
    return float("inf") if err != err else err
