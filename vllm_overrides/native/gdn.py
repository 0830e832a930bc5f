"""Gated DeltaNet (Qwen3.5 / Qwen3.6 ``linear_attention`` layers) in plain PyTorch operators.

Nothing here uses Triton or a custom kernel: only stock torch operators (matmul/bmm,
elementwise, index_select/index_copy_, cumsum), so it runs wherever the vendor PyTorch runs
(Iluvatar BI-V100 included), and the decode functions are CUDA-graph capture safe.

Conventions (identical to vLLM 0.32.0, so states are interchangeable with its Triton kernels):

* ``mixed_qkv`` rows are ``[q (H*K) | k (H*K) | v (HV*V)]`` (Qwen3.5's non-interleaved layout,
  per TP rank), ``H = num_k_heads``, ``HV = num_v_heads``, ``K = head_k_dim``, ``V = head_v_dim``.
* GQA: value head ``hv`` reads key/query head ``hv // (HV // H)`` (each key head repeated
  ``HV // H`` times consecutively, i.e. ``repeat_interleave``).
* Gates: ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-space decay, float32, softplus
  threshold 20) and ``beta = sigmoid(b)``; ``scale = K ** -0.5``.
* q/k are l2-normalised as ``x / sqrt(sum(x^2) + 1e-6)`` in float32 (``use_qk_l2norm_in_kernel``).
* Recurrent state per sequence and value head is ``h`` of shape ``[V, K]`` -- the SSM cache is
  ``[num_slots, HV, V, K]`` (``MambaStateShapeCalculator.gated_delta_net_state_shape``), i.e. the
  transpose of FLA's default ``[K, V]`` (FLA's ``state_v_first=True``). One token does::

      h <- exp(g) * h
      h <- h + beta * (v - h k) k^T
      o  = h (scale * q)

* Conv state: the kernels' view ``[num_slots, conv_dim, kernel - 1]`` (vLLM's default "SD"
  cache storage is ``[num_slots, kernel - 1, conv_dim]``; pass ``cache.transpose(-1, -2)``, as
  vLLM does for its own kernels). It holds the last ``kernel - 1`` *pre-activation* inputs.
* Slot index ``0`` is vLLM's ``NULL_BLOCK_ID`` (padding in captured decode batches) and ``-1``
  is ``PAD_SLOT_ID``: such rows produce zeros and leave every live state untouched.

Prefill uses the chunked (WY) form with chunk size 64. All intra-chunk work is batched across
all chunks of all sequences at once (one triangular solve for ``[beta v | beta exp(G) k]``);
the chunk-to-chunk state recurrence is affine, ``h_next = h @ M_c + B_c`` with
``M_c = exp(G_last) I - w^T K~`` (``[K, K]``) and ``B_c = u^T K~`` (``[V, K]``), built as one
stacked ``[B; M]`` GEMM per chunk and solved by a two-level scan (compose the maps of groups
of consecutive chunks, run the group maps sequentially, walk each group; see
:func:`_affine_scan`). The output is rewritten so the state enters through one GEMM after the
scan. Sequence boundaries need no segment logic: the first chunk of each sequence gets the
constant map ``M = 0, B = h0 @ M + B``, which cuts every composition that crosses the boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rmsnorm import rms_norm_gated

__all__ = [
    "CHUNK_SIZE",
    "ChunkLayout",
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_packed_decode",
    "gated_delta_rule_decode",
    "gdn_gating",
    "l2norm",
    "post_conv_prep",
    "prepare_chunk_layout",
    "rms_norm_gated",
    "split_mixed_qkv",
]

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1
# The chunk scan runs over groups of L consecutive chunks (see _affine_scan); L is chosen by a
# small cost model: padded chunk slots + this cost per sequential kernel launch (one kernel
# costs about as much as this many chunk slots of scan work on an H200 at TP4).
_SCAN_KERNEL_COST = 4.0


# --------------------------------------------------------------------------------------------
# Small helpers shared by prefill and decode
# --------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` in float32 (FLA's ``l2norm_fwd`` numerics)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5 GDN gates, float32.

    Args:
        A_log: ``[HV]`` (the layer's ``A_log``).
        a: ``[..., HV]`` decay input from ``in_proj_ba``.
        dt_bias: ``[HV]``.
        b: ``[..., HV]`` write-strength input from ``in_proj_ba``.

    Returns:
        ``(g, beta)``: ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-space decay, <= 0) and
        ``beta = sigmoid(b)``, both float32 with ``a``'s shape.
    """
    sp = F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    g = -torch.exp(A_log.float()) * sp
    return g, torch.sigmoid(b.float())


