"""Qwen3.5 / Qwen3.6 sparse MoE block in plain PyTorch operators (no Triton, no custom ops).

Weight layouts are vLLM's unquantised fused-MoE layouts, so the engine's loaded parameters are
used as they are (no copies, no re-layout):

* ``w13``: ``[E, 2*I, H]`` -- rows ``[0, I)`` are ``gate_proj`` (shard "w1"), rows ``[I, 2I)``
  are ``up_proj`` (shard "w3"); ``I`` is the per-rank ``moe_intermediate_size``.
* ``w2``: ``[E, H, I]`` (``down_proj``).
* Router: ``gate.weight [E, H]``; probabilities are a float32 softmax, the top-k are taken with
  ties going to the lower expert index (as vLLM's ``topk_softmax`` kernel does), and they are
  renormalised to sum to 1 when ``norm_topk_prob`` (vLLM's ``renormalize``) is set.
* Shared expert (``Qwen2MoeMLP``): ``gate_up_proj.weight [2*Is, H]`` (gate rows first),
  ``down_proj.weight [H, Is]`` and ``shared_expert_gate.weight [1, H]``; its output is
  multiplied by ``sigmoid(x @ gate^T)`` and added to the routed output.

Expert paths:

* prefill (:func:`moe_experts_prefill`): sort the ``T*k`` (token, expert) pairs by expert so
  every expert owns a contiguous slice, run both projections as grouped GEMMs
  (``torch._grouped_mm``, offsets on device) where the device has it, else a per-expert loop
  over the slices, then gather the ``k`` result rows of each token back into token order and
  sum them (float32 accumulation; the routing weight was folded into the down-projection
  input) -- as one CSR x dense ``torch.sparse.mm`` where a probe shows it works (0.36 ms vs
  0.48 ms for gather + sum at T=16K, TP4, on the H200), else gather + sum. An
  ``embedding_bag`` reduction (0.72 ms) and a ``[1, k] @ [k, H]`` bmm (0.49 ms after the
  gather) both lost.
* decode (:func:`moe_experts_decode`): ``"gather"`` copies the top-k experts' weight matrices
  of every token (``index_select`` along the expert dim: contiguous blocks) and runs batched
  GEMVs (one per token for the gate/up projection, one per (token, expert) for the down
  projection, then a sum over the k experts; the routing weight is folded into the
  activation). ``"grouped"`` is the decode-sized grouped GEMM (no weight copies; each used
  expert's weights read once); ``"dense"`` runs every expert on every token (reads each weight
  once, no gathers; worth it only when ``T*k`` approaches ``E``). All decode methods are
  capture safe (static shapes, no host sync).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("vllm.vllm_overrides.native")

__all__ = [
    "grouped_mm_available",
    "moe_experts_decode",
    "moe_experts_prefill",
    "route",
    "shared_expert",
    "silu_and_mul",
    "sparse_moe_block",
]

_GROUPED_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}
_LOGGED_NO_GROUPED: list[bool] = []  # one warning per process
_CSR_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` for ``dtype`` (probed once, cached).

    Call it once outside CUDA-graph capture (e.g. at model init): the first call runs a tiny
    probe kernel.
    """
    dev = torch.device(device)
    key = (dev.type, dev.index, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(4, 16, device=dev, dtype=dtype)
                b = torch.ones(2, 16, 16, device=dev, dtype=dtype)
                offs = torch.tensor([2, 4], device=dev, dtype=torch.int32)
                out = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                ok = bool(torch.allclose(out.float(), torch.full((4, 16), 16.0, device=dev)))
            except Exception:  # noqa: BLE001 - any failure means "not supported here"
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (vLLM ``fused_topk`` with ``scoring_func="softmax"``).

    Args:
        router_logits: ``[T, E]`` (any float dtype; probabilities in float32).
        top_k: ``config.num_experts_per_tok``.
        renormalize: ``config.norm_topk_prob``.

    Returns:
        ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``, experts in descending
        probability; equal probabilities are ordered by ascending expert index (a stable sort),
        so ties are deterministic on every device.

    With renormalisation the weights are ``softmax`` over the k selected logits, which equals
    ``p_j / sum_sel p`` exactly in real arithmetic, and softmax is monotonic, so the logits
    are sorted directly: two kernels (sort, softmax over k) instead of a full softmax too.
    """
    # The stable sort won on the H200 (T=16K, E=256): sort 0.26 ms vs argmax 0.30 / topk 0.31.
    if renormalize:
        vals, ids = torch.sort(router_logits, dim=-1, descending=True, stable=True)
        return torch.softmax(vals[:, :top_k], dim=-1, dtype=torch.float32), ids[:, :top_k]
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return vals[:, :top_k], ids[:, :top_k]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (vLLM ``SiluAndMul``)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def shared_expert(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen shared expert: ``sigmoid(x g^T) * down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[T, H]``.
        gate_up_weight: ``[2*Is, H]`` (``shared_expert.gate_up_proj.weight``, gate rows first).
        down_weight: ``[H, Is]``.
        gate_weight: ``[1, H]`` (``shared_expert_gate.weight``) or ``None``.

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    out = F.linear(silu_and_mul(F.linear(x, gate_up_weight)), down_weight)
    if gate_weight is not None:
        out = torch.sigmoid(F.linear(x, gate_weight)) * out
    return out


def _sorted_pairs(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs ``p = t*k + j`` ordered by expert; returns ``(order, inverse, group_ends int32)``.

    The stable sort runs on the narrowest integer type that holds the expert ids (uint8 for
    256 experts: a radix sort then needs one pass instead of eight for int64). Group ends
    come from ``searchsorted`` on the sorted ids (no atomics, deterministic)."""
    flat = topk_ids.reshape(-1)
    key_dtype = (
        torch.uint8
        if num_experts <= 256
        else (torch.int16 if num_experts <= 32768 else torch.int32)
    )
    sorted_ids, order = torch.sort(flat.to(key_dtype), stable=True)
    inverse = torch.empty_like(order)
    inverse.index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=torch.int32)
    ends = torch.searchsorted(sorted_ids.to(torch.int32), bounds).to(torch.int32)
    return order, inverse, ends


