"""Naive float64 references for :mod:`vllm_overrides.native.moe` (tests and error checks only).

One token and one expert at a time, straight from the definitions; same weight layouts as
:mod:`.moe` (vLLM's ``w13 [E, 2I, H]`` gate-then-up, ``w2 [E, H, I]``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "moe_experts_reference",
    "route_reference",
    "shared_expert_reference",
    "sparse_moe_block_reference",
]


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def route_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: float64 softmax, the ``top_k`` largest (ties -> lower expert index).

    Returns:
        ``(weights [T, k] float64, ids [T, k] int64)``.
    """
    T, E = router_logits.shape
    ws = torch.zeros(T, top_k, dtype=torch.float64)
    ids = torch.zeros(T, top_k, dtype=torch.long)
    for t in range(T):
        row = [float(v) for v in router_logits[t].double()]
        mx = max(row)
        ex = [math.exp(v - mx) for v in row]
        tot = sum(ex)
        probs = [e / tot for e in ex]
        pick = sorted(range(E), key=lambda e: (-probs[e], e))[:top_k]
        sel = [probs[e] for e in pick]
        if renormalize:
            s = sum(sel)
            sel = [p / s for p in sel]
        ws[t] = torch.tensor(sel, dtype=torch.float64)
        ids[t] = torch.tensor(pick)
    return ws, ids


def moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``sum_j w_tj * w2[e] (silu(gate_e x_t) * up_e x_t)`` token by token, float64."""
    T, H = x.shape
    I = w2.shape[2]  # noqa: E741
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    for t in range(T):
        xt = x[t].double()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e].double() @ xt
            act = _silu(h[:I]) * h[I:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ act)
    return out


def shared_expert_reference(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared expert per token, float64."""
    Is = down_weight.shape[1]
    out = torch.zeros(x.shape[0], down_weight.shape[0], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        xt = x[t].double()
        h = gate_up_weight.double() @ xt
        y = down_weight.double() @ (_silu(h[:Is]) * h[Is:])
        if gate_weight is not None:
            y = y / (1.0 + math.exp(-float(gate_weight.double()[0] @ xt)))
        out[t] = y
    return out


def sparse_moe_block_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    router_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed + shared output, float64. ``router_logits`` overrides ``x @ router_weight^T``."""
    logits = router_logits if router_logits is not None else x.double() @ router_weight.double().t()
    w, ids = route_reference(logits, top_k, renormalize)
    out = moe_experts_reference(x, w, ids, w13, w2)
    if shared_gate_up is not None and shared_down is not None:
        out = out + shared_expert_reference(x, shared_gate_up, shared_down, shared_gate)
    return out
