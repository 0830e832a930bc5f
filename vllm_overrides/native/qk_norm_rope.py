"""Gated attention's input prep in plain PyTorch: split ``q|gate`` per head, Qwen's
``(1 + w)`` RMSNorm on q and k, partial NeoX RoPE (plain or interleaved MRoPE) and the gate
copy -- the contract of upstream's Triton ``fused_qk_rmsnorm_rope_gate``, which a Triton-less
card cannot run. :mod:`.kernels` serves it with one fused launch where the extension runs.

Statistics and rotation in float32; the norm output is rounded to the activation dtype before
the rotation, as the unfused path (norm -> memory -> RoPE) stores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import rmsnorm

__all__ = ["mrope_positions", "qk_norm_rope_gate"]


def mrope_positions(
    positions: torch.Tensor, half: int, mrope_section: Sequence[int] | None
) -> torch.Tensor:
    """``[T, half]`` position of each rotary frequency: ``positions`` itself for plain RoPE;
    for interleaved MRoPE ``[3, T]`` frequency ``j`` takes the H row when ``j % 3 == 1`` and
    ``j < 3 * sections[1]``, the W row when ``j % 3 == 2`` and ``j < 3 * sections[2]``, else T."""
    if positions.dim() == 1:
        return positions[:, None].expand(-1, half)
    j = torch.arange(half, device=positions.device)
    sec = mrope_section or (half, 0, 0)
    row = torch.zeros(half, dtype=torch.long, device=positions.device)
    row = torch.where((j % 3 == 1) & (j < 3 * sec[1]), 1, row)
    row = torch.where((j % 3 == 2) & (j < 3 * sec[2]), 2, row)
    return positions[row].transpose(0, 1)  # [T, half]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    half = rot // 2
    x1, x2 = x[..., :half].float(), x[..., half:rot].float()
    o = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([o, x[..., rot:]], dim=-1)


def qk_norm_rope_gate(
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
    """Returns ``(q, k, gate)``, contiguous ``[T, heads * head_dim]``.

    Args:
        q_gate: ``[T, num_q_heads * 2 * head_dim]``, per head ``[q | gate]``.
        k: ``[T, num_kv_heads * head_dim]``.
        q_weight, k_weight: ``[head_dim]`` norm weights (applied as ``1 + w``).
        cos_sin_cache: ``[max_pos, rotary_dim]`` packed ``[cos | sin]``.
        positions: ``[T]``, or ``[3, T]`` with ``mrope_section`` (interleaved MRoPE).
    """
    T, D, half = q_gate.shape[0], head_dim, rotary_dim // 2
    qg = q_gate.view(T, num_q_heads, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    q = rmsnorm.gemma_rms_norm(q, q_weight, eps)
    kk = rmsnorm.gemma_rms_norm(k.view(T, num_kv_heads, D), k_weight, eps)
    pos = mrope_positions(positions, half, mrope_section)
    cols = torch.arange(half, device=q_gate.device)
    cos = cos_sin_cache[pos, cols].float()[:, None]  # [T, 1, half]
    sin = cos_sin_cache[pos, cols + half].float()[:, None]
    q = _rope(q, cos, sin, rotary_dim)
    kk = _rope(kk, cos, sin, rotary_dim)
    return q.reshape(T, -1), kk.reshape(T, -1), gate.reshape(T, -1)
