"""Qwen3.5 / Qwen3.6 MoE (``qwen3_5_moe``) for vLLM 0.6.3's V0 engine: text and images.

Images: :mod:`.qwen3_5_mm` processes them at admission and lays out each step's image rows and
3-D positions (patch 0020); :mod:`.qwen3_5_vision` is the tower, replicated on every TP rank;
the model writes the tower's rows over the image tokens' embeddings.

Our own model class on vLLM 0.6.3's building blocks (parallel linear layers, vocab-parallel
embedding and LM head, the ``Attention`` layer, logits processor and sampler) and on our native
ops (:mod:`vllm_overrides.native.kernels`: fused kernels where the extension serves the device,
else the plain PyTorch ops), because the vendor's stack has neither Triton nor MoE ops and its
attention rejects head_dim 256.

Layers (``text_config.layer_types``):

* ``linear_attention`` -- Gated DeltaNet: one merged input projection ``[q|k|v|z|b|a]``
  (checkpoint ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``), causal conv1d
  (kernel 4, SiLU) over ``q|k|v`` with a conv state, the gated delta rule (chunked for prefill
  chunks, recurrent for decode) with a recurrent state, the per-head gated RMSNorm with ``z``
  and ``out_proj``. States live in :class:`.gdn_state.GDNStateCache`, one slot per sequence.
* ``full_attention`` -- gated attention: ``q_proj`` gives ``[q | gate]`` per head, q/k get
  Qwen's ``(1 + w)`` RMSNorm and partial NeoX RoPE (rotary_dim = 0.25 * head_dim; interleaved
  MRoPE when the runner passes ``[3, T]`` positions), paged attention through vLLM's
  ``Attention`` layer (whatever backend the platform selects), output ``* sigmoid(gate)``,
  ``o_proj``.
* every layer: ``(1 + w)`` RMSNorms around the mixer and a sparse MoE block (softmax router,
  top-k renormalised, experts ``[E, 2I, H]``/``[E, H, I]``, sigmoid-gated shared expert).

Batch layout (V0): the step's prefill chunks first (one contiguous run of tokens each), then
one token per decoding sequence; ``request_ids_to_seq_ids`` lists the sequences in that order.
A prefill chunk whose context length is 0 starts from zero states; a later chunk of the same
prompt continues from its slot, so a chunked prefill gives the one-shot result. With prefix
caching a prompt may start at a cached block boundary: its slot then gets the GDN checkpoint
saved there first (:mod:`.prefix_cache` plans loads and saves; the plan rides in the attention
metadata, so every TP rank applies the same one).

Tensor parallel: attention heads, GDN key/value heads and expert/shared intermediate sizes are
split over ranks by vLLM's column/row parallel layers (KV heads replicated where TP exceeds
them); the MoE block's partial sums are all-reduced once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.attention import Attention, AttentionMetadata
from vllm.config import CacheConfig, SchedulerConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.inputs import INPUT_REGISTRY
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.sampler import Sampler, SamplerOutput
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, SupportsMultiModal
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.model_executor.utils import set_weight_attrs
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.sequence import IntermediateTensors

from vllm_overrides.native import kernels

from . import prefix_cache
from .gdn_state import GDNStateCache, chunk_rule_with_cuts, conv_window
from .qwen3_5_mm import (
    MM_KEYS,
    dummy_data,
    image_input_mapper,
    input_processor,
    max_image_tokens,
    per_group,
)
from .qwen3_5_vision import Qwen3_5VisionTransformer

logger = logging.getLogger(__name__)

# Tokens up to which the MoE block takes the decode path (experts read per token) instead of
# the grouped prefill path; the fused decode kernels take at most 64 rows.
MOE_DECODE_MAX_TOKENS = 8


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", config)


# --------------------------------------------------------------------------------------------
# The step's batch layout, shared by every GDN layer of one forward
# --------------------------------------------------------------------------------------------


@dataclass
class GDNBatch:
    """Where each sequence's tokens and state slot are in this step.

    Attributes:
        num_prefills: prefill chunks (first in the batch).
        num_prefill_tokens: their tokens.
        num_decodes: decoding sequences (one token each, after the prefill tokens).
        prefill_qsl: ``[num_prefills + 1]`` cumulative token offsets of the chunks.
        prefill_has_init: ``[num_prefills]`` whether a chunk continues a prompt (context > 0).
        prefill_slots, decode_slots: state slots in batch order.
        cuts: per prefill chunk, ``(offset into its query, checkpoint pool slot)`` where its
            GDN states are saved (hybrid prefix caching); None when no chunk saves any.
        prefill_qsl_host: ``prefill_qsl`` as Python ints (only with ``cuts``).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    prefill_qsl: torch.Tensor
    prefill_has_init: torch.Tensor
    prefill_slots: torch.Tensor
    decode_slots: torch.Tensor
    cuts: list[list[tuple[int, int]]] | None = None
    prefill_qsl_host: list[int] | None = None


