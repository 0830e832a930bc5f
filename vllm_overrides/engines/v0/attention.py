"""Our attention backend for vLLM 0.6.3 (V0): paged attention at any head size, GQA included.

Why it exists: on the card vLLM 0.6.3+corex picks XFORMERS (ixformer), whose flash attention
rejects head_dim > 128 (Qwen3.6's full attention has 256), and on the stand-in it picks
TORCH_SDPA, whose paged ops live in the missing ``vllm._C``. This backend computes attention
with :mod:`vllm_overrides.native.paged_attention` over a KV cache laid out by
:func:`~vllm_overrides.native.paged_attention.kv_cache_shape` (the module says why that
layout).

How vLLM reaches it: ``patches/vllm-0.6.3/0001-attention-selector-our-backend.patch`` makes
``vllm.attention.selector.get_attn_backend`` ask :func:`selected_backend` first. The metadata
is built by vLLM's own ``CommonMetadataBuilder`` (the GPU model runner's path: chunked prefill,
prefix caching, mixed prefill + decode batches); the builder subclass below only adds the
per-sequence lengths as Python lists so the per-layer ops need no host sync to read them.

Set ``VO_ATTENTION=vllm`` to get vLLM's own choice back (e.g. to compare against it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)
from vllm.attention.backends.utils import CommonAttentionState, CommonMetadataBuilder

from vllm_overrides.native import kernels
from vllm_overrides.native import paged_attention as pa

from . import prefix_cache

logger = logging.getLogger("vllm.vllm_overrides.attention")  # under vLLM's handlers

BACKEND_NAME = "VO_PAGED"
ENV_SWITCH = "VO_ATTENTION"


class VOPagedBackend(AttentionBackend):
    """Paged attention in our ops; the KV cache in our ``[2, blocks, kv, block, head]`` layout."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[VOPagedImpl]:
        return VOPagedImpl

    @staticmethod
    def get_metadata_cls() -> type[VOPagedMetadata]:
        return VOPagedMetadata

    @staticmethod
    def get_builder_cls() -> type[VOPagedMetadataBuilder]:
        return VOPagedMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[CommonAttentionState]:
        return CommonAttentionState

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return pa.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor
    ) -> None:
        """Copy whole blocks between devices (swap in / out): ``src_to_dst [N, 2]`` pairs."""
        if src_to_dst.numel() == 0:
            return
        pairs = src_to_dst.to(torch.long).view(-1, 2)
        src = pairs[:, 0].to(src_kv_cache.device)
        dst = pairs[:, 1].to(dst_kv_cache.device)
        # Keys and values together: dim 1 is the block index for both halves.
        dst_kv_cache[:, dst] = src_kv_cache[:, src].to(dst_kv_cache.device)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """Copy-on-write within the device cache (e.g. ``n = 2`` forks): ``[N, 2]`` pairs,
        applied to every layer."""
        if src_to_dists.numel() == 0:
            return
        pairs = src_to_dists.to(torch.long).view(-1, 2)
        for kv_cache in kv_caches:
            p = pairs.to(kv_cache.device)
            kv_cache[:, p[:, 1]] = kv_cache[:, p[:, 0]]


