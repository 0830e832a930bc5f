"""Paged attention (PyTorch path) vs its float64 references (CPU).

Runs on torch 2.1 (``.venv-v0``) and on the 0.32.0 line's torch alike: the ops are the
platform's attention until the CUDA kernels land.
"""

from __future__ import annotations

import math

import pytest
import torch
from native_util import rel_err

from vllm_overrides.native import paged_attention as pa
from vllm_overrides.native import paged_attention_reference as ref

FP32_TOL = 1e-5
HALF_TOL = 2e-2  # fp16 / bf16 inputs, float32 accumulation, one rounding of the output


def _cache(
    num_blocks: int, block_size: int, kv_heads: int, head: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv = torch.randn(pa.kv_cache_shape(num_blocks, block_size, kv_heads, head)).to(dtype)
    k, v = pa.split_kv_cache(kv)
    return kv, k, v


def _tables(lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Disjoint random physical blocks per sequence, padded with 0 like vLLM's tables."""
    need = [math.ceil(n / block_size) for n in lens]
    perm = torch.randperm(num_blocks)
    assert sum(need) <= num_blocks
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n]
        at += n
    return tables


def test_kv_cache_shape_holds_vllm_paged_allocation() -> None:
    # Same element count as vLLM 0.6.3's (2, blocks, block_size * kv_heads * head).
    shape = pa.kv_cache_shape(7, 16, 2, 256)
    assert shape == (2, 7, 2, 16, 256)
    assert math.prod(shape) == 2 * 7 * 16 * 2 * 256


def test_write_kv_by_slot_skips_padding() -> None:
    _, kc, vc = _cache(6, 16, 2, 256, torch.float16)
    slots = torch.tensor([5, -1, 17, 95, 40, -1, 0])
    key = torch.randn(7, 2, 256).half()
    value = torch.randn(7, 2, 256).half()
    want_k, want_v = ref.write_kv_reference(key, value, kc, vc, slots)
    pa.write_kv(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # slot 17 = block 1, offset 1: token 2's rows for every kv head, exactly
    assert torch.equal(kc[1, :, 1], key[2]) and torch.equal(vc[5, :, 15], value[3])


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (16, 2), (4, 1)])
def test_decode_many_blocks_gqa_head256(heads: int, kv_heads: int) -> None:
    bs, head = 16, 256
    lens = [1, 17, 700, 333]
    _, kc, vc = _cache(96, bs, kv_heads, head, torch.float32)
    tables = _tables(lens, bs, 96)
    q = torch.randn(len(lens), heads, head)
    scale = head**-0.5
    # small partitions and passes: several partitions per sequence, several gathers
    out = pa.decode_attention(
        q, kc, vc, tables, torch.tensor(lens), scale, partition_size=64, max_elems=1 << 18
    )
    want = ref.decode_attention_reference(q, kc, vc, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, want) <= FP32_TOL
    # a one-token sequence returns that token's value for every head of the group
    only = vc[tables[0, 0], :, 0].repeat_interleave(heads // kv_heads, dim=0)
    assert torch.allclose(out[0], only, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_inputs(dtype: torch.dtype) -> None:
    bs, head, heads, kv_heads = 16, 256, 8, 1
    lens = [300, 45]
    _, kc, vc = _cache(40, bs, kv_heads, head, dtype)
    tables = _tables(lens, bs, 40)
    q = torch.randn(2, heads, head).to(dtype)
    out = pa.decode_attention(q, kc, vc, tables, torch.tensor(lens), head**-0.5)
    assert out.dtype == dtype
    assert rel_err(out, ref.decode_attention_reference(q, kc, vc, tables, lens, head**-0.5)) <= (
        HALF_TOL
    )


def test_decode_split_combine_equals_one_partition() -> None:
    """The contract the CUDA kernel keeps: partials + one log-sum-exp merge == no split."""
    bs, head, heads, kv_heads = 16, 256, 8, 2
    lens = [1000, 64, 3]
    _, kc, vc = _cache(80, bs, kv_heads, head, torch.float32)
    tables = _tables(lens, bs, 80)
    q = torch.randn(3, heads, head) * 3  # sharp softmax: the merge's rescaling matters
    seq_lens = torch.tensor(lens)
    whole = pa.decode_attention(q, kc, vc, tables, seq_lens, 0.0625, partition_size=1024)
    m, den, acc = pa.decode_attention_partials(
        q, kc, vc, tables, seq_lens, 0.0625, partition_size=32
    )
    assert m.shape == (3, heads, 32) and acc.shape == (3, heads, 32, head)
    # partitions past a sequence's end saw no key
    assert torch.isinf(m[1, :, 2:]).all() and (den[1, :, 2:] == 0).all()
    split = pa.combine_partials(m, den, acc)
    assert rel_err(split, whole) <= 1e-6
    assert rel_err(whole, ref.decode_attention_reference(q, kc, vc, tables, lens, 0.0625)) <= (
        FP32_TOL
    )


def test_decode_long_context_bounded_gathers() -> None:
    """A context of thousands of tokens in gathers of a few partitions each (the 262,144-token
    case at CPU-test scale): same answer as the reference."""
    bs, head, heads, kv_heads = 16, 64, 4, 1
    lens = [6000]
    _, kc, vc = _cache(400, bs, kv_heads, head, torch.float32)
    tables = _tables(lens, bs, 400)
    q = torch.randn(1, heads, head)
    out = pa.decode_attention(
        q, kc, vc, tables, torch.tensor(lens), 0.125, max_seq_len=6000, max_elems=3 * 512 * head
    )
    assert rel_err(out, ref.decode_attention_reference(q, kc, vc, tables, lens, 0.125)) <= FP32_TOL


def _prefill_case(
    dtype: torch.dtype,
    query_lens: list[int],
    context_lens: list[int],
    heads: int = 8,
    kv_heads: int = 2,
    head: int = 256,
    bs: int = 16,
) -> tuple[torch.Tensor, ...]:
    lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, kc, vc = _cache(num_blocks, bs, kv_heads, head, dtype)
    tables = _tables(lens, bs, num_blocks)
    T = sum(query_lens)
    q = torch.randn(T, heads, head).to(dtype)
    k = torch.randn(T, kv_heads, head).to(dtype)
    v = torch.randn(T, kv_heads, head).to(dtype)
    return q, k, v, kc, vc, tables


def test_prefill_chunk_over_cached_context_varlen() -> None:
    query_lens = [37, 1, 64, 20]
    context_lens = [0, 90, 200, 16]
    q, k, v, kc, vc, tables = _prefill_case(torch.float32, query_lens, context_lens)
    scale = 256**-0.5
    # small key chunks and query tiles: context and chunk both cross several steps
    out = pa.prefill_attention(
        q, k, v, kc, vc, tables, query_lens, context_lens, scale, key_chunk=32, max_elems=8 * 32 * 9
    )
    want = ref.prefill_attention_reference(q, k, v, kc, vc, tables, query_lens, context_lens, scale)
    assert out.dtype == q.dtype
    assert rel_err(out, want) <= FP32_TOL
    # default tiling gives the same answer
    again = pa.prefill_attention(q, k, v, kc, vc, tables, query_lens, context_lens, scale)
    assert rel_err(again, want) <= FP32_TOL


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (16, 2)])
def test_prefill_gqa_causal_no_context(heads: int, kv_heads: int) -> None:
    query_lens, context_lens = [50, 9], [0, 0]
    q, k, v, _, _, _ = _prefill_case(torch.float32, query_lens, context_lens, heads, kv_heads)
    out = pa.prefill_attention(q, k, v, None, None, None, query_lens, context_lens, 0.07)
    want = ref.prefill_attention_reference(
        q, k, v, None, None, None, query_lens, context_lens, 0.07
    )
    assert rel_err(out, want) <= FP32_TOL
    # causal: the first token of each sequence is its own value
    group = heads // kv_heads
    assert torch.allclose(out[0], v[0].repeat_interleave(group, 0), atol=1e-6)
    assert torch.allclose(out[50], v[50].repeat_interleave(group, 0), atol=1e-6)
    # changing a later token's key must not change an earlier token's output
    k2 = k.clone()
    k2[30] += 5
    out2 = pa.prefill_attention(q, k2, v, None, None, None, query_lens, context_lens, 0.07)
    assert torch.equal(out2[:30], out[:30]) and not torch.equal(out2[30:50], out[30:50])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_inputs(dtype: torch.dtype) -> None:
    query_lens, context_lens = [24, 40], [48, 0]
    q, k, v, kc, vc, tables = _prefill_case(dtype, query_lens, context_lens)
    out = pa.prefill_attention(q, k, v, kc, vc, tables, query_lens, context_lens, 0.0625)
    want = ref.prefill_attention_reference(
        q, k, v, kc, vc, tables, query_lens, context_lens, 0.0625
    )
    assert out.dtype == dtype
    assert rel_err(out, want) <= HALF_TOL


def test_prefill_chunk_equals_decode_of_its_last_token() -> None:
    """Chunked prefill and decode agree: the last token of a chunk over a context, once the
    chunk is in the cache, is a decode over context + chunk."""
    query_lens, context_lens = [12], [100]
    q, k, v, kc, vc, tables = _prefill_case(torch.float32, query_lens, context_lens)
    out = pa.prefill_attention(q, k, v, kc, vc, tables, query_lens, context_lens, 0.1)
    bs = kc.shape[2]
    row = tables[0].long()
    slots = torch.stack([row[p // bs] * bs + p % bs for p in range(100, 112)])
    pa.write_kv(k, v, kc, vc, slots)
    dec = pa.decode_attention(q[-1:], kc, vc, tables, torch.tensor([112]), 0.1)
    # two float32 summation orders over 112 keys: ~1e-6 apart at most over many seeds
    assert rel_err(dec[0], out[-1]) <= FP32_TOL


def test_prefill_rejects_short_block_table() -> None:
    q, k, v, kc, vc, tables = _prefill_case(torch.float32, [4], [40])
    with pytest.raises(ValueError, match="block table covers"):
        pa.prefill_attention(q, k, v, kc, vc, tables[:, :2], [4], [40], 0.1)