def _prefill_layout(
    attn_metadata: AttentionMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_start_loc [P+1], context_lens [P])`` of the step's prefill chunks.

    The GPU runner's metadata (``CommonMetadataBuilder``) carries ``query_start_loc`` and
    ``context_lens_tensor`` for every sequence (prefills first); metadata without them (a
    backend that does no chunked prefill) means every prefill is a whole prompt:
    query length = ``seq_lens`` and no context.
    """
    P = attn_metadata.num_prefills
    qsl = getattr(attn_metadata, "query_start_loc", None)
    ctx = getattr(attn_metadata, "context_lens_tensor", None)
    if qsl is not None and ctx is not None:
        return qsl[: P + 1].to(device, torch.long), ctx[:P].to(device, torch.long)
    seq_lens = attn_metadata.seq_lens[:P]  # type: ignore[attr-defined]
    lens = torch.tensor([0, *seq_lens], dtype=torch.long, device=device)
    return lens.cumsum(0), torch.zeros(P, dtype=torch.long, device=device)


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------


class QwenRMSNorm(nn.Module):
    """Qwen3.5's ``(1 + w)`` RMSNorm (checkpoint weight centred on 0), optionally with the
    residual add fused (returns ``(out, new_residual)`` then)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.gemma_rms_norm(x, self.weight, self.eps, residual)