@dataclass
class VOPagedMetadata(AttentionMetadata):
    """vLLM's attention metadata (the fields ``CommonMetadataBuilder`` fills) plus the
    per-sequence lengths as Python lists.

    Token order: the ``num_prefill_tokens`` prefill tokens (sequence by sequence), then one
    token per decode sequence. Every field has a default because vLLM rebuilds the metadata on
    tensor-parallel workers from the non-``None`` fields only.
    """

    seq_lens: list[int] | None = None
    seq_lens_tensor: torch.Tensor | None = None
    max_query_len: int | None = None
    max_decode_query_len: int | None = None
    max_prefill_seq_len: int = 0
    max_decode_seq_len: int = 0
    query_start_loc: torch.Tensor | None = None
    seq_start_loc: torch.Tensor | None = None
    context_lens_tensor: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    use_cuda_graph: bool = False
    # Host copies of what the tensors above hold, batch order (prefills first); set by our
    # builder and broadcast to the other ranks with the rest, so no layer syncs to read them.
    context_lens: list[int] | None = None
    query_lens: list[int] | None = None
    # Hybrid prefix caching: one row per prefill chunk, [load slot, (offset, save slot) x 2]
    # (engines/v0/prefix_cache.py); None when the step loads and saves no GDN checkpoint.
    gdn_plan: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # Plain attributes, not dataclass fields: they must not travel in the broadcast dict.
        self._prefill: VOPagedMetadata | None = None
        self._decode: VOPagedMetadata | None = None

    @property
    def prefill_metadata(self) -> VOPagedMetadata | None:
        if self.num_prefills == 0:
            return None
        if self._prefill is None:
            n = self.num_prefills
            self._prefill = VOPagedMetadata(
                num_prefills=n,
                num_prefill_tokens=self.num_prefill_tokens,
                num_decode_tokens=0,
                slot_mapping=self.slot_mapping[: self.num_prefill_tokens],
                seq_lens=self.seq_lens[:n] if self.seq_lens is not None else None,
                seq_lens_tensor=_head(self.seq_lens_tensor, n),
                max_query_len=self.max_query_len,
                max_decode_query_len=0,
                max_prefill_seq_len=self.max_prefill_seq_len,
                max_decode_seq_len=0,
                query_start_loc=_head(self.query_start_loc, n + 1),
                seq_start_loc=_head(self.seq_start_loc, n + 1),
                context_lens_tensor=_head(self.context_lens_tensor, n),
                block_tables=_head(self.block_tables, n),
                use_cuda_graph=False,
                context_lens=self.context_lens[:n] if self.context_lens is not None else None,
                query_lens=self.query_lens[:n] if self.query_lens is not None else None,
            )
        return self._prefill

    @property
    def decode_metadata(self) -> VOPagedMetadata | None:
        if self.num_decode_tokens == 0:
            return None
        if self._decode is None:
            n = self.num_prefills
            self._decode = VOPagedMetadata(
                num_prefills=0,
                num_prefill_tokens=0,
                num_decode_tokens=self.num_decode_tokens,
                slot_mapping=self.slot_mapping[self.num_prefill_tokens :],
                seq_lens=self.seq_lens[n:] if self.seq_lens is not None else None,
                seq_lens_tensor=_tail(self.seq_lens_tensor, n),
                max_query_len=self.max_query_len,
                max_decode_query_len=self.max_decode_query_len,
                max_prefill_seq_len=0,
                max_decode_seq_len=self.max_decode_seq_len,
                query_start_loc=_tail(self.query_start_loc, n),
                seq_start_loc=_tail(self.seq_start_loc, n),
                context_lens_tensor=_tail(self.context_lens_tensor, n),
                block_tables=_tail(self.block_tables, n),
                use_cuda_graph=self.use_cuda_graph,
            )
        return self._decode

    def prefill_lens(self) -> tuple[list[int], list[int]]:
        """``(query_lens, context_lens)`` of the prefill sequences, as Python ints."""
        n = self.num_prefills
        if self.context_lens is not None:
            ctx = list(self.context_lens[:n])
        else:  # metadata made without our builder: one host sync
            assert self.context_lens_tensor is not None
            ctx = [int(c) for c in self.context_lens_tensor[:n].tolist()]
        if self.query_lens is not None:
            qry = list(self.query_lens[:n])
        elif self.seq_lens is not None:
            qry = [s - c for s, c in zip(self.seq_lens[:n], ctx, strict=True)]
        else:
            assert self.query_start_loc is not None
            qry = [int(q) for q in torch.diff(self.query_start_loc[: n + 1]).tolist()]
        return qry, ctx