def gather_blocks(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``w.index_select(0, ids)``, copied as 8-byte words where the layout allows.

    With few indices PyTorch runs its "small index" kernel, which moves one element per step:
    8 bf16 expert blocks of w13 (TP4) copied in 18.7 us on the H200 (0.9 TB/s); viewed as
    int64 words, 9.1 us (``worklogs/gather_probe.py``; no change from 64 indices up)."""
    rows = w.reshape(w.shape[0], -1)
    # Expert weights are parameters that own their storage, so the rows start 8-byte aligned
    # (a storage-offset check would not trace under torch.compile).
    if w.is_contiguous() and w.element_size() < 8 and (rows.shape[1] * w.element_size()) % 8 == 0:
        words = rows.view(torch.int64).index_select(0, ids)
        return words.view(w.dtype).view(ids.numel(), *w.shape[1:])
    return w.index_select(0, ids)


def _weighted_act(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * w`` in ``h``'s dtype, three in-place-style passes (the float32
    routing weight multiplies in float32 and rounds once into the result)."""
    d = h.shape[-1] // 2
    act = F.silu(h[..., :d])
    return act.mul_(h[..., d:]).mul_(w)


def _csr_mm(inverse: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """``S @ y`` with ``S [T, T*k]`` a CSR matrix of ones at ``(t, inverse[t, j])``."""
    n = inverse.numel()
    sel = torch.sparse_csr_tensor(
        torch.arange(0, n + 1, k, device=y.device),
        inverse,
        torch.ones(n, device=y.device, dtype=y.dtype),
        size=(n // k, y.shape[0]),
        check_invariants=False,
    )
    return torch.sparse.mm(sel, y)


def csr_combine_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a CSR x dense product runs (and is right) on ``device`` for ``dtype``; probed
    once, cached. Not used on CPU (the CPU engine runs its own kernels there anyway)."""
    dev = torch.device(device)
    key = (dev.type, dev.index, dtype)
    if key not in _CSR_OK:
        ok = dev.type != "cpu"
        if ok:
            try:
                y = torch.arange(12, device=dev, dtype=dtype).view(6, 2)
                inv = torch.tensor([5, 0, 1, 2, 3, 4], device=dev)
                got = _csr_mm(inv, y, 2).float()
                want = y.float()[inv].view(3, 2, 2).sum(1)
                ok = bool(torch.equal(got, want))
            except Exception:  # noqa: BLE001 - any failure means "not supported here"
                ok = False
        _CSR_OK[key] = ok
    return _CSR_OK[key]


def _combine(
    y: torch.Tensor, inverse: torch.Tensor, k: int, method: str = "gather"
) -> torch.Tensor:
    """``out[t] = sum_j y[pos(t, j)]`` (rows already weighted).

    ``"gather"``: one gather back to token order and a sum over the k rows (float32
    accumulation inside the reduction). ``"csr"``: the same sum as one sparse x dense product
    (CSR rows of k ones), which reads y once instead of writing and re-reading the gathered
    copy (0.36 vs 0.48 ms on the H200 at T=16K, TP4)."""
    if method == "csr":
        return _csr_mm(inverse, y, k)
    return y.index_select(0, inverse).view(-1, k, y.shape[-1]).sum(1)


def _grouped_experts(
    xs: torch.Tensor,
    ws: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    method: str,
) -> torch.Tensor:
    """Both projections over expert-sorted rows ``xs [P, H]``; the routing weights ``ws [P]``
    are folded into the down-projection input, so the combine is a plain sum."""
    I = w2.shape[2]  # noqa: E741 - the usual name for the intermediate size
    if method == "grouped" and not hasattr(torch, "_grouped_mm"):
        # Asked for by name (MOE_PREFILL_GEMM=grouped, a decode method) on a torch without it
        # (the card's 2.1): the per-expert loop computes the same, and the log says so.
        if not _LOGGED_NO_GROUPED:
            _LOGGED_NO_GROUPED.append(True)
            logger.warning(
                "torch %s has no _grouped_mm: MoE 'grouped' GEMMs run as the per-expert loop",
                torch.__version__,
            )
        method = "loop"
    if method == "grouped":
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
        return torch._grouped_mm(_weighted_act(h, ws.unsqueeze(-1)), w2.transpose(1, 2), offs=ends)
    # Per-expert loop over contiguous slices (devices without grouped GEMM); one host sync.
    bounds = [0, *ends.tolist()]
    y = xs.new_empty(xs.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if s == t:
            continue
        h = F.linear(xs[s:t], w13[e])
        act = (F.silu(h[:, :I]) * h[:, I:] * ws[s:t].unsqueeze(-1)).to(xs.dtype)
        y[s:t] = F.linear(act, w2[e])
    return y


def moe_experts_prefill(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    method: str = "auto",
) -> torch.Tensor:
    """Routed experts for a large token batch (sort-by-expert + grouped GEMM).

    Args:
        x: ``[T, H]``.
        topk_weights: ``[T, k]`` float32; topk_ids: ``[T, k]`` integer expert ids.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]``.
        method: ``"grouped"`` (``torch._grouped_mm``), ``"loop"`` (per-expert slices) or
            ``"auto"`` (grouped where it runs).

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t)``.
    """
    T, k = topk_ids.shape
    E = w13.shape[0]
    if method == "auto":
        method = "grouped" if grouped_mm_available(x.device, x.dtype) else "loop"
    order, inverse, ends = _sorted_pairs(topk_ids, E)
    xs = x.index_select(0, order // k)
    ws = topk_weights.reshape(-1).index_select(0, order).float()
    y = _grouped_experts(xs, ws, w13, w2, ends, method)
    return _combine(y, inverse, k, "csr" if csr_combine_available(x.device, y.dtype) else "gather")


def moe_experts_decode(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    method: str = "gather",
) -> torch.Tensor:
    """Routed experts for a few tokens (decode); capture safe for every method.

    Args:
        x: ``[T, H]`` (T small, e.g. <= 32).
        topk_weights: ``[T, k]`` float32; topk_ids: ``[T, k]``.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]``.
        method: ``"gather"`` (copy the top-k experts' weights, batched GEMV; the portable
            default), ``"grouped"`` (``torch._grouped_mm``; no weight copies), ``"dense"``
            (all experts, no gathers) or ``"auto"`` (dense when ``3*T*k >= E``, else gather:
            on the H200 the decode-sized grouped GEMM lost to one of the two at every T,
            as its few busy CTAs each stream a whole expert).

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    T, k = topk_ids.shape
    E, twoI, H = w13.shape
    I = twoI // 2  # noqa: E741
    if method == "auto":
        method = "dense" if 3 * T * k >= E else "gather"
    flat = topk_ids.reshape(-1)
    if method == "gather":
        # Whole expert matrices are gathered along dim 0 (contiguous 0.5-1 MB blocks, as
        # 8-byte words). [T, k*2I, H]: token t's k experts stacked along the output rows -> one
        # GEMV.
        w13g = gather_blocks(w13, flat).view(T, k * twoI, H)
        h = torch.bmm(w13g, x.view(T, H, 1)).view(T, k, twoI)
        act = _weighted_act(h, topk_weights.unsqueeze(-1))  # [T, k, I]
        # One GEMV per (token, expert) on the gathered [H, I] blocks, then the sum over k (the
        # routing weight is already in act). Gathering w2 along its middle dim instead, to put
        # the sum inside one GEMM, made a strided element-wise gather (much slower).
        w2g = gather_blocks(w2, flat)  # [T*k, H, I]
        y = torch.bmm(w2g, act.view(T * k, I, 1)).view(T, k, H)
        return y.sum(1)
    if method == "grouped":
        order, inverse, ends = _sorted_pairs(topk_ids, E)
        xs = x.index_select(0, order // k)
        ws = topk_weights.reshape(-1).index_select(0, order).float()
        y = _grouped_experts(xs, ws, w13, w2, ends, "grouped")
        return _combine(y, inverse, k)
    if method == "dense":
        wd = torch.zeros(T, E, device=x.device, dtype=torch.float32)
        wd.scatter_(1, topk_ids.long(), topk_weights.float())
        h = F.linear(x, w13.view(E * twoI, H)).view(T, E, twoI)
        act = F.silu(h[..., :I]).mul_(h[..., I:]).transpose(0, 1)  # [E, T, I]
        y = torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]
        out = torch.bmm(wd.to(y.dtype).unsqueeze(1), y.transpose(0, 1))  # [T, 1, H]
        return out.view(T, H)
    raise ValueError(f"unknown decode method {method!r}")