# --------------------------------------------------------------------------------------------
# Weight loaders for the parameters vLLM's layers do not cover
# --------------------------------------------------------------------------------------------


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/tp of ``t`` along ``dim``."""
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size)


def _head_sharded_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(_shard(loaded, 0).to(param.dtype))


# --------------------------------------------------------------------------------------------
# Gated DeltaNet
# --------------------------------------------------------------------------------------------


class Qwen3_5GatedDeltaNet(nn.Module):
    """One ``linear_attention`` layer (states passed in per call)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.H_total = config.linear_num_key_heads
        self.HV_total = config.linear_num_value_heads
        if self.H_total % tp or self.HV_total % tp:
            raise ValueError(
                f"GDN heads ({self.H_total} key, {self.HV_total} value) do not split over TP {tp}"
            )
        self.H = self.H_total // tp
        self.HV = self.HV_total // tp
        self.K = config.linear_key_head_dim
        self.V = config.linear_value_head_dim
        self.W = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        key_dim = self.H_total * self.K
        value_dim = self.HV_total * self.V
        # Per rank: conv channels [q | k | v].
        self.conv_dim = (2 * self.H * self.K) + self.HV * self.V
        # One GEMM for all six input projections: [q | k | v | z | b | a].
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [key_dim, key_dim, value_dim, value_dim, self.HV_total, self.HV_total],
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj",
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, self.W))
        set_weight_attrs(self.conv1d.weight, {"weight_loader": self._load_conv})
        # Gate parameters stay float32: A_log goes through exp() every step.
        self.A_log = nn.Parameter(torch.empty(self.HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.HV, dtype=torch.float32))
        for p in (self.A_log, self.dt_bias):
            set_weight_attrs(p, {"weight_loader": _head_sharded_loader})
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.V))
        self.out_proj = RowParallelLinear(
            value_dim,
            config.hidden_size,
            bias=False,
            input_is_parallel=True,
            reduce_results=True,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )

    def _load_conv(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Checkpoint ``[D, 1, W]`` with channels ``[q | k | v]``: each part split by rank."""
        w = loaded.reshape(loaded.shape[0], -1)
        kd = self.H_total * self.K
        q, k, v = w.split([kd, kd, w.shape[0] - 2 * kd], dim=0)
        param.data.copy_(torch.cat([_shard(q, 0), _shard(k, 0), _shard(v, 0)]).to(param.dtype))

    def load_in_proj(self, part: str, loaded: torch.Tensor) -> None:
        """Checkpoint ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` into the
        merged projection's shards 0-2 / 3 / 4 / 5."""
        param = self.in_proj.weight
        loader = param.weight_loader  # type: ignore[attr-defined]
        if part == "qkv":
            kd = self.H_total * self.K
            for i, t in enumerate(loaded.split([kd, kd, loaded.shape[0] - 2 * kd], dim=0)):
                loader(param, t, i)
        else:
            loader(param, loaded, {"z": 3, "b": 4, "a": 5}[part])

    def forward(
        self,
        x: torch.Tensor,
        batch: GDNBatch,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        T = x.shape[0]
        HV, V = self.HV, self.V
        proj, _ = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, HV * V, HV, HV], dim=-1)
        z = z.reshape(T, HV, V)
        core = torch.empty(T, HV, V, dtype=x.dtype, device=x.device)
        Pt = batch.num_prefill_tokens
        if batch.num_prefills > 0:
            saving = batch.cuts is not None and checkpoints is not None
            if saving:
                # The conv history before each chunk (read before the prep overwrites it): a
                # checkpoint less than W-1 tokens into a chunk takes part of its window there.
                init_conv = conv_state.index_select(0, batch.prefill_slots)
                keep = batch.prefill_has_init.view(-1, 1, 1)
                init_conv = torch.where(keep, init_conv, torch.zeros_like(init_conv))
            q, k, v, g, beta = kernels.gdn_conv_prep(
                mixed[:Pt], self.conv1d.weight, None, conv_state, batch.prefill_qsl,
                batch.prefill_slots, batch.prefill_has_init, "silu", a[:Pt], b[:Pt],
                self.A_log, self.dt_bias, self.H, self.K, self.V,
            )  # fmt: skip
            h0 = ssm_state.index_select(0, batch.prefill_slots)
            h0 = torch.where(batch.prefill_has_init.view(-1, 1, 1, 1), h0, torch.zeros_like(h0))
            if saving:
                assert batch.cuts is not None and checkpoints is not None
                assert batch.prefill_qsl_host is not None
                o, final = self._prefill_with_checkpoints(
                    q, k, v, g, beta, h0, mixed[:Pt], init_conv, batch.prefill_qsl_host,
                    batch.cuts, checkpoints,
                )  # fmt: skip
            else:
                o, final = kernels.chunk_gated_delta_rule(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                    beta.unsqueeze(0), initial_state=h0, output_final_state=True,
                    cu_seqlens=batch.prefill_qsl, use_qk_l2norm_in_kernel=False,
                )  # fmt: skip
            assert final is not None
            ssm_state.index_copy_(0, batch.prefill_slots, final.to(ssm_state.dtype))
            core[:Pt] = kernels.rms_norm_gated(o[0].to(x.dtype), z[:Pt], self.norm.weight, self.eps)
        if batch.num_decodes > 0:
            n = Pt + batch.num_decodes
            kernels.gdn_decode(
                mixed[Pt:n], a[Pt:n], b[Pt:n], conv_state, self.conv1d.weight, None,
                self.A_log, self.dt_bias, ssm_state, core[Pt:n], batch.decode_slots,
                self.H, self.K**-0.5, "silu", z=z[Pt:n], norm_weight=self.norm.weight,
                norm_eps=self.eps,
            )  # fmt: skip
        out, _ = self.out_proj(core.reshape(T, HV * V))
        return out

    @staticmethod
    def _prefill_with_checkpoints(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        h0: torch.Tensor,
        raw_x: torch.Tensor,
        init_conv: torch.Tensor,
        qsl: list[int],
        cuts: list[list[tuple[int, int]]],
        checkpoints: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill rule in segments ending at the planned cuts; writes the conv and
        recurrent states there into the checkpoint pool."""
        ck_conv, ck_ssm = checkpoints
        o, final, at_cut = chunk_rule_with_cuts(
            kernels.chunk_gated_delta_rule, q, k, v, g, beta, h0, qsl,
            [[off for off, _ in row] for row in cuts],
        )  # fmt: skip
        for r, row in enumerate(cuts):
            for off, slot in row:
                ck_ssm[slot].copy_(at_cut[(r, off)].to(ck_ssm.dtype))
                ck_conv[slot].copy_(conv_window(raw_x, init_conv[r], qsl[r], off))
        return o, final


# --------------------------------------------------------------------------------------------
# Gated full attention
# --------------------------------------------------------------------------------------------


def rope_cos_sin_cache(
    rotary_dim: int, theta: float, max_positions: int, device: torch.device | None = None
) -> torch.Tensor:
    """``[max_positions, rotary_dim]`` packed ``[cos | sin]`` of NeoX RoPE, float32 (the
    inverse frequencies and products in the order transformers computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = t[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


class Qwen3_5Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.D = config.head_dim
        total_heads = config.num_attention_heads
        total_kv = config.num_key_value_heads
        if total_heads % tp:
            raise ValueError(f"{total_heads} attention heads do not split over TP {tp}")
        self.nh = total_heads // tp
        self.nkv = max(1, total_kv // tp)
        self.eps = config.rms_norm_eps
        self.rotary_dim = int(self.D * config.partial_rotary_factor)
        self.mrope_section = config.mrope_section
        # q_proj rows are [q | gate] per head: as 2 * heads "heads" of head_dim, the usual QKV
        # sharding gives each rank its heads with their gates.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.D,
            2 * total_heads,
            total_kv,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.zeros(self.D))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.zeros(self.D))
        self.o_proj = RowParallelLinear(
            total_heads * self.D,
            config.hidden_size,
            bias=config.attention_bias,
            input_is_parallel=True,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.attn = Attention(
            self.nh,
            self.D,
            self.D**-0.5,
            num_kv_heads=self.nkv,
            cache_config=cache_config,
            quant_config=quant_config,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        qd, kvd = 2 * self.nh * self.D, self.nkv * self.D
        q_gate, k, v = qkv.split([qd, kvd, kvd], dim=-1)
        q, k, gate = kernels.qk_norm_rope_gate(
            q_gate, k, self.q_norm.weight, self.k_norm.weight, cos_sin_cache, positions,
            self.eps, self.nh, self.nkv, self.D, self.rotary_dim,
            self.mrope_section if positions.dim() == 2 else None,
        )  # fmt: skip
        o = self.attn(q, k, v.contiguous(), kv_cache, attn_metadata)
        o = o * torch.sigmoid(gate)
        out, _ = self.o_proj(o)
        return out


# --------------------------------------------------------------------------------------------
# Sparse MoE block
# --------------------------------------------------------------------------------------------


class Qwen3_5SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, quant_config=quant_config
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=False, quant_config=quant_config, reduce_results=False
        )


class Qwen3_5SparseMoe(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.tp = tp
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if inter % tp:
            raise ValueError(f"moe_intermediate_size {inter} does not split over TP {tp}")
        self.num_experts = E
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.inter = inter // tp
        self.gate = ReplicatedLinear(H, E, bias=False, quant_config=None)
        self.experts = nn.Module()
        # vLLM's fused-MoE layouts (what the native ops read in place): w13 = [gate; up].
        self.experts.w13_weight = nn.Parameter(torch.empty(E, 2 * self.inter, H))
        self.experts.w2_weight = nn.Parameter(torch.empty(E, H, self.inter))
        self.shared_expert = Qwen3_5SharedExpert(
            H, config.shared_expert_intermediate_size, quant_config
        )
        self.shared_expert_gate = ReplicatedLinear(H, 1, bias=False, quant_config=None)

    def load_experts(self, kind: str, loaded: torch.Tensor, expert: int | None) -> None:
        """Checkpoint expert weights, fused (``experts.gate_up_proj [E, 2I, H]``,
        ``experts.down_proj [E, H, I]``) or per expert (``experts.{e}.gate_proj`` /
        ``up_proj`` ``[I, H]``, ``down_proj [H, I]``); the intermediate dim split by rank."""
        w13, w2, n = self.experts.w13_weight.data, self.experts.w2_weight.data, self.inter
        if kind == "gate_up":  # fused [E, 2I, H]
            gate, up = loaded.chunk(2, dim=1)
            w13[:, :n].copy_(_shard(gate, 1))
            w13[:, n:].copy_(_shard(up, 1))
        elif kind == "down" and expert is None:  # fused [E, H, I]
            w2.copy_(_shard(loaded, 2))
        elif kind == "gate":
            w13[expert, :n].copy_(_shard(loaded, 0))
        elif kind == "up":
            w13[expert, n:].copy_(_shard(loaded, 0))
        elif kind == "down":
            w2[expert].copy_(_shard(loaded, 1))
        else:
            raise ValueError(f"unknown expert weight {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, _ = self.gate(x)
        shared = (
            self.shared_expert.gate_up_proj.weight,
            self.shared_expert.down_proj.weight,
            self.shared_expert_gate.weight,
        )
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight
        if x.shape[0] <= MOE_DECODE_MAX_TOKENS:
            out = kernels.moe_decode_routed(
                x, logits, self.top_k, self.renormalize, w13, w2, shared
            )
        else:
            out = kernels.moe_prefill(x, logits, self.top_k, self.renormalize, w13, w2, shared)
        if self.tp > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


# --------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_type: str,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(config, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = Qwen3_5Attention(
                config, cache_config, quant_config, f"{prefix}.self_attn"
            )
        self.mlp = Qwen3_5SparseMoe(config, quant_config)
        self.input_layernorm = QwenRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = QwenRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3_5TextModel(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, t, cache_config, quant_config, f"model.layers.{i}")
            for i, t in enumerate(config.layer_types)
        )
        self.norm = QwenRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self._cos_sin: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            self._cos_sin = rope_cos_sin_cache(
                self.rotary_dim,
                self.config.rope_theta,
                self.config.max_position_embeddings,
                device,
            )
        return self._cos_sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        batch: GDNBatch,
        states: GDNStateCache,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        cos_sin = self.cos_sin_cache(x.device)
        n_attn = n_gdn = 0
        for layer in self.layers:
            if residual is None:
                residual = x
                x = layer.input_layernorm(x)
            else:
                x, residual = layer.input_layernorm(x, residual)
            if layer.layer_type == "linear_attention":
                conv, ssm = states.layer(n_gdn)
                x = layer.linear_attn(x, batch, conv, ssm, states.checkpoints(n_gdn))
                n_gdn += 1
            else:
                # V0 allocates KV only for the attention layers (layers_block_type), in order.
                kv = kv_caches[n_attn] if kv_caches else None
                x = layer.self_attn(positions, x, kv, attn_metadata, cos_sin)
                n_attn += 1
            x, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(x)
        x, _ = self.norm(x, residual)
        return x


@MULTIMODAL_REGISTRY.register_image_input_mapper(image_input_mapper)
@MULTIMODAL_REGISTRY.register_max_image_tokens(max_image_tokens)
@INPUT_REGISTRY.register_dummy_data(dummy_data)
@INPUT_REGISTRY.register_input_processor(input_processor)
class Qwen3_5MoeForConditionalGeneration(nn.Module, HasInnerState, SupportsMultiModal):
    """``Qwen3_5MoeForConditionalGeneration`` checkpoints on V0: text and images
    (:mod:`.qwen3_5_mm` lays a step's images out; :mod:`.qwen3_5_vision` encodes them)."""

    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        multimodal_config: Any = None,
    ) -> None:
        super().__init__()
        self.multimodal_config = multimodal_config
        # Hybrid prefix caching: a hit resumes only where a GDN state checkpoint exists. The
        # registry goes onto the engine's CacheConfig, which the scheduler (built after the
        # model) and the driver worker share; every rank allocates the same pool.
        self._checkpoints = prefix_cache.attach(
            cache_config, getattr(config, "_name_or_path", None) or None, config
        )
        self.config = config
        text = _text_config(config)
        self.text_config = text
        self.scheduler_config = scheduler_config
        self.model = Qwen3_5TextModel(text, cache_config, quant_config)
        vision = getattr(config, "vision_config", None)
        # Replicated on every TP rank (see qwen3_5_vision); absent for a text-only config.
        self.visual = Qwen3_5VisionTransformer(vision) if vision is not None else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        if getattr(text, "tie_word_embeddings", False) or getattr(
            config, "tie_word_embeddings", False
        ):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.sampler = Sampler()
        self.states: GDNStateCache | None = None
        self._gdn_layers = [
            layer.linear_attn
            for layer in self.model.layers
            if layer.layer_type == "linear_attention"
        ]

    # ---- GDN state ----------------------------------------------------------------------

    def _state_cache(self, device: torch.device, dtype: torch.dtype) -> GDNStateCache:
        if self.states is None:
            g = self._gdn_layers[0] if self._gdn_layers else None
            max_seqs = self.scheduler_config.max_num_seqs if self.scheduler_config else 256
            self.states = GDNStateCache(
                num_layers=len(self._gdn_layers),
                conv_shape=(g.conv_dim, g.W - 1) if g else (0, 0),
                ssm_shape=(g.HV, g.V, g.K) if g else (0, 0, 0),
                conv_dtype=dtype,
                ssm_dtype=torch.float32,
                device=device,
                max_seqs=max_seqs,
                checkpoints=self._checkpoints,
            )
        return self.states

    def _batch(
        self,
        attn_metadata: AttentionMetadata,
        states: GDNStateCache,
        device: torch.device,
        kwargs: dict[str, Any],
    ) -> GDNBatch:
        req_to_seqs = kwargs.get("request_ids_to_seq_ids")
        if req_to_seqs is None:
            raise RuntimeError(
                "Qwen3.5/3.6 needs the V0 GPU model runner's request_ids_to_seq_ids to keep "
                "its GDN states; this worker does not pass them"
            )
        finished = kwargs.get("finished_requests_ids") or []
        slots = states.prepare(req_to_seqs, finished)
        P = attn_metadata.num_prefills
        D = attn_metadata.num_decode_tokens
        if slots.numel() != P + D:
            raise RuntimeError(
                f"batch has {P} prefills + {D} decode tokens but {slots.numel()} sequences"
            )
        qsl, ctx = _prefill_layout(attn_metadata, device)
        batch = GDNBatch(
            num_prefills=P,
            num_prefill_tokens=attn_metadata.num_prefill_tokens,
            num_decodes=D,
            prefill_qsl=qsl,
            prefill_has_init=ctx > 0,
            prefill_slots=slots[:P],
            decode_slots=slots[P:],
        )
        plan = getattr(attn_metadata, "gdn_plan", None)
        if plan:
            self._apply_plan(plan, batch, states)
        return batch

    @staticmethod
    def _apply_plan(plan: list[list[int]], batch: GDNBatch, states: GDNStateCache) -> None:
        """The step's checkpoint plan (:mod:`.prefix_cache`, one row per prefill chunk): load
        the resumed chunks' checkpoints into their slots now, and note where to save."""
        if len(plan) != batch.num_prefills:
            raise RuntimeError(
                f"GDN checkpoint plan has {len(plan)} rows for {batch.num_prefills} prefills"
            )
        if not states.ck_conv:
            raise RuntimeError("GDN checkpoint plan for a model without a checkpoint pool")
        loads = [(row[0], i) for i, row in enumerate(plan) if row[0] >= 0]
        if loads:
            dev = batch.prefill_slots.device
            pool = torch.tensor([p for p, _ in loads], dtype=torch.long, device=dev)
            rows = torch.tensor([i for _, i in loads], dtype=torch.long, device=dev)
            states.load(pool, batch.prefill_slots.index_select(0, rows))
        cuts = [
            [(row[j], row[j + 1]) for j in range(1, len(row) - 1, 2) if row[j] > 0] for row in plan
        ]
        if any(cuts):
            batch.cuts = cuts
            batch.prefill_qsl_host = [int(x) for x in batch.prefill_qsl.tolist()]

    def copy_inputs_before_cuda_graphs(self, input_buffers: Any, **kwargs: Any) -> None:
        raise NotImplementedError("Qwen3.5/3.6 on V0 runs eager (enforce_eager=True)")

    def get_seqlen_agnostic_capture_inputs(self, batch_size: int) -> Any:
        raise NotImplementedError("Qwen3.5/3.6 on V0 runs eager (enforce_eager=True)")

    # ---- forward / logits / sampling ----------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        dtype = self.model.embed_tokens.weight.dtype
        states = self._state_cache(input_ids.device, dtype)
        batch = self._batch(attn_metadata, states, input_ids.device, kwargs)
        inputs_embeds = self._embed_with_images(input_ids, kwargs)
        return self.model(
            input_ids, positions, kv_caches, attn_metadata, batch, states, inputs_embeds
        )

    def _embed_with_images(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """Token embeddings with this step's image tokens replaced by the vision tower's rows
        (None when the step has no image tokens). Per sequence group, ``image_rows`` picks
        rows of its encoded images and ``image_token_index`` says where in the batch they go
        (``qwen3_5_mm.compute_multi_modal_input``)."""
        if kwargs.get("pixel_values") is None:
            return None
        if self.visual is None:
            raise RuntimeError("image inputs for a model without a vision tower")
        groups = zip(*(per_group(kwargs[k]) for k in MM_KEYS), strict=True)
        x = self.model.embed_tokens(input_ids)
        for pixel_values, grid, rows, index in groups:
            embeds = self.visual(pixel_values, grid.tolist())
            x[index.to(x.device)] = embeds[rows.to(x.device)].to(x.dtype)
        return x

    def compute_logits(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states, sampling_metadata)

    def sample(
        self, logits: torch.Tensor | None, sampling_metadata: SamplingMetadata
    ) -> SamplerOutput | None:
        return self.sampler(logits, sampling_metadata)

    # ---- weights ------------------------------------------------------------------------

    _STACKED = (
        # (our param, checkpoint name, shard id)
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        layers = self.model.layers
        skipped: set[str] = set()
        for ckpt_name, w in weights:
            name = ckpt_name
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            elif name.startswith(("model.visual.", "visual.")):
                if self.visual is None:
                    skipped.add("visual")
                    continue
                # The tower's modules carry the checkpoint's names (plain copies: replicated).
                name = name[len("model.") :] if name.startswith("model.") else name
                self.visual.get_parameter(name[len("visual.") :]).data.copy_(w)
                continue
            elif name.startswith("mtp."):
                skipped.add("mtp")
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            parts = name.split(".")
            # model.layers.{i}.linear_attn.in_proj_{qkv,z,b,a}.weight
            if ".linear_attn.in_proj_" in name:
                layers[int(parts[2])].linear_attn.load_in_proj(parts[4][len("in_proj_") :], w)
                continue
            # model.layers.{i}.mlp.experts.{gate_up_proj,down_proj} (fused) or
            # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight (per expert)
            if ".mlp.experts." in name:
                moe = layers[int(parts[2])].mlp
                if parts[5].isdigit():
                    moe.load_experts(parts[6][: -len("_proj")], w, int(parts[5]))
                else:
                    moe.load_experts(parts[5][: -len("_proj")], w, None)
                continue
            for ours, theirs, shard in self._STACKED:
                if f".{theirs}." not in name:
                    continue
                target = name.replace(f".{theirs}.", f".{ours}.")
                param = params[target]
                param.weight_loader(param, w, shard)  # type: ignore[attr-defined]
                break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint weight {ckpt_name!r} has no parameter ({name})")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
        if skipped:
            logger.info("Qwen3.5/3.6 text path: skipped %s weights", ", ".join(sorted(skipped)))