def _head(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return t[:n] if t is not None else None


def _tail(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return t[n:] if t is not None else None


class VOPagedMetadataBuilder(CommonMetadataBuilder[VOPagedMetadata]):
    """vLLM's common builder; afterwards records the host-side lengths it already had."""

    _metadata_cls = VOPagedMetadata

    def _add_seq_group(self, inter_data: Any, chunked_prefill_enabled: bool) -> None:
        first = len(self.block_tables)
        super()._add_seq_group(inter_data, chunked_prefill_enabled)
        # vLLM 0.6.3 gives a prefix-cache hit only its computed blocks as block table. Under
        # chunked prefill a later chunk of the same prompt is still a "hit" (the computed list
        # is frozen at the first gap) while its context has grown past those blocks, so the
        # table would not cover the context. The sequence's full table covers every token;
        # our prefill reads only context_len tokens through it, so it is right in every case.
        if inter_data.prefix_cache_hit and inter_data.block_tables is not None:
            for j, seq_id in enumerate(inter_data.seq_ids):
                self.block_tables[first + j] = list(inter_data.block_tables[seq_id])

    def build(
        self, seq_lens: list[int], query_lens: list[int], cuda_graph_pad_size: int, batch_size: int
    ) -> VOPagedMetadata:
        meta = super().build(seq_lens, query_lens, cuda_graph_pad_size, batch_size)
        # self.context_lens is filled by super().build(), one entry per sequence, batch order.
        meta.context_lens = list(self.context_lens)
        meta.query_lens = list(query_lens)
        # The GDN checkpoint plan of the step (hybrid prefix caching; None for other models).
        meta.gdn_plan = prefix_cache.step_plan(
            getattr(self.runner, "cache_config", None), self.input_builder.inter_data_list
        )
        return meta


class VOPagedImpl(AttentionImpl[VOPagedMetadata]):
    """Writes the new keys / values into the paged cache, then attends: prefill tokens with
    :func:`~vllm_overrides.native.kernels.paged_prefill_attention`, decode tokens with
    :func:`~vllm_overrides.native.kernels.paged_decode_attention` -- our CUDA kernels where
    they load (``csrc/paged_attention.cu``), else the PyTorch ops of
    :mod:`~vllm_overrides.native.paged_attention` (the selector logs which)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        blocksparse_params: dict[str, Any] | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        unsupported = _unsupported(sliding_window, kv_cache_dtype)
        if alibi_slopes is not None:
            unsupported = unsupported or "ALiBi"
        if blocksparse_params is not None:
            unsupported = unsupported or "block-sparse attention"
        if logits_soft_cap is not None:
            unsupported = unsupported or "logits soft capping"
        if unsupported:
            raise ValueError(f"{BACKEND_NAME} attention does not support {unsupported}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
        self.kv_cache_dtype = kv_cache_dtype

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: VOPagedMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attn_type: AttentionType = AttentionType.DECODER,
    ) -> torch.Tensor:
        """``query [T, H*D]``, ``key`` / ``value [T, KV*D]`` -> ``[T, H*D]``.

        ``kv_cache`` is this layer's ``[2, blocks, kv, block, head]`` tensor, or an empty one
        in the profile run (then nothing is cached and prefills see only their own tokens).
        """
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} serves decoder self-attention only")
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        num_prefill = attn_metadata.num_prefill_tokens
        num_decode = attn_metadata.num_decode_tokens
        assert q.shape[0] == num_prefill + num_decode, (q.shape, num_prefill, num_decode)

        has_cache = kv_cache is not None and kv_cache.numel() > 0
        key_cache = value_cache = None
        if has_cache:
            key_cache, value_cache = pa.split_kv_cache(kv_cache)
            kernels.paged_write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping)

        out = torch.empty_like(q)
        prefill = attn_metadata.prefill_metadata
        if prefill is not None:
            query_lens, context_lens = prefill.prefill_lens()
            out[:num_prefill] = kernels.paged_prefill_attention(
                q[:num_prefill],
                k[:num_prefill],
                v[:num_prefill],
                key_cache,
                value_cache,
                prefill.block_tables if has_cache else None,
                query_lens,
                context_lens,
                self.scale,
                query_start_loc=prefill.query_start_loc,
                context_lens_tensor=prefill.context_lens_tensor,
            )
        decode = attn_metadata.decode_metadata
        if decode is not None:
            if key_cache is None or value_cache is None:
                raise RuntimeError(f"{BACKEND_NAME}: decode tokens but no KV cache")
            assert decode.block_tables is not None and decode.seq_lens_tensor is not None
            dec = kernels.paged_decode_attention(
                q[num_prefill:],
                key_cache,
                value_cache,
                decode.block_tables,
                decode.seq_lens_tensor,
                self.scale,
                max_seq_len=decode.max_decode_seq_len or None,
            )
            if num_prefill == 0:  # a decode-only step: the op's output is the layer's, no copy
                return dec.view(-1, self.num_heads * self.head_size)
            out[num_prefill:] = dec
        return out.view(-1, self.num_heads * self.head_size)


def _unsupported(sliding_window: int | None, kv_cache_dtype: str | None) -> str | None:
    """Why our backend cannot serve this configuration, or ``None`` if it can."""
    if sliding_window is not None:
        return f"a sliding window ({sliding_window})"
    if kv_cache_dtype not in (None, "auto"):
        return f"kv cache dtype {kv_cache_dtype!r}"
    return None


def selected_backend(
    head_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    kv_cache_dtype: str | None,
    block_size: int,
    is_attention_free: bool,
    is_blocksparse: bool = False,
) -> type[AttentionBackend] | None:
    """The backend ``get_attn_backend`` returns, or ``None`` to let vLLM choose (logged).

    Ours serves every decoder-attention configuration it supports; vLLM chooses when
    ``VO_ATTENTION=vllm``, for attention-free models (its placeholder), block-sparse
    attention, a sliding window or a quantised KV cache.
    """
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch not in ("", "ours", "vllm"):
        raise ValueError(f"{ENV_SWITCH}={switch!r}: expected 'ours' or 'vllm'")
    if switch == "vllm":
        logger.info("%s=vllm: attention backend chosen by vLLM", ENV_SWITCH)
        return None
    if is_attention_free:
        return None
    reason = "block-sparse attention" if is_blocksparse else None
    reason = reason or _unsupported(sliding_window, kv_cache_dtype)
    if reason:
        logger.warning(
            "%s attention does not support %s: attention backend chosen by vLLM",
            BACKEND_NAME,
            reason,
        )
        return None
    logger.info(
        "Using %s attention backend (vllm_overrides, head_size %d, %s, block_size %d)",
        BACKEND_NAME,
        head_size,
        dtype,
        block_size,
    )
    return VOPagedBackend
