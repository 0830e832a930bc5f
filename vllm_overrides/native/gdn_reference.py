"""Naive float64 references for :mod:`vllm_overrides.native.gdn` (tests and error checks only).

Plain loops over sequences and tokens (heads/channels vectorised), straight from the
definitions, with no chunking and no algebraic rewriting, so they share no structure with the
fast paths they check. Layouts are the ones documented in :mod:`.gdn` (vLLM's).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "conv1d_reference",
    "gated_delta_rule_reference",
    "gated_delta_rule_reference_fast",
    "gdn_gating_reference",
    "rms_norm_gated_reference",
]


def _cu_list(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    return [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]


def gdn_gating_reference(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, element by element."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    HV = A_log.numel()
    g = torch.empty_like(a64)
    beta = torch.empty_like(b64)
    for i in range(a64.numel()):
        h = i % HV
        x = float(a64[i]) + float(dt_bias[h])
        sp = x if x > 20.0 else math.log1p(math.exp(x))
        g[i] = -math.exp(float(A_log[h])) * sp
        beta[i] = 1.0 / (1.0 + math.exp(-float(b64[i])))
    return g.view(a.shape), beta.view(b.shape)


def conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | list[int],
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv per sequence, token by token.

    Args:
        x: ``[T, D]``; weight: ``[D, W]``; bias: ``[D]``.
        initial_states: ``[N, D, W-1]`` history before each sequence (zeros if ``None``).

    Returns:
        ``(out [T, D], final_states [N, D, W-1])`` float64.
    """
    cu = _cu_list(cu_seqlens)
    T, D = x.shape
    W = weight.shape[1]
    w = weight.double()
    out = torch.zeros(T, D, dtype=torch.float64)
    finals = []
    for s in range(len(cu) - 1):
        hist = (
            initial_states[s].double().clone()
            if initial_states is not None
            else torch.zeros(D, W - 1, dtype=torch.float64)
        )
        buf = [hist[:, i].clone() for i in range(W - 1)]  # oldest first
        for t in range(cu[s], cu[s + 1]):
            buf.append(x[t].double())
            acc = torch.zeros(D, dtype=torch.float64) if bias is None else bias.double().clone()
            for j in range(W):
                acc += w[:, j] * buf[len(buf) - W + j]
            if activation in ("silu", "swish"):
                acc = acc / (1.0 + torch.exp(-acc))
            out[t] = acc
        finals.append(torch.stack(buf[len(buf) - (W - 1) :], dim=1))
    return out, torch.stack(finals) if finals else torch.zeros(0, D, W - 1, dtype=torch.float64)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one token at a time, in float64.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]``.
        initial_state: ``[N, HV, V, K]`` or ``None`` (zeros).

    Returns:
        ``(o [T, HV, V], final_state [N, HV, V, K])`` float64.
    """
    cu = _cu_list(cu_seqlens)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    R = HV // H
    scale = K**-0.5 if scale is None else scale
    o = torch.zeros(T, HV, V, dtype=torch.float64)
    finals = []
    for s in range(len(cu) - 1):
        h = (
            initial_state[s].double().clone()
            if initial_state is not None
            else torch.zeros(HV, V, K, dtype=torch.float64)
        )
        for t in range(cu[s], cu[s + 1]):
            for hv in range(HV):
                qt = q[t, hv // R].double()
                kt = k[t, hv // R].double()
                if use_qk_l2norm:
                    qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                    kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
                hh = h[hv] * math.exp(float(g[t, hv]))
                delta = float(beta[t, hv]) * (v[t, hv].double() - hh @ kt)
                hh = hh + torch.outer(delta, kt)
                h[hv] = hh
                o[t, hv] = hh @ (qt * scale)
        finals.append(h)
    return o, torch.stack(finals)


def rms_norm_gated_reference(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight * silu(z)`` per row, float64."""
    x64 = x.double().reshape(-1, x.shape[-1])
    z64 = z.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(x64)
    for r in range(x64.shape[0]):
        rms = math.sqrt(float((x64[r] ** 2).mean()) + eps)
        out[r] = x64[r] / rms * weight.double() * (z64[r] / (1.0 + torch.exp(-z64[r])))
    return out.view(x.shape)


def gated_delta_rule_reference_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same recurrence, one token at a time but all heads at once, float64 on ``q.device``.

    Still the plain token loop (no chunking); for long sequences on a GPU (benchmark error
    checks). Checked against :func:`gated_delta_rule_reference` in the tests.
    """
    cu = _cu_list(cu_seqlens)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    R = HV // H
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    q64 = q.double().repeat_interleave(R, dim=1)
    k64 = k.double().repeat_interleave(R, dim=1)
    if use_qk_l2norm:
        q64 = q64 / torch.sqrt((q64 * q64).sum(-1, keepdim=True) + 1e-6)
        k64 = k64 / torch.sqrt((k64 * k64).sum(-1, keepdim=True) + 1e-6)
    q64 = q64 * scale
    v64, e64, b64 = v.double(), torch.exp(g.double()), beta.double()
    o = torch.zeros(T, HV, V, dtype=torch.float64, device=dev)
    finals = []
    for s in range(len(cu) - 1):
        h = (
            initial_state[s].double().clone()
            if initial_state is not None
            else torch.zeros(HV, V, K, dtype=torch.float64, device=dev)
        )
        for t in range(cu[s], cu[s + 1]):
            h.mul_(e64[t].view(HV, 1, 1))
            delta = b64[t].view(HV, 1) * (v64[t] - torch.einsum("hvk,hk->hv", h, k64[t]))
            h.add_(delta.unsqueeze(-1) * k64[t].unsqueeze(1))
            o[t] = torch.einsum("hvk,hk->hv", h, q64[t])
        finals.append(h)
    return o, torch.stack(finals)
