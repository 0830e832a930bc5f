"""Naive float64 references for :mod:`vllm_overrides.native.paged_attention` (tests only).

Straight from the definitions, one sequence and one query head at a time; the cache layout is
the one :mod:`.paged_attention` documents (``[num_blocks, kv_heads, block_size, head_size]``
for keys and for values). Token ``t`` of a sequence lives in physical block
``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "decode_attention_reference",
    "gather_sequence_kv_reference",
    "prefill_attention_reference",
    "write_kv_reference",
]


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with token ``i``'s ``[kv_heads, head]`` rows stored at
    ``slot_mapping[i]`` (block ``slot // block_size``, offset ``slot % block_size``); a
    negative slot (vLLM's padding) is skipped."""
    kc, vc = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kc[slot // block_size, :, slot % block_size, :] = key[i]
        vc[slot // block_size, :, slot % block_size, :] = value[i]
    return kc, vc


def gather_sequence_kv_reference(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: Sequence[int], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` tokens of one sequence, ``([length, kv_heads, head] x 2)`` float64."""
    block_size = key_cache.shape[2]
    ks, vs = [], []
    for t in range(length):
        blk, off = block_table[t // block_size], t % block_size
        ks.append(key_cache[blk, :, off, :].double())
        vs.append(value_cache[blk, :, off, :].double())
    kv_heads, head = key_cache.shape[1], key_cache.shape[3]
    if not ks:
        empty = torch.zeros(0, kv_heads, head, dtype=torch.float64)
        return empty, empty.clone()
    return torch.stack(ks), torch.stack(vs)


def _attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(scale * q . k_j) weighted sum of v_j for one head: q [D], keys/values [n, D]."""
    s = (keys @ q) * scale
    p = torch.exp(s - s.max())
    return (p[:, None] * values).sum(0) / p.sum()


def decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its ``seq_lens[b]`` cached tokens.

    Query head ``h`` reads kv head ``h // (H // kv_heads)`` (vLLM's GQA grouping).

    Returns:
        ``[B, H, D]`` float64.
    """
    B, H, D = query.shape
    group = H // key_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        keys, values = gather_sequence_kv_reference(
            key_cache, value_cache, block_tables[b].tolist(), int(seq_lens[b])
        )
        for h in range(H):
            out[b, h] = _attend_one(
                query[b, h].double(), keys[:, h // group], values[:, h // group], scale
            )
    return out


def prefill_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """A chunk of new tokens per sequence over its cached context.

    Sequence ``i`` owns ``query_lens[i]`` consecutive rows of ``query`` / ``key`` / ``value``
    (token order), and has ``context_lens[i]`` earlier tokens in the cache. New token ``j``
    (absolute position ``context_len + j``) sees every cached token and new tokens ``0..j``.

    Returns:
        ``[T, H, D]`` float64.
    """
    T, H, D = query.shape
    kv_heads = key.shape[1]
    group = H // kv_heads
    out = torch.zeros(T, H, D, dtype=torch.float64)
    start = 0
    for i, (qlen, clen) in enumerate(zip(query_lens, context_lens, strict=True)):
        if clen > 0:
            assert key_cache is not None and value_cache is not None and block_tables is not None
            ck, cv = gather_sequence_kv_reference(
                key_cache, value_cache, block_tables[i].tolist(), int(clen)
            )
        else:
            ck = cv = torch.zeros(0, kv_heads, D, dtype=torch.float64)
        for j in range(qlen):
            keys = torch.cat([ck, key[start : start + j + 1].double()])
            values = torch.cat([cv, value[start : start + j + 1].double()])
            for h in range(H):
                out[start + j, h] = _attend_one(
                    query[start + j, h].double(), keys[:, h // group], values[:, h // group], scale
                )
        start += qlen
    return out