def split_mixed_qkv(
    mixed_qkv: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [T, H, K]``, ``k [T, H, K]``, ``v [T, HV, V]`` into ``mixed_qkv [T, 2HK+HV*V]``."""
    n = mixed_qkv.shape[0]
    qk = num_k_heads * head_k_dim
    q, k, v = mixed_qkv.split([qk, qk, mixed_qkv.shape[-1] - 2 * qk], dim=-1)
    return (
        q.view(n, num_k_heads, head_k_dim),
        k.view(n, num_k_heads, head_k_dim),
        v.view(n, -1, head_v_dim),
    )


def post_conv_prep(
    conv_output: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    apply_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as vLLM's ``fused_post_conv_prep`` (without ``output_g_exp``).

    Args:
        conv_output: ``[L, 2HK + HV*V]`` conv'd ``mixed_qkv``.
        a, b: ``[L, HV]``.
        A_log, dt_bias: ``[HV]``.

    Returns:
        ``q, k [L, H, K]`` (l2-normalised if asked, in the input dtype), ``v [L, HV, V]``
        (contiguous copy), ``g, beta [L, HV]`` float32.
    """
    q, k, v = split_mixed_qkv(conv_output, num_k_heads, head_k_dim, head_v_dim)
    if apply_l2norm:
        q = l2norm(q).to(conv_output.dtype)
        k = l2norm(k).to(conv_output.dtype)
    else:
        q, k = q.contiguous(), k.contiguous()
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    return q, k, v.contiguous(), g, beta


# --------------------------------------------------------------------------------------------
# Short causal conv1d (kernel 4, SiLU), carried conv state
# --------------------------------------------------------------------------------------------


def is_silu(activation: str | bool | None) -> bool:
    """Whether vLLM's conv ``activation`` argument means SiLU."""
    return activation is True or activation in ("silu", "swish")


def _activate(x: torch.Tensor, activation: str | bool | None) -> torch.Tensor:
    if is_silu(activation):
        return F.silu(x)
    if activation in (None, False):
        return x
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Depthwise causal conv1d over varlen packed sequences; updates ``conv_states`` in place.

    Same math as vLLM's ``causal_conv1d_fn`` (``out[t] = act(bias + sum_j w[:, j] *
    x[t - (W-1) + j])`` with the ``W-1`` positions before a sequence taken from its conv state,
    or zeros when it has no initial state), but ``x`` is token-major: pass ``mixed_qkv``
    itself, not ``mixed_qkv.transpose(0, 1)``.

    Implemented as ``W`` shifted multiply-adds over the whole packed stream (pure elementwise
    work), then a fix-up of the first ``W-1`` tokens of every sequence, which the shifted sum
    computed from the previous sequence's tail instead of the conv state.

    Args:
        x: ``[T, D]`` token-major inputs (``D = conv_dim`` per rank).
        weight: ``[D, W]`` (``conv1d.weight`` viewed as 2D).
        bias: ``[D]`` or ``None``.
        conv_states: ``[num_slots, D, W-1]`` (a transposed view of the SD cache is fine).
        query_start_loc: ``[N+1]`` cumulative sequence starts.
        cache_indices: ``[N]`` state slot per sequence (default ``arange(N)``); slots equal to
            ``pad_slot_id`` are not updated (slot 0 is read/written back unchanged instead;
            vLLM keeps slot 0 as its null block).
        has_initial_state: ``[N]`` bool; ``False`` means zero history.
        activation: ``"silu"`` (Qwen3.5) or ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.
    """
    T, D = x.shape
    W = weight.shape[1]
    S = W - 1
    dev = x.device
    out_dtype = x.dtype
    xs = x.to(conv_states.dtype)
    qsl = query_start_loc.to(dev, torch.long)
    N = qsl.numel() - 1
    starts, ends = qsl[:-1], qsl[1:]
    lens = ends - starts
    slots = (
        torch.arange(N, device=dev) if cache_indices is None else cache_indices.to(dev, torch.long)
    )
    slot_ok = slots != pad_slot_id
    slots_c = slots.clamp(min=0)
    init = conv_states.index_select(0, slots_c)  # [N, D, S]
    if has_initial_state is not None:
        init = torch.where(has_initial_state.to(dev).view(N, 1, 1), init, torch.zeros_like(init))

    w32 = weight.float()
    # Shifted multiply-add over the packed stream: xp[j + t] = x[t - (W-1) + j].
    xp = F.pad(xs, (0, 0, S, 0))
    acc = xs.float() * w32[:, S]
    for j in range(S):
        acc.addcmul_(xp[j : j + T], w32[:, j])
    if bias is not None:
        acc += bias.float()

    # Combined source for gathers: the packed tokens, then every sequence's initial columns.
    src = torch.cat([xs, init.transpose(1, 2).reshape(N * S, D)], dim=0)  # [T + N*S, D]
    p = torch.arange(S, device=dev)
    seq_base = T + torch.arange(N, device=dev) * S

    # Fix-up of the first S tokens of each sequence: window tap j sees relative position
    # rel = p - (W-1) + j; rel >= 0 -> token start+rel, else initial column S+rel.
    j = torch.arange(W, device=dev)
    rel = p.view(S, 1) - S + j.view(1, W)  # [S, W]
    idx = torch.where(
        rel.view(1, S, W) >= 0,
        starts.view(N, 1, 1) + rel.clamp(min=0).view(1, S, W),
        seq_base.view(N, 1, 1) + (S + rel).clamp(min=0).view(1, S, W),
    ).clamp(max=T + N * S - 1)
    win = src.index_select(0, idx.reshape(-1)).view(N, S, W, D).float()
    fix = (win * w32.t().view(1, 1, W, D)).sum(2)
    if bias is not None:
        fix = fix + bias.float()
    fix_tok = starts.view(N, 1) + p.view(1, S)
    fix_ok = p.view(1, S) < lens.view(N, 1)
    target = torch.where(fix_ok, fix_tok, torch.full_like(fix_tok, T))
    acc_ext = torch.cat([acc, acc.new_zeros(1, D)], dim=0)
    acc_ext.index_copy_(0, target.reshape(-1), fix.reshape(N * S, D))
    out = _activate(acc_ext[:T], activation).to(out_dtype)

    # New conv state: the last S inputs of [initial columns | sequence].
    rel_s = lens.view(N, 1) - S + p.view(1, S)  # [N, S]
    sidx = torch.where(
        rel_s >= 0, starts.view(N, 1) + rel_s.clamp(min=0), seq_base.view(N, 1) + S + rel_s
    ).clamp(0, T + N * S - 1)
    new_state = src.index_select(0, sidx.reshape(-1)).view(N, S, D).transpose(1, 2)
    new_state = torch.where(slot_ok.view(N, 1, 1), new_state, conv_states.index_select(0, slots_c))
    conv_states.index_copy_(0, slots_c, new_state.to(conv_states.dtype))
    return out


def causal_conv1d_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    conv_state_indices: torch.Tensor | None = None,
    null_block_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """One decode step of the causal conv (vLLM's ``causal_conv1d_update`` for 1 token/seq).

    Capture safe: static shapes, no host sync. Rows whose slot is ``null_block_id`` (or
    negative) leave their conv state unchanged and return zeros.

    Args:
        x: ``[B, D]`` this step's ``mixed_qkv``.
        conv_state: ``[num_slots, D, W-1]`` (updated in place).
        weight: ``[D, W]``; bias: ``[D]`` or ``None``.
        conv_state_indices: ``[B]`` slot per row (default ``arange(B)``).

    Returns:
        ``[B, D]`` in ``x.dtype``.
    """
    B = x.shape[0]
    if conv_state_indices is None:
        idx = torch.arange(B, device=x.device)
        valid = None
    else:
        idx = conv_state_indices.to(torch.long)
        valid = (idx != null_block_id) & (idx >= 0)
        idx = idx.clamp(min=0)
    st = conv_state.index_select(0, idx)  # [B, D, S]
    win = torch.cat([st, x.to(st.dtype).unsqueeze(-1)], dim=-1)  # [B, D, W]
    acc = (win.float() * weight.float()).sum(-1)
    if bias is not None:
        acc = acc + bias.float()
    out = _activate(acc, activation)
    new = win[..., 1:]
    if valid is not None:
        new = torch.where(valid.view(B, 1, 1), new, st)
        out = torch.where(valid.view(B, 1), out, torch.zeros_like(out))
    conv_state.index_copy_(0, idx, new)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Chunked gated delta rule (prefill)
# --------------------------------------------------------------------------------------------


@dataclass
class ChunkLayout:
    """Where every token of a packed varlen batch sits in the padded chunk grid.

    All tensors live on the compute device; only ``n_chunks`` / ``n_pad`` / ``group`` are
    Python ints (derived from tensor *shapes*, so building this from vLLM's precomputed
    ``chunk_indices`` / ``chunk_offsets`` needs no host sync).

    Attributes:
        n_chunks: real chunks (sum over sequences of ``ceil(len / 64)``).
        n_pad: chunk slots, ``>= n_chunks``; padding slots carry identity maps.
        group: chunks per scan group (``n_pad = group * n_groups``, see :func:`_affine_scan`).
        tok_idx: ``[n_pad, C]`` token index of each chunk row (clamped to a valid token).
        tok_valid: ``[n_pad, C]`` whether that row is a real token.
        row_of_token: ``[T]`` flat chunk row (``chunk * C + pos``) of each token.
        first_chunk, last_chunk: ``[N]`` chunk slot of each sequence's first / last chunk
            (slot 0 -- always some sequence's first chunk -- for empty sequences, whose
            contributions are masked to zero).
        nonempty: ``[N]`` bool.
    """

    n_chunks: int
    n_pad: int
    group: int
    tok_idx: torch.Tensor
    tok_valid: torch.Tensor
    row_of_token: torch.Tensor
    first_chunk: torch.Tensor
    last_chunk: torch.Tensor
    nonempty: torch.Tensor


def _scan_shape(n_slots: int) -> tuple[int, int]:
    """``(n_pad, group)`` for ``n_slots`` chunks: ``n_pad = group * n_groups >= n_slots``.

    The scan costs about ``3 * group + n_groups`` sequential kernels (see :func:`_affine_scan`)
    plus work proportional to ``n_pad``; minimise padding + ``_SCAN_KERNEL_COST`` per kernel.
    """
    best: tuple[float, int, int] | None = None
    for group in range(1, n_slots + 1):
        n_groups = -(-n_slots // group)
        n_pad = group * n_groups
        cost = n_pad + _SCAN_KERNEL_COST * (3 * group + n_groups)
        if best is None or cost < best[0]:
            best = (cost, n_pad, group)
    assert best is not None
    return best[1], best[2]


def prepare_chunk_layout(
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> ChunkLayout:
    """Build the chunk grid for ``cu_seqlens``.

    Args:
        cu_seqlens: ``[N+1]`` (device tensor).
        num_tokens: ``T`` (``cu_seqlens[-1]``, as an int the caller knows from a shape).
        chunk_indices: ``[n_chunks, 2]`` ``(seq, chunk-in-seq)`` rows, as vLLM's GDN metadata
            precomputes them; chunk_offsets: ``[N+1]`` cumulative chunk counts. When either is
            missing they are derived from ``cu_seqlens`` with one device-to-host copy.
    """
    dev = cu_seqlens.device
    C = chunk_size
    cu = cu_seqlens.to(torch.long)
    N = cu.numel() - 1
    if chunk_indices is None or chunk_offsets is None:
        lens_cpu = (cu[1:] - cu[:-1]).cpu()
        counts = (lens_cpu + C - 1) // C
        offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        seq_ids = torch.repeat_interleave(torch.arange(N), counts)
        within = torch.arange(int(offs[-1])) - offs[:-1].repeat_interleave(counts)
        chunk_indices = torch.stack([seq_ids, within], 1).to(dev)
        chunk_offsets = offs.to(dev)
    ci = chunk_indices.to(dev, torch.long)
    co = chunk_offsets.to(dev, torch.long)
    n = ci.shape[0]
    n_pad, group = _scan_shape(max(n, 1))

    seq_c, k_c = ci[:, 0], ci[:, 1]
    start = cu[seq_c] + k_c * C
    end = cu[seq_c + 1]
    pos = torch.arange(C, device=dev)
    tok = start.view(n, 1) + pos.view(1, C)
    valid = tok < end.view(n, 1)
    tok_idx = torch.zeros(n_pad, C, dtype=torch.long, device=dev)
    tok_valid = torch.zeros(n_pad, C, dtype=torch.bool, device=dev)
    if num_tokens > 0:
        tok_idx[:n] = tok.clamp(max=num_tokens - 1)
    tok_valid[:n] = valid

    t = torch.arange(num_tokens, device=dev)
    seq_t = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=max(N - 1, 0))
    p_t = t - cu[seq_t]
    row_of_token = (co[seq_t] + p_t // C) * C + p_t % C

    lens = cu[1:] - cu[:-1]
    nonempty = lens > 0
    first_chunk = torch.where(nonempty, co[:-1], 0)
    last_chunk = torch.where(nonempty, co[1:] - 1, 0)
    return ChunkLayout(
        n, n_pad, group, tok_idx, tok_valid, row_of_token, first_chunk, last_chunk, nonempty
    )


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """View the ``size x size`` diagonal blocks of ``x [..., C, C]`` as ``[..., C/size, s, s]``."""
    C = x.shape[-1]
    nb = C // size
    v = x.view(*x.shape[:-2], nb, size, nb, size)
    return torch.diagonal(v, dim1=-4, dim2=-2).movedim(-1, -3)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two).

    Recursive block doubling: with the inverses ``X11``, ``X22`` of the two diagonal halves of
    each ``2s`` block known, its lower-left block is ``-X22 @ A21 @ X11``. Six levels of
    batched matmuls for C = 64, no sequential per-row loop, and -- unlike the product form
    ``prod(I + (-A)^(2^i))`` -- no cancellation between huge terms, so it is as stable as
    blocked forward substitution.
    """
    C = A.shape[-1]
    X = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    # s = 1: the 1x1 diagonal blocks are 1, so X21 = -A21.
    _blocks(X, 2)[..., 1, 0] = -_blocks(A, 2)[..., 1, 0]
    s = 2
    while s < C:
        xb = _blocks(X, 2 * s)
        ab = _blocks(A, 2 * s)
        x11 = xb[..., :s, :s]
        x22 = xb[..., s:, s:]
        a21 = ab[..., s:, :s]
        if s <= 8:
            # Tiny blocks: broadcast-multiply-reduce on the strided views (no GEMM launch on
            # 2x2..8x8 matrices, no contiguous copies).
            t = (x22.unsqueeze(-1) * a21.unsqueeze(-3)).sum(-2)
            xb[..., s:, :s] = -(t.unsqueeze(-1) * x11.unsqueeze(-3)).sum(-2)
        else:
            xb[..., s:, :s] = -torch.matmul(torch.matmul(x22, a21), x11)
        s *= 2
    return X


def _affine_scan(MB: torch.Tensor, V: int, group: int) -> torch.Tensor:
    """States entering each chunk for the affine recurrence ``h_{c+1} = h_c @ M_c + B_c``.

    Args:
        MB: ``[RH, n, V+K, K]`` per-chunk maps stacked as rows ``[B_c; M_c]`` (``B_c [V, K]``,
            ``M_c [K, K]``), ``n = group * n_groups``.

    Returns:
        ``[RH, n, V, K]`` with ``out[:, 0] = 0`` and ``out[:, c] = f_{c-1}(... f_0(0))``.

    Two-level scan over groups of ``L = group`` consecutive chunks, every step one batched
    GEMM over all groups and heads:

    1. per group, compose its maps left to right (``L - 1`` steps): with the stacked rows,
       ``[B; M] @ M_j + [B_j; 0]`` composes both parts in one GEMM;
    2. run the ``n_groups`` group maps sequentially from the zero state (group entry states);
    3. per group, walk the chunks from its entry state (``L - 1`` steps), writing each state.

    The per-chunk maps are read twice and the states written once (~0.7 GB at T=16K, TP4),
    against ~1.8 GB for the Blelloch up/down sweep this replaced (whose levels re-read and
    re-wrote the maps and stacked the states at every level).
    """
    RH, n, VK, K = MB.shape
    L = group
    NG = n // L
    X = MB.view(RH, NG, L, VK, K)

    def m_(j: int) -> torch.Tensor:  # [RH*NG, K, K] maps of chunk j of every group
        return X[:, :, j, V:].reshape(RH * NG, K, K)

    def b_(j: int) -> torch.Tensor:  # [RH*NG, V, K]
        return X[:, :, j, :V].reshape(RH * NG, V, K)

    # 1. group maps
    acc = X[:, :, 0].reshape(RH * NG, VK, K)
    for j in range(1, L):
        acc = torch.bmm(acc, m_(j))
        acc[:, :V] += b_(j)
    acc = acc.view(RH, NG, VK, K)
    # 2. group entry states
    H = MB.new_empty(RH, NG, L, V, K)
    H[:, 0, 0].zero_()
    for gi in range(1, NG):
        torch.baddbmm(acc[:, gi - 1, :V], H[:, gi - 1, 0], acc[:, gi - 1, V:], out=H[:, gi, 0])
    # 3. chunk entry states inside each group
    for j in range(L - 1):
        out = H[:, :, j + 1].view(RH * NG, V, K)
        torch.baddbmm(b_(j), H[:, :, j].view(RH * NG, V, K), m_(j), out=out)
    return H.view(RH, n, V, K)


@contextlib.contextmanager
def _cuda_tf32(enabled: bool) -> Iterator[None]:
    """TF32 tensor cores for CUDA float32 matmuls inside the block, the previous setting
    restored after (vLLM's workers default to exact float32: VLLM_FLOAT32_MATMUL_PRECISION)."""
    if not enabled:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    core_attn_out: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
    tri_solve: str = "matmul",
    tf32: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule over (varlen) sequences; drop-in for vLLM's FLA call.

    Same arguments and layouts as ``ChunkGatedDeltaRule.forward_native`` in vLLM 0.32.0.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``).
        g: ``[B, T, HV]`` log-space decay; beta: ``[B, T, HV]``.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, V, K]`` (vLLM state layout) or ``None`` for zeros.
        output_final_state: return the ``[N, HV, V, K]`` float32 final states.
        cu_seqlens: ``[N+1]``; when given, ``B`` must be 1 (packed varlen batch). Without it
            the ``B`` rows are ``B`` equal-length sequences.
        chunk_indices, chunk_offsets: vLLM's precomputed FLA chunk metadata (avoids the one
            host sync that deriving the chunk grid from ``cu_seqlens`` costs).
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        core_attn_out: optional ``[>= B*T, HV, V]`` buffer that receives the output.
        layout: a prebuilt :class:`ChunkLayout` (shared by all layers of one forward).
        tri_solve: ``"matmul"`` (block-doubling inverse, batched matmuls only: the portable
            default) or ``"torch"`` (``torch.linalg.solve_triangular``, where the backend has
            a batched triangular solve).
        tf32: on CUDA, run the float32 GEMMs (intra-chunk products, chunk maps, scan, output)
            on TF32 tensor cores whatever the process-wide setting. On the H200 at T=16K, TP4:
            2.22 vs 3.04 ms, with output / final-state errors vs float64 of 1.7e-3 / 3.6e-4
            against FLA's 4.1e-3 / 3.0e-3 (worklogs/LEDGER.md). No effect on other devices.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in ``q.dtype``; ``final_state`` or ``None``.

    Math per chunk (``G`` the in-chunk cumulative ``g``, ``Γ_ij = exp(G_i - G_j)`` for
    ``i >= j``, ``h`` the ``[V, K]`` state entering the chunk)::

        A  = strict_lower(beta_i Γ_ij k_i.k_j);  T = (I + A)^-1
        u  = T (beta v);   w = T (beta exp(G) k)
        v' = u - w h^T                               (the true per-token delta values)
        o  = exp(G) (q h^T) + (lower(Γ) * q k^T) v'
        h_next = h (exp(G_last) I - w^T K~) + u^T K~,    K~_j = exp(G_last - G_j) k_j
    """
    with _cuda_tf32(tf32 and q.is_cuda):
        return _chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            chunk_indices, chunk_offsets, use_qk_l2norm_in_kernel, core_attn_out, layout,
            tri_solve,
        )  # fmt: skip


def _chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    chunk_offsets: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    core_attn_out: torch.Tensor | None,
    layout: ChunkLayout | None,
    tri_solve: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B_, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"HV={HV} must be a multiple of H={H}")
    R = HV // H
    if scale is None:
        scale = K**-0.5
    dev = q.device
    if cu_seqlens is not None:
        if B_ != 1:
            raise ValueError("packed varlen input (cu_seqlens) needs batch size 1")
        cu = cu_seqlens.to(dev)
    else:
        cu = torch.arange(B_ + 1, device=dev, dtype=torch.long) * T_
    Ttot = B_ * T_
    N = cu.numel() - 1
    if layout is None:
        layout = prepare_chunk_layout(cu, Ttot, chunk_indices, chunk_offsets)
    npad = layout.n_pad
    C = layout.tok_idx.shape[1]

    if layout.n_chunks == 0:  # only empty sequences
        h0_user = (
            torch.zeros(N, HV, V, K, device=dev) if initial_state is None else initial_state.float()
        )
        o = torch.zeros(B_, T_, HV, V, device=dev, dtype=q.dtype)
        return o, (h0_user.clone() if output_final_state else None)
    idx = layout.tok_idx.reshape(-1)
    mask = layout.tok_valid.view(1, 1, npad, C)
    RH, G3 = R * H, R * H * npad
    f32 = torch.float32

    # Token -> chunk gathers. Inside, value heads are ordered (r, h) -- value head hv = h*R + r
    # sits at [r, h] -- so for each r the H value heads line up with the H key heads and GQA
    # needs no expanded copies of q or k (they broadcast over the leading R dim).
    # Gathers run along dim 0 of the token-major tensors (contiguous rows: a vectorised gather;
    # index_select on a permuted view fell back to a per-element kernel, ~4x slower on the
    # H200), and the head-major float32 copy is one permuting copy.
    def kchunks(x: torch.Tensor) -> torch.Tensor:  # [.., H, K] -> [H, npad, C, K] float32
        xg = x.reshape(Ttot, H, K).index_select(0, idx).view(npad, C, H, K)
        out = torch.empty(H, npad, C, K, device=dev, dtype=f32)
        out.copy_(xg.permute(2, 0, 1, 3))
        return out

    qc, kc = kchunks(q), kchunks(k)
    vb = v.reshape(Ttot, H, R, V).index_select(0, idx).view(npad, C, H, R, V)
    vb = vb.permute(3, 2, 0, 1, 4)  # [R, H, npad, C, V] view; converted into the solve's RHS
    zero = torch.zeros((), device=dev)
    gc = g.reshape(Ttot, H, R).permute(2, 1, 0).index_select(2, idx).view(R, H, npad, C)
    bc = beta.reshape(Ttot, H, R).permute(2, 1, 0).index_select(2, idx).view(R, H, npad, C)
    gc = torch.where(mask, gc.to(f32), zero)  # padded rows: no decay ...
    bc = torch.where(mask, bc.to(f32), zero)  # ... and no write -> identity maps
    # k is normalised in place (it feeds four products); q's factor (scale / |q|) is only a
    # per-row scalar [H, npad, C], applied to the two [C, *] results that involve q.
    if use_qk_l2norm_in_kernel:
        kc.mul_(
            torch.linalg.vector_norm(kc, dim=-1, keepdim=True).square_().add_(L2NORM_EPS).rsqrt_()
        )
        sq = torch.linalg.vector_norm(qc, dim=-1).square_().add_(L2NORM_EPS).rsqrt_().mul_(scale)
    else:
        sq = torch.full((H, npad, C), scale, device=dev)

    G = gc.cumsum(-1)  # [R, H, npad, C]
    gam = G.exp()
    # Γ_ij = exp(G_i - G_j) for i >= j; above the diagonal exp may overflow, tril_ zeroes it.
    decay = torch.sub(G.unsqueeze(-1), G.unsqueeze(-2)).exp_().tril_()  # [R, H, npad, C, C]
    kt = kc.transpose(-1, -2)
    A = torch.mul(decay, torch.matmul(kc, kt)).mul_(bc.unsqueeze(-1))  # [R, H, npad, C, C]
    A.diagonal(dim1=-2, dim2=-1).zero_()
    Lq = decay.mul_(torch.matmul(qc, kt).mul_(sq.unsqueeze(-1)))  # reuses the decay buffer
    del decay

    # One triangular solve for both right-hand sides: [u | wn] = (I + A)^-1 [beta v | -beta
    # exp(G) k]  (wn = -w), one [C, V+K] block per chunk and value head.
    rhs = torch.empty(R, H, npad, C, V + K, device=dev)
    torch.mul(vb, bc.unsqueeze(-1), out=rhs[..., :V])
    torch.mul(kc, (bc * gam).neg_().unsqueeze(-1), out=rhs[..., V:])
    if tri_solve == "torch":
        uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    else:
        uw = torch.matmul(_unit_lower_inverse(A), rhs)
    del A, rhs, vb
    # Chunk maps h_next = h M + B, stacked [B; M] = [u | wn]^T K~ (+ exp(G_last) I on M),
    # K~_j = exp(G_last - G_j) k_j: one GEMM per chunk and value head.
    glast = G[..., -1:]  # [R, H, npad, 1]
    ktil = kc * torch.exp(glast - G).unsqueeze(-1)  # [R, H, npad, C, K]
    MB = torch.matmul(uw.transpose(-1, -2), ktil).view(RH, npad, V + K, K)
    del ktil
    Mm, Bm = MB[:, :, V:], MB[:, :, :V]
    Mm.diagonal(dim1=-2, dim2=-1).add_(torch.exp(glast).view(RH, npad, 1))
    # The output needs the state only through one GEMM: with v' = u + wn h^T,
    #   o = exp(G) q^ h^T + Lq v' = (exp(G) q^ + Lq wn) h^T + Lq u,
    # so P = Lq [u | wn] (+ exp(G) q^ on the wn part) is formed before the scan.
    P = torch.matmul(Lq, uw)  # [R, H, npad, C, V+K]
    del Lq, uw
    P[..., V:].addcmul_(qc, (gam * sq).unsqueeze(-1))
    del qc, kc

    # Fold the initial states into each sequence's first chunk (constant map).
    if initial_state is None:
        h0_user = torch.zeros(N, HV, V, K, device=dev)
    else:
        h0_user = initial_state.to(f32)
    h0 = h0_user.view(N, H, R, V, K).permute(2, 1, 0, 3, 4).contiguous().view(RH, N, V, K)
    # Empty sequences point at slot 0 with zero contributions; index_add_ of exact zeros keeps
    # the (duplicate-index) writes deterministic.
    fc, lc = layout.first_chunk, layout.last_chunk
    live = layout.nonempty.view(1, N, 1, 1)
    mb_last = MB.index_select(1, lc) if output_final_state else None
    h0_m = torch.matmul(h0, Mm.index_select(1, fc))
    Mm.index_fill_(1, fc, 0.0)
    Bm.index_add_(1, fc, torch.where(live, h0_m, 0.0))
    H_in = _affine_scan(MB, V, layout.group)  # [RH, npad, V, K]
    del MB, Mm, Bm
    H_in.index_add_(1, fc, torch.where(live, h0 - H_in.index_select(1, fc), 0.0))

    # o = P_u + P_w h^T: one batched GEMM per chunk and value head.
    o = torch.baddbmm(
        P[..., :V].reshape(G3, C, V),
        P[..., V:].reshape(G3, C, K),
        H_in.view(G3, V, K).transpose(1, 2),
    )
    del P
    # One permuting cast to chunk-row-major [npad*C, H, R, V] (= [rows, HV, V]), then one
    # contiguous-row gather back to token order.
    ob = torch.empty(npad * C, H, R, V, device=dev, dtype=q.dtype)
    ob.view(npad, C, H, R, V).copy_(o.view(R, H, npad, C, V).permute(2, 3, 1, 0, 4))
    o = ob.view(npad * C, HV, V).index_select(0, layout.row_of_token)
    if core_attn_out is not None:
        core_attn_out[:Ttot].copy_(o)
    o = o.view(B_, T_, HV, V)

    final = None
    if output_final_state:
        assert mb_last is not None
        fin = (
            torch.baddbmm(
                mb_last[:, :, :V].reshape(RH * N, V, K),
                H_in.index_select(1, lc).view(RH * N, V, K),
                mb_last[:, :, V:].reshape(RH * N, K, K),
            )
            .view(R, H, N, V, K)
            .permute(2, 1, 0, 3, 4)
            .reshape(N, HV, V, K)
        )
        final = torch.where(layout.nonempty.view(N, 1, 1, 1), fin, h0_user)
    return o, final


# --------------------------------------------------------------------------------------------
# Single-step recurrent decode
# --------------------------------------------------------------------------------------------


def _valid_and_clamp(
    state_indices: torch.Tensor | None, batch: int, device: torch.device, null_block_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(clamped slot indices, live-row mask or None)."""
    if state_indices is None:
        return torch.arange(batch, device=device), None
    idx = state_indices.reshape(-1).to(torch.long)
    if null_block_id == 0:
        valid = idx > 0
    else:
        valid = (idx != null_block_id) & (idx >= 0)
    return idx.clamp(min=0), valid


