"""Paged attention over vLLM's block-table KV cache, in plain PyTorch operators.

Three ops, engine-independent (they see tensors and lengths, never vLLM objects):

* :func:`write_kv` -- store the new tokens' keys / values at their slots (``slot_mapping``).
* :func:`decode_attention` -- one query token per sequence over its whole context, read
  through its block table. The context is cut into partitions of ``partition_size`` tokens;
  each partition yields a partial result ``(max, sum of exp, weighted value sum)`` and one
  log-sum-exp merge (:func:`combine_partials`) joins them. That is the shape the CUDA decode
  kernel takes (one launch for the partitions, one for the combine), and it keeps the PyTorch
  path's memory bounded at 262,144 tokens (partitions are gathered a bounded group at a time).
* :func:`prefill_attention` -- a chunk of new tokens per sequence over its cached context
  (every cached token visible, causal inside the chunk), varlen over a batch. The context
  comes from the cache through the block table; the chunk's own keys / values come from the
  arguments, because with a prefix-cache hit vLLM 0.6.3 hands over a block table that covers
  only the cached blocks, and the profile run has no cache at all. Keys are visited in chunks
  with an online softmax, queries in tiles, so no ``[queries x keys]`` matrix larger than
  ``max_score_elems`` is ever built.

Cache layout (our own, over the allocation vLLM sizes for the paged layout)
--------------------------------------------------------------------------
Per layer one tensor ``[2, num_blocks, kv_heads, block_size, head_size]``: index 0 keys,
index 1 values, the same layout for both (:func:`kv_cache_shape`). It holds exactly the
elements of vLLM 0.6.3's ``(2, num_blocks, block_size * kv_heads * head_size)``, so the
engine's block accounting (``CacheEngine.get_cache_block_size``) is unchanged; only the order
inside a block differs. Why not vLLM's paged layout (keys ``[blocks, kv_heads, head/x, block,
x]``, values ``[blocks, kv_heads, head, block]``)? That layout serves vLLM's kernel, in which a
thread group splits one key's head dimension into ``x``-element pieces; ours has no such
kernel to serve. Here one head's ``block_size`` keys are one contiguous ``block_size x
head_size`` tile (8 KiB at 16 x 256 fp16), token-major, and so are its values: the decode
kernel reads a block per head with contiguous loads, QK^T and PV consume rows in the same
order, the writer stores a token's row in one piece, and the PyTorch path is a plain gather.
With one kv head per rank (Qwen3.6 at TP 4) it is also the flash-attention layout.

Numerics: scores, softmax and accumulation in float32 whatever the input dtype (fp16, bf16,
fp32); one rounding to the query dtype at the end. The softmax scale is applied to the float32
query. Query head ``h`` reads kv head ``h // (num_heads // kv_heads)`` (vLLM's GQA grouping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "combine_partials",
    "decode_attention",
    "decode_attention_partials",
    "kv_cache_shape",
    "prefill_attention",
    "split_kv_cache",
    "write_kv",
]

# Tokens per decode partition: a multiple of every block size vLLM offers (8, 16, 32) and a
# unit of work that keeps 262,144 tokens at 512 partials per (sequence, head).
DEFAULT_PARTITION_SIZE = 512
# Bound on the float32 elements one gather / score tile may hold (64 MiB): the PyTorch path's
# peak extra memory, independent of the context length.
DEFAULT_MAX_ELEMS = 1 << 24
# Keys per prefill step of the online softmax.
DEFAULT_KEY_CHUNK = 1024


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    """``(2, num_blocks, kv_heads, block_size, head_size)``: keys at ``[0]``, values at ``[1]``."""
    return (2, num_blocks, num_kv_heads, block_size, head_size)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)``, each ``[num_blocks, kv_heads, block_size, head_size]``."""
    return kv_cache[0], kv_cache[1]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``i``'s keys / values at slot ``slot_mapping[i]``, in place.

    Args:
        key, value: ``[T, kv_heads, head_size]``.
        key_cache, value_cache: ``[num_blocks, kv_heads, block_size, head_size]``.
        slot_mapping: ``[T]`` integer slots ``block * block_size + offset``; a negative slot
            (vLLM's ``PAD_SLOT_ID``, e.g. sliding-window or graph padding) is not written.
    """
    slots = slot_mapping.reshape(-1)[: key.shape[0]].long()
    valid = slots >= 0
    # One host sync for the pad check: padding is rare (never in eager decode), and dropping
    # those rows beats writing them anywhere, since no slot is free to absorb them.
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = key_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def _masked_exp(scores: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``exp(scores - row_max)`` where a row with no visible key (max ``-inf``) gives zeros."""
    safe = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    return torch.exp(scores - safe.unsqueeze(-1))


def combine_partials(m: torch.Tensor, den: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp merge of partial softmax results over their last partition axis.

    Args:
        m: ``[..., P]`` float32 maximum score of each partition (``-inf`` if it saw no key).
        den: ``[..., P]`` float32 ``sum(exp(score - m))`` of each partition.
        acc: ``[..., P, D]`` float32 ``sum(exp(score - m) * v)`` of each partition.

    Returns:
        ``[..., D]`` float32 attention output (zeros for a row that saw no key at all).
    """
    top = m.amax(dim=-1, keepdim=True)
    w = _masked_exp(m, top.squeeze(-1))
    total = (w * den).sum(dim=-1)
    num = (w.unsqueeze(-1) * acc).sum(dim=-2)
    return num / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)


def _gather_tokens(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` as ``[..., kv_heads, n_blocks * block_size, head]``."""
    g = cache[block_ids.long()]  # [..., nb, kv, bs, D]
    nb, kv, bs, d = g.shape[-4:]
    g = g.movedim(-4, -3)  # [..., kv, nb, bs, D]
    return g.reshape(*g.shape[:-4], kv, nb * bs, d)


def decode_attention_partials(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    max_elems: int = DEFAULT_MAX_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-partition partial softmax results of decode attention (see :func:`decode_attention`).

    Returns:
        ``(m, den, acc)``: ``[B, H, P]``, ``[B, H, P]``, ``[B, H, P, D]`` float32, ``P =
        ceil(max_seq_len / partition_size)``, for :func:`combine_partials`.
    """
    B, H, D = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = H // kv_heads
    if partition_size % block_size:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {block_size}")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    num_parts = max(1, math.ceil(max_seq_len / partition_size))
    blocks_per_part = partition_size // block_size
    # Whole partitions per gather, so one gather's K (and its scores) stay under max_elems.
    parts_per_pass = max(1, max_elems // max(1, B * kv_heads * partition_size * D))
    q = (query.float() * scale).view(B, kv_heads, 1, group, D)
    lens = seq_lens.to(device=query.device, dtype=torch.long).view(B, 1)
    tables = block_tables[:B].to(device=query.device)
    ms, ls, accs = [], [], []
    for p0 in range(0, num_parts, parts_per_pass):
        np_ = min(parts_per_pass, num_parts - p0)
        b0, nb = p0 * blocks_per_part, np_ * blocks_per_part
        ids = tables[:, b0 : b0 + nb]
        if ids.shape[1] < nb:  # past the table's padded width: read block 0, masked below
            ids = F.pad(ids, (0, nb - ids.shape[1]))
        k = _gather_tokens(key_cache, ids).float().view(B, kv_heads, np_, partition_size, D)
        v = _gather_tokens(value_cache, ids).float().view(B, kv_heads, np_, partition_size, D)
        pos = torch.arange(b0 * block_size, (b0 + nb) * block_size, device=query.device)
        hidden = (pos.view(1, -1) >= lens).view(B, 1, np_, 1, partition_size)
        # [B, kv, np, group, part]: each query head of the group against its partition's keys
        s = torch.matmul(q, k.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
        m = s.amax(dim=-1)
        p = _masked_exp(s, m)
        ms.append(m)
        ls.append(p.sum(dim=-1))
        accs.append(torch.matmul(p, v))  # [B, kv, np, group, D]
    m = torch.cat(ms, dim=2).permute(0, 1, 3, 2).reshape(B, H, num_parts)
    den = torch.cat(ls, dim=2).permute(0, 1, 3, 2).reshape(B, H, num_parts)
    acc = torch.cat(accs, dim=2).permute(0, 1, 3, 2, 4).reshape(B, H, num_parts, D)
    return m, den, acc


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    max_elems: int = DEFAULT_MAX_ELEMS,
) -> torch.Tensor:
    """One query token per sequence attending to its ``seq_lens[b]`` cached tokens.

    Args:
        query: ``[B, H, D]``; its token is already in the cache (the backend writes first).
        key_cache, value_cache: ``[num_blocks, kv_heads, block_size, D]``.
        block_tables: ``[B, max_blocks]`` physical block ids (padding columns are ignored).
        seq_lens: ``[B]`` tokens to attend to per sequence (at least 1).
        scale: softmax scale.
        max_seq_len: ``max(seq_lens)`` if the caller knows it (saves a host sync).
        partition_size: tokens per partial result (a multiple of ``block_size``).
        max_elems: float32 elements one gather may hold (bounds the extra memory).

    Returns:
        ``[B, H, D]`` in ``query.dtype``.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    m, den, acc = decode_attention_partials(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        max_seq_len,
        partition_size,
        max_elems,
    )
    return combine_partials(m, den, acc).to(query.dtype)


def _online_step(
    m: torch.Tensor, den: torch.Tensor, acc: torch.Tensor, s: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one key chunk (scores ``s [..., n]``, values ``v [..., n, D]``) into the running
    ``(m, den, acc)`` of a flash-style online softmax."""
    m_new = torch.maximum(m, s.amax(dim=-1))
    alpha = _masked_exp(m.unsqueeze(-1), m_new).squeeze(-1)
    p = _masked_exp(s, m_new)
    return m_new, den * alpha + p.sum(dim=-1), acc * alpha.unsqueeze(-1) + torch.matmul(p, v)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
    key_chunk: int | None = None,
    max_elems: int = DEFAULT_MAX_ELEMS,
) -> torch.Tensor:
    """New tokens of several sequences over their cached contexts (varlen, causal in-chunk).

    Args:
        query: ``[T, H, D]``, sequences back to back (``T = sum(query_lens)``).
        key, value: ``[T, kv_heads, D]`` of the same new tokens.
        key_cache, value_cache: ``[num_blocks, kv_heads, block_size, D]``, or ``None`` when
            no sequence has a context (the profile run).
        block_tables: ``[N, max_blocks]``; row ``i`` must cover ``context_lens[i]`` tokens.
        query_lens: new tokens per sequence.
        context_lens: cached tokens per sequence, all visible to every new token.
        scale: softmax scale.
        key_chunk: keys per online-softmax step (rounded up to a whole number of blocks);
            by default as many as ``max_elems`` allows for the sequence's query tile (a short
            suffix after a prefix hit takes its context in a few large steps), at least
            ``DEFAULT_KEY_CHUNK``.
        max_elems: float32 score elements per (query tile x key chunk) step.

    Returns:
        ``[T, H, D]`` in ``query.dtype``.
    """
    T, H, D = query.shape
    kv_heads = key.shape[1]
    group = H // kv_heads
    out = torch.empty_like(query)
    block_size = key_cache.shape[2] if key_cache is not None else 1
    start = 0
    for i, (qlen, clen) in enumerate(zip(query_lens, context_lens, strict=True)):
        qlen, clen = int(qlen), int(clen)
        if qlen == 0:
            continue
        chunk = key_chunk
        if chunk is None:  # bound the scores (H x qlen x chunk) and the gather (kv x chunk x D)
            chunk = min(max_elems // (H * qlen), max_elems // (kv_heads * D))
            chunk = max(DEFAULT_KEY_CHUNK, chunk)
        chunk = max(block_size, math.ceil(chunk / block_size) * block_size)
        q_tile = max(1, max_elems // (H * chunk))
        end = start + qlen
        q = (query[start:end].float() * scale).view(qlen, kv_heads, group, D).permute(1, 2, 0, 3)
        m = torch.full((kv_heads, group, qlen), float("-inf"), device=query.device)
        den = torch.zeros(kv_heads, group, qlen, device=query.device)
        acc = torch.zeros(kv_heads, group, qlen, D, device=query.device)
        # 1. Cached context: every key visible to every query, gathered a chunk at a time.
        if clen > 0:
            if key_cache is None or value_cache is None or block_tables is None:
                raise ValueError(f"sequence {i} has {clen} cached tokens but no cache was given")
            if block_tables.shape[1] * block_size < clen:
                raise ValueError(
                    f"sequence {i}: block table covers {block_tables.shape[1] * block_size} "
                    f"tokens, context has {clen}"
                )
            for c0 in range(0, clen, chunk):
                c1 = min(clen, c0 + chunk)
                ids = block_tables[i, c0 // block_size : math.ceil(c1 / block_size)]
                k = _gather_tokens(key_cache, ids)[:, : c1 - c0].float().unsqueeze(1)
                v = _gather_tokens(value_cache, ids)[:, : c1 - c0].float().unsqueeze(1)
                for t0 in range(0, qlen, q_tile):
                    t1 = min(qlen, t0 + q_tile)
                    s = torch.matmul(q[:, :, t0:t1], k.transpose(-1, -2))
                    m[:, :, t0:t1], den[:, :, t0:t1], acc[:, :, t0:t1] = _online_step(
                        m[:, :, t0:t1], den[:, :, t0:t1], acc[:, :, t0:t1], s, v
                    )
        # 2. The chunk itself, causal: query j sees new keys 0..j.
        kn = key[start:end].float().permute(1, 0, 2).unsqueeze(1)  # [kv, 1, qlen, D]
        vn = value[start:end].float().permute(1, 0, 2).unsqueeze(1)
        for k0 in range(0, qlen, chunk):
            k1 = min(qlen, k0 + chunk)
            kpos = torch.arange(k0, k1, device=query.device)
            for t0 in range(k0 - k0 % q_tile, qlen, q_tile):  # tiles wholly before k0 see none
                t1 = min(qlen, t0 + q_tile)
                qpos = torch.arange(t0, t1, device=query.device)
                s = torch.matmul(q[:, :, t0:t1], kn[:, :, k0:k1].transpose(-1, -2))
                s = s.masked_fill(kpos.view(1, -1) > qpos.view(-1, 1), float("-inf"))
                m[:, :, t0:t1], den[:, :, t0:t1], acc[:, :, t0:t1] = _online_step(
                    m[:, :, t0:t1], den[:, :, t0:t1], acc[:, :, t0:t1], s, vn[:, :, k0:k1]
                )
        o = acc / den.unsqueeze(-1)  # every query sees at least itself: den > 0
        out[start:end] = o.permute(2, 0, 1, 3).reshape(qlen, H, D).to(query.dtype)
        start = end
    if start != T:
        raise ValueError(f"query has {T} tokens, query_lens sum to {start}")
    return out