def sparse_moe_block(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    decode_max_tokens: int = 32,
    decode_method: str = "gather",
    prefill_method: str = "auto",
) -> torch.Tensor:
    """Whole ``Qwen3NextSparseMoeBlock`` forward for one TP rank (before the all-reduce).

    Args:
        x: ``[T, H]`` hidden states (after ``post_attention_layernorm``).
        router_weight: ``[E, H]`` (``mlp.gate.weight``, replicated).
        w13, w2: the rank's expert weights (see module docstring).
        top_k, renormalize: ``num_experts_per_tok``, ``norm_topk_prob``.
        shared_gate_up, shared_down, shared_gate: the rank's shared-expert weights, or ``None``.
        decode_max_tokens: ``T`` up to this uses :func:`moe_experts_decode` (a static-shape
            choice, so each captured batch size gets one fixed path).

    Returns:
        ``[T, H]`` partial sum for this rank (routed + shared).
    """
    weights, ids = route(F.linear(x, router_weight), top_k, renormalize)
    if x.shape[0] <= decode_max_tokens:
        out = moe_experts_decode(x, weights, ids, w13, w2, decode_method)
    else:
        out = moe_experts_prefill(x, weights, ids, w13, w2, prefill_method)
    if shared_gate_up is not None and shared_down is not None:
        out = out + shared_expert(x, shared_gate_up, shared_down, shared_gate)
    return out
