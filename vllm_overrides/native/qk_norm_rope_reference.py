"""Naive float64 reference for :mod:`vllm_overrides.native.qk_norm_rope` (tests only)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["qk_norm_rope_gate_reference"]


def qk_norm_rope_gate_reference(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    mrope_section: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token by token, head by head, element by element in float64."""
    T, D, half = q_gate.shape[0], head_dim, rotary_dim // 2
    qg, k64 = q_gate.double().cpu(), k.double().cpu()
    cache, pos = cos_sin_cache.double().cpu(), positions.cpu()
    q_out = torch.zeros(T, num_q_heads, D, dtype=torch.float64)
    k_out = torch.zeros(T, num_kv_heads, D, dtype=torch.float64)
    gate = torch.zeros(T, num_q_heads, D, dtype=torch.float64)

    def freq_pos(t: int, j: int) -> int:
        if pos.dim() == 1:
            return int(pos[t])
        sec = mrope_section or (half, 0, 0)
        if j % 3 == 1 and j < 3 * sec[1]:
            return int(pos[1, t])
        if j % 3 == 2 and j < 3 * sec[2]:
            return int(pos[2, t])
        return int(pos[0, t])

    def head(t: int, x: list[float], w: torch.Tensor) -> list[float]:
        rms = math.sqrt(sum(v * v for v in x) / D + eps)
        y = [x[i] / rms * (1.0 + float(w[i])) for i in range(D)]
        out = list(y)
        for j in range(half):
            p = freq_pos(t, j)
            c, s = float(cache[p, j]), float(cache[p, half + j])
            out[j] = y[j] * c - y[half + j] * s
            out[half + j] = y[half + j] * c + y[j] * s
        return out

    for t in range(T):
        for h in range(num_q_heads):
            base = h * 2 * D
            q_out[t, h] = torch.tensor(head(t, qg[t, base : base + D].tolist(), q_weight.cpu()))
            gate[t, h] = qg[t, base + D : base + 2 * D]
        for h in range(num_kv_heads):
            x = k64[t, h * D : (h + 1) * D].tolist()
            k_out[t, h] = torch.tensor(head(t, x, k_weight.cpu()))
    return q_out.view(T, -1), k_out.view(T, -1), gate.view(T, -1)