def _decode_core(
    qk: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor,
    bt: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    gather: str,
) -> torch.Tensor:
    """One recurrent step. ``qk [B, H, 2, K]`` float32 raw (``[:, :, 0]`` = q, ``1`` = k);
    ``e = exp(g)`` and ``bt = beta`` ``[B, HV]`` float32, already 1 / 0 on dead rows."""
    B, H, _, K = qk.shape
    HV, V = v.shape[1], v.shape[2]
    R = HV // H
    BH = B * H
    dev = qk.device
    qk3 = qk.view(BH, 2, K)
    # One tiny Gram matmul gives |q|^2, |k|^2 and q.k for every key head: the K-dim vectors are
    # never normalised; their factors are applied to the [., V] results instead.
    gram = torch.bmm(qk3, qk3.transpose(1, 2))  # [BH, 2, 2]
    if use_qk_l2norm:
        r = torch.rsqrt(gram.diagonal(dim1=1, dim2=2) + L2NORM_EPS)  # [BH, 2] = 1/|q|, 1/|k|
    else:
        r = torch.ones(BH, 2, device=dev)
    r[:, 0] *= scale
    c = gram[:, 0, 1] * r[:, 0] * r[:, 1]  # q^.k^ (q^ = scaled, normalised q)

    # he = exp(g) * h for the live slots: one pass (gather and decay fused) when possible.
    # "auto" = index_select: on the H200 embedding_bag's gather+scale pass ran at well under
    # half the copy bandwidth (108 us vs ~35 us for index_select + mul_ at B=64, TP4).
    use_bag = gather == "embedding_bag" and state.dtype == torch.float32 and state.is_contiguous()
    if use_bag:
        rows = torch.add(torch.arange(HV, device=dev), idx.view(B, 1), alpha=HV)
        he = F.embedding_bag(
            rows.view(-1, 1),
            state.view(-1, V * K),
            mode="sum",
            per_sample_weights=e.reshape(-1, 1).to(state.dtype),
        )
        if he.dtype != torch.float32:
            he = he.float()
    else:
        he = state.index_select(0, idx).float()
        he.mul_(e.view(B, HV, 1, 1))
    # GQA without copies: the R value heads of a key head are stacked along the V rows.
    he3 = he.view(BH, R * V, K)
    hqk = torch.bmm(he3, qk3.transpose(1, 2))  # [BH, R*V, 2]: h_e q, h_e k (raw)
    hqk.mul_(r.view(BH, 1, 2))
    hq = hqk[..., 0].view(B, H, R, V)
    hk = hqk[..., 1].view(B, H, R, V)
    delta = torch.sub(v.view(B, H, R, V), hk)
    delta.mul_(bt.view(B, H, R, 1))
    o = torch.addcmul(hq, delta, c.view(B, H, 1, 1))
    # h' = h_e + delta k^T with k normalised: fold 1/|k| into delta.
    dk = delta * r[:, 1].view(B, H, 1, 1)
    he3.baddbmm_(dk.view(BH, R * V, 1), qk3[:, 1:2, :])
    state.index_copy_(0, idx, he.view(B, HV, V, K).to(state.dtype))
    o = o.view(B, HV, V)
    if valid is not None:
        o = torch.where(valid.view(B, 1, 1), o, 0.0)
    return o


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    null_block_id: int = NULL_BLOCK_ID,
    gather: str = "auto",
) -> torch.Tensor:
    """One recurrent step for ``B`` sequences, updating their states in place.

    Capture safe (static shapes, no host sync, no data-dependent control flow).

    With ``h_e = exp(g) * h``: ``delta = beta * (v - h_e k)``, ``o = h_e q + delta (k.q)``,
    ``h' = h_e + delta k^T``. The state is gathered (``index_select``) and decayed in place,
    read by one batched matmul (``h_e @ [q, k]``), updated by one rank-1 ``baddbmm_`` and
    written back by one ``index_copy_`` (``gather="embedding_bag"`` fuses gather and decay
    into one pass, but that kernel was slower on the H200). The l2 norms, the scale and
    ``q.k`` come from a 2x2 Gram matrix per key head and are applied to ``[V]``-sized
    results, and the GQA repeat is a reshape (``[R*V, K]`` rows per key head), so no K-dim
    vector is copied or expanded.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, HV, V]``; g, beta: ``[B, HV]`` (float32 gates).
        state: ``[num_slots, HV, V, K]`` cache (any float dtype; math in float32).
        state_indices: ``[B]`` slots (default ``arange(B)``). Rows whose slot is
            ``null_block_id`` or negative output zeros and keep every state unchanged.
        scale: default ``K ** -0.5``.
        gather: ``"auto"`` / ``"index_select"``, or ``"embedding_bag"`` (float32 contiguous
            caches only).

    Returns:
        ``o [B, HV, V]`` float32.
    """
    B, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    idx, valid = _valid_and_clamp(state_indices, B, q.device, null_block_id)
    qk = torch.stack([q, k], dim=2).float()
    e = torch.exp(g.float())
    bt = beta.float()
    if valid is not None:
        e = torch.where(valid.view(B, 1), e, 1.0)
        bt = torch.where(valid.view(B, 1), bt, 0.0)
    return _decode_core(qk, v, e, bt, state, idx, valid, scale, use_qk_l2norm_in_kernel, gather)


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    null_block_id: int = NULL_BLOCK_ID,
    gather: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for vLLM's FLA ``fused_recurrent_gated_delta_rule_packed_decode``.

    Capture safe. Dead rows (slot ``<= 0``) are folded into the gate arguments -- ``-inf``
    into softplus's argument (decay 1) and ``-inf`` into sigmoid's (beta 0) -- so masking
    costs no extra pass.

    Args:
        mixed_qkv: ``[B, 2HK + HV*V]`` (post-conv); a, b: ``[B, HV]``; A_log, dt_bias: ``[HV]``.
        initial_state: ``[num_slots, HV, V, K]`` SSM cache, updated in place.
        out: ``[B, 1, HV, V]`` output buffer (written).
        ssm_state_indices: ``[B]``; slot ``<= 0`` rows get zero output and no state write.

    Returns:
        ``(out, initial_state)``.
    """
    B = mixed_qkv.shape[0]
    HV = A_log.shape[0]
    V, K = initial_state.shape[-2], initial_state.shape[-1]
    H = (mixed_qkv.shape[-1] - HV * V) // (2 * K)
    idx, valid = _valid_and_clamp(ssm_state_indices, B, mixed_qkv.device, null_block_id)
    qk = torch.empty(B, H, 2, K, device=mixed_qkv.device, dtype=torch.float32)
    qk.copy_(mixed_qkv[:, : 2 * H * K].view(B, 2, H, K).transpose(1, 2))
    v = mixed_qkv[:, 2 * H * K :].view(B, HV, V)
    x = torch.add(a, dt_bias.float())  # float32 by promotion (a may be bf16)
    bx = b.float()
    if valid is not None:
        dead = torch.where(valid, 0.0, float("inf")).view(B, 1)
        x.sub_(dead)
        bx = bx - dead
    e = torch.exp(F.softplus(x, beta=1.0, threshold=20.0).mul_(-torch.exp(A_log.float())))
    bt = torch.sigmoid(bx)
    o = _decode_core(
        qk, v, e, bt, initial_state, idx, valid, scale, use_qk_l2norm_in_kernel, gather
    )
    out.copy_(o.view(out.shape))
    return out, initial_state
