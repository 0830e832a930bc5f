"""Preflight: will the platform start this submission, and start it with the context we need?

    python -m vllm_overrides.preflight [--config computility-run.yaml] [--model-config CONFIG.json]
        [--mem-per-card-gib 32] [--tp N] [--gpu-mem-util U] [--max-num-batched-tokens N]
        [--max-model-len N] [--required-len 262144] [--patches verify|manifest|skip]
        [--explain] [--json]

Each earlier submission that sank at start-up sank on something checkable before an image is
built (PLATFORM.md, "What sank earlier submissions"): a flag vLLM rejects, a file the image lacks,
CRLF line endings, an overlay that did not deploy, KV capacity below ``max_model_len`` (start-up
refused), ``gpu_memory_utilization`` 0.95 (CUDA OOM at start-up), a context below what the replay
needs. This module checks all of them and prints a go/no-go table (``--json`` for machines); the
exit status is 1 when any check is NO-GO (WARN: passes, but inside the memory model's error).

The memory check is a model of vLLM 0.32.0's start-up arithmetic, per rank:

    KV bytes = mem x util - weights - (fixed profile overhead + slope x max_num_batched_tokens)

and vLLM refuses to start when that KV memory cannot hold one request of ``max_model_len`` tokens
(``check_enough_kv_cache_memory``). The KV layout is derived from the model config the way vLLM
derives it (``_align_hybrid_block_size``, ``_get_kv_cache_groups_uniform_page_size``,
``max_memory_usage_bytes``; ``tests/robustness/test_preflight.py`` checks it against those
functions). The two terms nothing here can derive - the profile run's activation peak and the
platform's fixed overhead - are calibrated on the seed's observed start-ups (``SEED``, see
``calibrate``; ``--explain`` prints the derivation).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_overrides.launcher import (
    DEFAULT_CONFIG,
    PLATFORM_CONFIG,
    REPO_DIR,
    V1_0_32_CONFIG,
    WORKSPACE,
    RunConfig,
    build_launch,
    get_flag,
    installed_vllm,
    load_run_config,
    server_args,
    set_flag,
)

GIB = 1024**3
MIB = 1024**2
PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_CONFIG = PACKAGE_DIR / "model_facts" / "qwen3_6_35b_a3b.json"
# The replay needs about 258.5K tokens including output (PLATFORM.md); 262,144 is the model's
# position limit and the smallest power-of-two-friendly value above it.
REQUIRED_CONTEXT = 262_144
EXPECTED_MODULE = "vllm.entrypoints.openai.api_server"
# PLATFORM.md: "CUDA out-of-memory at start-up with gpu_memory_utilization 0.95".
UTIL_OBSERVED_OOM = 0.95
DTYPE_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4, "auto": 2}

GO, NO_GO, WARN, SKIP = "GO", "NO-GO", "WARN", "SKIP"

# Defaults for config keys PLATFORM.md does not state (the facts file leaves them out):
ASSUMED = {
    # The checkpoint keeps the GDN recurrent state in fp32; vLLM 0.32.0 reads this key
    # (Qwen3_5ForConditionalGenerationConfig). Source: tests/tiny_model.py, which copies the
    # real config's code-path values. Only the size of the per-sequence state depends on it.
    "mamba_ssm_dtype": "float32",
    "tie_word_embeddings": False,
    # Vision tower widths beyond depth/hidden (tests/tiny_model.py: "MLP 4304"); they only move
    # the weight estimate, by < 0.1 GiB per rank.
    "vision_intermediate_size": 4304,
    "vision_patch_size": 16,
    "vision_temporal_patch_size": 2,
    "vision_spatial_merge_size": 2,
    "vision_in_channels": 3,
    "vision_num_position_embeddings": 2304,
}
# Smallest kernel block of vLLM's FlashAttention-style backends (MultipleOf(16)); the hybrid
# alignment rounds the attention block size up to a multiple of it.
KERNEL_BLOCK_ALIGNMENT = 16
# The seed's capacities pin the KV memory only to within a block each, so the fitted slope is
# uncertain by ~2 blocks per 8,192 batched tokens; a margin under 4 blocks (2,112 tokens at
# TP4) is reported as WARN rather than GO.
UNCERTAINTY_BLOCKS = 4
# vLLM's profile run ends with a dummy sampler run over max_num_seqs rows of full-vocabulary
# logits (top-k + top-p through forward_native on a card without Triton or FlashInfer): 5.21
# MiB of transient buffers per sequence at vocab 248,320, measured with upstream's own Sampler
# by worklogs/sampler_peak.py (worklogs/results/sampler-peak.json). Whether it or the forward
# pass sets the profile's peak on the card is not known, so a lower --max-num-seqs than the
# seed's is reported as KV capacity it may free, never counted towards GO.
SAMPLER_MIB_PER_SEQ_PER_VOCAB = 5.21 / 248_320


# ----------------------------------------------------------------------------------------------
# What the seed observed (the calibration anchors)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    max_num_batched_tokens: int
    started: bool
    # vLLM's "estimated maximum model length" from the refusal, i.e. the KV capacity in tokens.
    kv_capacity_tokens: int | None = None


@dataclass(frozen=True)
class SeedRuns:
    """The seed's three start-ups on the platform (TP4, fp16) and the settings they shared."""

    max_model_len: int = 245_000
    mem_per_card_gib: float = 32.0
    gpu_memory_utilization: float = 0.9
    tp: int = 4
    weights_gib: float = 16.2  # "Weights ... take ~16.2 GB per card at TP4" (vLLM logs GiB)
    max_num_seqs: int = 256  # vLLM's default below 70 GiB of device memory (not set by the seed)
    runs: tuple[Observation, ...] = (
        Observation(16_384, True),
        Observation(24_576, False, 233_056),
        Observation(32_768, False, 209_296),
    )


SEED = SeedRuns()


# ----------------------------------------------------------------------------------------------
# Model facts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    hidden_size: int
    attention_layers: int
    gdn_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_head_dim: int
    gdn_value_head_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    mamba_ssm_dtype: str
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_out_hidden: int
    vision_patch: int
    vision_temporal_patch: int
    vision_merge: int
    vision_in_channels: int
    vision_positions: int
    assumed: tuple[str, ...] = ()

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> ModelFacts:
        """Read a Qwen3.5/3.6 MoE ``config.json`` (or the facts file, which has its layout)."""
        text = raw.get("text_config", raw)
        vision = raw.get("vision_config", {})
        assumed: list[str] = []

        def opt(src: dict[str, Any], key: str, default_key: str) -> Any:
            if key in src:
                return src[key]
            assumed.append(default_key)
            return ASSUMED[default_key]

        layers = int(text["num_hidden_layers"])
        if "layer_types" in text:
            kinds = list(text["layer_types"])
        else:  # Qwen3-Next style: every full_attention_interval-th layer is full attention
            interval = int(text["full_attention_interval"])
            kinds = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
        if len(kinds) != layers:
            raise ValueError(f"layer_types has {len(kinds)} entries for {layers} layers")
        attention = sum(k == "full_attention" for k in kinds)
        hidden = int(text["hidden_size"])
        return cls(
            hidden_size=hidden,
            attention_layers=attention,
            gdn_layers=layers - attention,
            num_q_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text["num_key_value_heads"]),
            head_dim=int(text["head_dim"]),
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            gdn_key_heads=int(text["linear_num_key_heads"]),
            gdn_value_heads=int(text["linear_num_value_heads"]),
            gdn_key_head_dim=int(text["linear_key_head_dim"]),
            gdn_value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text["linear_conv_kernel_dim"]),
            num_experts=int(text["num_experts"]),
            top_k=int(text["num_experts_per_tok"]),
            moe_intermediate=int(text["moe_intermediate_size"]),
            shared_intermediate=int(text.get("shared_expert_intermediate_size", 0)),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(
                raw.get(
                    "tie_word_embeddings", opt(text, "tie_word_embeddings", "tie_word_embeddings")
                )
            ),
            mamba_ssm_dtype=str(opt(text, "mamba_ssm_dtype", "mamba_ssm_dtype")),
            vision_depth=int(vision.get("depth", 0)),
            vision_hidden=int(vision.get("hidden_size", 0)),
            vision_intermediate=int(opt(vision, "intermediate_size", "vision_intermediate_size")),
            vision_out_hidden=int(vision.get("out_hidden_size", hidden)),
            vision_patch=int(opt(vision, "patch_size", "vision_patch_size")),
            vision_temporal_patch=int(
                opt(vision, "temporal_patch_size", "vision_temporal_patch_size")
            ),
            vision_merge=int(opt(vision, "spatial_merge_size", "vision_spatial_merge_size")),
            vision_in_channels=int(opt(vision, "in_channels", "vision_in_channels")),
            vision_positions=int(
                opt(vision, "num_position_embeddings", "vision_num_position_embeddings")
            ),
            assumed=tuple(assumed),
        )

    @classmethod
    def load(cls, path: Path) -> ModelFacts:
        return cls.from_hf_config(json.loads(Path(path).read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------------
# The per-rank memory model
# ----------------------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """How vLLM 0.32.0 lays out the hybrid KV cache of one rank."""

    kv_heads_per_rank: int
    attn_bytes_per_token_layer: int  # K and V of one token in one full-attention layer
    mamba_state_bytes_per_layer: int  # conv + recurrent state of one sequence in one GDN layer
    block_size: int  # tokens per attention block after the hybrid alignment
    page_bytes: int  # one block of one layer (attention page == padded mamba page)
    group_size: int  # layers per KV cache group
    attention_groups: int
    mamba_groups: int
    mamba_blocks_per_group: int  # blocks a request holds per GDN group (2 in 'align' mode)

    @property
    def bytes_per_block(self) -> int:
        return self.group_size * self.page_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Marginal KV bytes per token of context (all full-attention groups)."""
        return self.attention_groups * self.bytes_per_block / self.block_size

    @property
    def fixed_blocks(self) -> int:
        """Blocks a request needs whatever its length: GDN state blocks and the null block."""
        return self.mamba_groups * self.mamba_blocks_per_group + 1

    @property
    def gdn_state_bytes_per_sequence(self) -> int:
        return self.mamba_state_bytes_per_layer * self.mamba_groups * self.group_size

    def needed_bytes(self, max_model_len: int) -> int:
        """KV memory vLLM requires before it starts (``check_enough_kv_cache_memory``)."""
        blocks = self.attention_groups * cdiv(max_model_len, self.block_size) + self.fixed_blocks
        return blocks * self.bytes_per_block

    def capacity_tokens(self, kv_bytes: float) -> int:
        """The longest request that fits: vLLM's 'estimated maximum model length'."""
        usable = math.floor(kv_bytes / self.bytes_per_block) - self.fixed_blocks
        return max(0, usable // self.attention_groups) * self.block_size

    def kv_bytes_for_capacity(self, tokens: float) -> float:
        """Inverse of ``capacity_tokens`` (continuous: the midpoint of the block it rounds to)."""
        return (tokens * self.attention_groups / self.block_size + self.fixed_blocks) * (
            self.bytes_per_block
        )


def kv_layout(
    facts: ModelFacts,
    tp: int,
    kv_dtype_bytes: int = 2,
    prefix_caching: bool = True,
    kernel_block_alignment: int = KERNEL_BLOCK_ALIGNMENT,
    block_size: int | None = None,
    checkpoint_blocks: int = 0,
) -> KVLayout:
    # vLLM replicates KV heads when there are fewer than ranks: max(1, 2 // 4) = 1 head per rank
    # (ModelConfig.get_num_kv_heads), so at TP4 every rank holds one full copy of one kv head.
    kv_heads = max(1, facts.num_kv_heads // tp)
    attn_tok = kv_heads * facts.head_dim * 2 * kv_dtype_bytes
    # GatedDeltaNet state per sequence and layer (MambaStateShapeCalculator): a conv state over
    # (q, k, v) channels for kernel-1 steps in the model dtype, and a (v_heads, v_dim, k_dim)
    # recurrent state in mamba_ssm_dtype; both sharded by TP.
    conv_dim = (
        facts.gdn_key_head_dim * facts.gdn_key_heads * 2
        + facts.gdn_value_head_dim * facts.gdn_value_heads
    )
    conv_bytes = conv_dim // tp * (facts.conv_kernel - 1) * kv_dtype_bytes
    ssm_bytes = (
        facts.gdn_value_heads
        // tp
        * facts.gdn_value_head_dim
        * facts.gdn_key_head_dim
        * DTYPE_BYTES[facts.mamba_ssm_dtype]
    )
    mamba_page = conv_bytes + ssm_bytes
    if block_size is None:
        # Platform._align_hybrid_block_size: the attention page must hold a mamba state.
        block_size = kernel_block_alignment * cdiv(mamba_page, kernel_block_alignment * attn_tok)
    page = block_size * attn_tok
    if page < mamba_page:
        raise ValueError(f"block size {block_size} gives a page smaller than the GDN state")
    # _get_kv_cache_groups_uniform_page_size: groups of equal layer count; 10 attention + 30 GDN
    # layers give one attention group and three GDN groups of 10 layers.
    n_min = min(facts.attention_layers, facts.gdn_layers)
    n_max = max(facts.attention_layers, facts.gdn_layers)
    group = n_max if n_max < n_min * 1.5 else n_min
    return KVLayout(
        kv_heads_per_rank=kv_heads,
        attn_bytes_per_token_layer=attn_tok,
        mamba_state_bytes_per_layer=mamba_page,
        block_size=block_size,
        page_bytes=page,
        group_size=group,
        attention_groups=cdiv(facts.attention_layers, group),
        mamba_groups=cdiv(facts.gdn_layers, group),
        # MambaSpec.max_memory_usage_bytes: 2 blocks in 'align' mode (prefix caching on), plus
        # num_prefill_checkpoint_blocks (patch 0006 reserves one under GDN_NATIVE=1), else 1.
        mamba_blocks_per_group=2 + checkpoint_blocks if prefix_caching else 1,
    )


def weight_params_per_rank(facts: ModelFacts, tp: int) -> dict[str, float]:
    """Parameters one rank loads, by part (vLLM's TP sharding; the MTP layer is not loaded)."""
    h = facts.hidden_size
    kv_heads = max(1, facts.num_kv_heads // tp)
    q_out = facts.num_q_heads * facts.head_dim * (2 if facts.attn_output_gate else 1)
    attention = (
        h * q_out / tp  # q (+ output gate), column-parallel
        + 2 * h * kv_heads * facts.head_dim  # k, v: each rank its (replicated) kv head
        + facts.num_q_heads * facts.head_dim * h / tp  # o, row-parallel
    )
    key_dim = facts.gdn_key_heads * facts.gdn_key_head_dim
    value_dim = facts.gdn_value_heads * facts.gdn_value_head_dim
    gdn = (
        h * (2 * key_dim + 2 * value_dim) / tp  # in_proj_qkvz
        + h * 2 * facts.gdn_value_heads / tp  # in_proj_ba
        + (2 * key_dim + value_dim) * facts.conv_kernel / tp  # conv1d
        + value_dim * h / tp  # out_proj
    )
    moe = (
        facts.num_experts * 3 * h * facts.moe_intermediate / tp  # routed experts (TP on I)
        + 3 * h * facts.shared_intermediate / tp  # shared expert
        + h * facts.num_experts  # router, replicated
        + h  # shared-expert sigmoid gate
    )
    vh, vm = facts.vision_hidden, facts.vision_merge**2
    vision = (
        facts.vision_depth * (4 * vh * vh + 2 * vh * facts.vision_intermediate) / tp
        + facts.vision_in_channels * facts.vision_temporal_patch * facts.vision_patch**2 * vh
        + facts.vision_positions * vh
        + ((vh * vm) ** 2 + vh * vm * facts.vision_out_hidden) / tp  # patch merger
    )
    embeddings = facts.vocab_size * h / tp * (1 if facts.tie_word_embeddings else 2)
    return {
        "embeddings+lm_head": embeddings,
        "full_attention": facts.attention_layers * attention,
        "gated_deltanet": facts.gdn_layers * gdn,
        "moe": (facts.attention_layers + facts.gdn_layers) * moe,
        "vision": vision,
    }


def weights_estimate_gib(facts: ModelFacts, tp: int, dtype_bytes: int = 2) -> float:
    return sum(weight_params_per_rank(facts, tp).values()) * dtype_bytes / GIB


@dataclass(frozen=True)
class Calibration:
    """The profile-run terms, fitted on the seed's two refused start-ups."""

    kv_bytes_per_token: float
    tokens_per_mib: float
    activation_bytes_per_batched_token: float  # slope of the profile peak in max_num_batched_tokens
    fixed_overhead_gib: float  # profile peak at 0 batched tokens + non-torch memory
    weights_scale: float  # observed weights / this module's estimate, at the seed's TP
    checks: list[dict[str, Any]] = field(default_factory=list)


def calibrate(facts: ModelFacts, seed: SeedRuns = SEED, kv_dtype_bytes: int = 2) -> Calibration:
    """Fit slope and intercept of the profile peak on the seed's runs, then test the fit.

    Two refused runs give two (max_num_batched_tokens, KV capacity) points. Each token of KV
    capacity costs ``kv_bytes_per_token`` (10 attention layers x 1 kv head x 256 x K,V x 2 B =
    10 KiB: 102.4 tokens per MiB), so the capacity lost between them, converted to bytes, is
    what the larger profile run took; divided by the extra batched tokens it is the activation
    slope. The intercept follows from one point and the budget mem x util - weights. The third
    run (started) is the test: the fitted line must put its capacity above its max_model_len.
    """
    layout = kv_layout(facts, seed.tp, kv_dtype_bytes)
    failed = sorted(
        (o for o in seed.runs if o.kv_capacity_tokens is not None),
        key=lambda o: o.max_num_batched_tokens,
    )
    if len(failed) < 2:
        raise ValueError("calibration needs two runs with an observed KV capacity")
    lo, hi = failed[0], failed[-1]
    assert lo.kv_capacity_tokens is not None and hi.kv_capacity_tokens is not None
    kv_lo = layout.kv_bytes_for_capacity(lo.kv_capacity_tokens)
    kv_hi = layout.kv_bytes_for_capacity(hi.kv_capacity_tokens)
    slope = (kv_lo - kv_hi) / (hi.max_num_batched_tokens - lo.max_num_batched_tokens)
    budget = seed.mem_per_card_gib * GIB * seed.gpu_memory_utilization - seed.weights_gib * GIB
    fixed = budget - kv_lo - slope * lo.max_num_batched_tokens
    cal = Calibration(
        kv_bytes_per_token=layout.kv_bytes_per_token,
        tokens_per_mib=MIB / layout.kv_bytes_per_token,
        activation_bytes_per_batched_token=slope,
        fixed_overhead_gib=fixed / GIB,
        weights_scale=seed.weights_gib / weights_estimate_gib(facts, seed.tp, kv_dtype_bytes),
    )
    for run in seed.runs:
        kv = budget - fixed - slope * run.max_num_batched_tokens
        predicted = layout.capacity_tokens(kv)
        starts = predicted >= seed.max_model_len
        cal.checks.append(
            {
                "max_num_batched_tokens": run.max_num_batched_tokens,
                "observed_started": run.started,
                "observed_capacity": run.kv_capacity_tokens,
                "predicted_capacity": predicted,
                "predicted_started": starts,
                "consistent": starts == run.started
                and (
                    run.kv_capacity_tokens is None
                    or abs(predicted - run.kv_capacity_tokens) <= layout.block_size
                ),
            }
        )
    return cal


@dataclass
class MemoryPlan:
    tp: int
    mem_per_card_gib: float
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_model_len: int
    weights_estimate_gib: float
    weights_gib: float
    activation_peak_gib: float
    kv_gib: float
    kv_needed_gib: float
    kv_capacity_tokens: int
    margin_tokens: int
    kv_bytes_per_token: float
    tokens_per_mib: float
    block_size: int
    kv_heads_per_rank: int
    gdn_state_mib_per_sequence: float
    full_length_sequences: float
    # What would make it fit, the other settings unchanged (None: nothing in range does).
    max_batched_tokens_that_fit: int | None = None
    min_util_that_fits: float | None = None
    # Sampler buffers the launch's --max-num-seqs saves against the seed's, and the capacity if
    # the dummy sampler run is what set the seed's profile peak (an upper bound; not in GO).
    max_num_seqs: int | None = None
    sampler_saving_gib: float = 0.0
    kv_capacity_tokens_upper: int | None = None

    @property
    def starts(self) -> bool:
        return self.weights_gib < self.mem_per_card_gib and self.kv_capacity_tokens >= max(
            self.max_model_len, 1
        )


def memory_plan(
    facts: ModelFacts,
    *,
    tp: int,
    mem_per_card_gib: float,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_model_len: int,
    prefix_caching: bool = True,
    dtype_bytes: int = 2,
    weights_gib: float | None = None,
    calibration: Calibration | None = None,
    checkpoint_blocks: int = 0,
    max_num_seqs: int | None = None,
) -> MemoryPlan:
    cal = calibration or calibrate(facts, kv_dtype_bytes=dtype_bytes)
    layout = kv_layout(facts, tp, dtype_bytes, prefix_caching, checkpoint_blocks=checkpoint_blocks)
    estimate = weights_estimate_gib(facts, tp, dtype_bytes)
    weights = weights_gib if weights_gib is not None else estimate * cal.weights_scale
    activation = cal.fixed_overhead_gib + cal.activation_bytes_per_batched_token * (
        max_num_batched_tokens / GIB
    )
    kv = mem_per_card_gib * gpu_memory_utilization - weights - activation
    capacity = layout.capacity_tokens(kv * GIB) if kv > 0 else 0
    needed = layout.needed_bytes(max_model_len)
    fixed = (weights + cal.fixed_overhead_gib) * GIB
    spare = mem_per_card_gib * gpu_memory_utilization * GIB - fixed - needed
    fit_tokens = int(spare // cal.activation_bytes_per_batched_token) if spare > 0 else None
    min_util = (
        needed + fixed + cal.activation_bytes_per_batched_token * max_num_batched_tokens
    ) / (mem_per_card_gib * GIB)
    saving = 0.0
    if max_num_seqs is not None and max_num_seqs < SEED.max_num_seqs:
        per_seq = SAMPLER_MIB_PER_SEQ_PER_VOCAB * facts.vocab_size * MIB / GIB
        saving = per_seq * (SEED.max_num_seqs - max_num_seqs)
    upper = layout.capacity_tokens((kv + saving) * GIB) if saving and kv + saving > 0 else None
    return MemoryPlan(
        tp=tp,
        mem_per_card_gib=mem_per_card_gib,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        weights_estimate_gib=estimate,
        weights_gib=weights,
        activation_peak_gib=activation,
        kv_gib=kv,
        kv_needed_gib=layout.needed_bytes(max_model_len) / GIB,
        kv_capacity_tokens=capacity,
        margin_tokens=capacity - max_model_len,
        kv_bytes_per_token=layout.kv_bytes_per_token,
        tokens_per_mib=MIB / layout.kv_bytes_per_token,
        block_size=layout.block_size,
        kv_heads_per_rank=layout.kv_heads_per_rank,
        gdn_state_mib_per_sequence=layout.gdn_state_bytes_per_sequence / MIB,
        full_length_sequences=capacity / max_model_len if max_model_len else 0.0,
        max_batched_tokens_that_fit=fit_tokens,
        min_util_that_fits=math.ceil(min_util * 1000) / 1000 if min_util <= 1 else None,
        max_num_seqs=max_num_seqs,
        sampler_saving_gib=saving,
        kv_capacity_tokens_upper=upper,
    )


def explain(facts: ModelFacts, cal: Calibration, seed: SeedRuns = SEED) -> str:
    """The calibration in words and numbers (``--explain``)."""
    layout = kv_layout(facts, seed.tp)
    failed = [o for o in seed.runs if o.kv_capacity_tokens is not None]
    lo, hi = failed[0], failed[-1]
    assert lo.kv_capacity_tokens is not None and hi.kv_capacity_tokens is not None
    d_tokens = lo.kv_capacity_tokens - hi.kv_capacity_tokens
    d_batch = hi.max_num_batched_tokens - lo.max_num_batched_tokens
    d_mib = d_tokens / cal.tokens_per_mib
    moe_buffer = facts.top_k * facts.hidden_size * 2
    hidden_fp16 = facts.hidden_size * 2
    lines = [
        f"KV per token of context at TP{seed.tp}: {facts.attention_layers} attention layers x "
        f"{layout.kv_heads_per_rank} kv head (of {facts.num_kv_heads}, replicated) x "
        f"{facts.head_dim} x 2 (K,V) x 2 B = {cal.kv_bytes_per_token:,.0f} B "
        f"-> {cal.tokens_per_mib:.1f} tokens per MiB",
        f"GDN state per sequence: {facts.gdn_layers} layers x "
        f"{layout.mamba_state_bytes_per_layer:,} B = "
        f"{layout.gdn_state_bytes_per_sequence / MIB:.1f} MiB (x{layout.mamba_blocks_per_group} "
        f"blocks in 'align' mode; attention block size {layout.block_size} so one attention "
        "page holds one state)",
        f"seed: max_num_batched_tokens {lo.max_num_batched_tokens:,} -> capacity "
        f"{lo.kv_capacity_tokens:,}; {hi.max_num_batched_tokens:,} -> "
        f"{hi.kv_capacity_tokens:,}",
        f"  {d_batch:,} more batched tokens cost {d_tokens:,} tokens of KV = "
        f"{d_tokens:,} / {cal.tokens_per_mib:.1f} = {d_mib:.1f} MiB",
        f"  profile-peak slope = {d_mib:.1f} MiB / {d_batch:,} = "
        f"{cal.activation_bytes_per_batched_token:,.0f} B "
        f"({cal.activation_bytes_per_batched_token / 1024:.1f} KiB) per batched token",
        "  why it scales: the profile run is one forward pass over max_num_batched_tokens "
        "tokens (and the encoder-cache profile's budget is max_num_batched_tokens too), so "
        "its transient buffers are sized by it and their peak comes off the KV budget",
        f"  plausible size: {cal.activation_bytes_per_batched_token / hidden_fp16:.1f} "
        f"fp16 hidden vectors ({hidden_fp16 / 1024:.0f} KiB) per token alive at the peak; "
        f"more than one hidden state, less than upstream Triton MoE's two (tokens x top-"
        f"{facts.top_k} x hidden) workspaces ({2 * moe_buffer / 1024:.0f} KiB per token)",
        f"  fixed overhead (profile peak at 0 tokens + non-torch): "
        f"{cal.fixed_overhead_gib:.2f} GiB = {seed.mem_per_card_gib:g} GiB x "
        f"{seed.gpu_memory_utilization:g} - {seed.weights_gib:g} GiB weights - KV - slope x "
        f"{lo.max_num_batched_tokens:,}",
        f"  weights: estimate {weights_estimate_gib(facts, seed.tp):.2f} GiB/rank from the "
        f"config vs {seed.weights_gib:g} observed (scale {cal.weights_scale:.3f})",
    ]
    for c in cal.checks:
        lines.append(
            f"  check {c['max_num_batched_tokens']:>6,}: predicted capacity "
            f"{c['predicted_capacity']:>7,} (observed {c['observed_capacity'] or '-':>7}) -> "
            f"{'starts' if c['predicted_started'] else 'refused'}, observed "
            f"{'started' if c['observed_started'] else 'refused'}: "
            f"{'consistent' if c['consistent'] else 'INCONSISTENT'}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The platform line: vLLM 0.6.3's V0 engine on the BI-V100
# ----------------------------------------------------------------------------------------------

# PLATFORM.md, "Hardware": the card's memory as the driver reports it, and what is in use at idle.
CARD_BYTES = 34_057_748_480
CARD_IDLE_BYTES = 257 * MIB
# V0's paged KV: CacheConfig's default block size, and BlockSpaceManagerV2's watermark (1 % of
# the GPU blocks): a prompt with `total - required < int(0.01 * total)` is never scheduled.
V0_BLOCK_SIZE = 16
V0_WATERMARK = 0.01
# ixformer's same-node IPC all-reduce (ENABLE_CUSTOM_IPC=1): a 64 MiB region per rank
# (PLATFORM.md, "How the vendor's vLLM 0.6.3+corex differs").
IPC_REGION_BYTES = 64 * MIB
# Weights per card at TP4 "≈ 16.2-16.7 GiB" (PLATFORM.md): the upper end, since the V0 text
# path's own load was never observed on the card.
V0_WEIGHTS_GIB = 16.7
# Allocations V0's profiler counts that no torch tensor of ours makes (ixformer's NCCL
# communicators, the BLAS workspaces): not measured on the card, assumed.
V0_RUNTIME_BYTES = 512 * MIB
# The caching allocator keeps what the profiling forward reserved, in 2 MiB-rounded segments
# that fragment: a 20 % allowance on the measured tensor peak (assumed).
V0_ALLOCATOR_SLACK = 0.20
# GO needs the KV pool to hold one max_model_len prompt plus the watermark with 10 % to spare;
# below that but above the line is WARN (the terms marked "assumed" above are inside 10 %).
V0_MARGIN = 0.10
# GDN state checkpoints (issue 47): a pool of ``VO_GDN_CHECKPOINTS`` (the YAML's env) slots,
# each one sequence's conv + recurrent states of every GDN layer of the rank; when the env does
# not set it, the engine's default. Read from the engine's module (stdlib only, no vLLM), so
# the two cannot drift; the literals are for a checkout without it.
try:
    from vllm_overrides.engines.v0.prefix_cache import DEFAULT_POOL as V0_GDN_CHECKPOINTS
    from vllm_overrides.engines.v0.prefix_cache import ENV_POOL as V0_GDN_CHECKPOINTS_ENV
except ImportError:
    V0_GDN_CHECKPOINTS_ENV = "VO_GDN_CHECKPOINTS"
    V0_GDN_CHECKPOINTS = 32
# Transient bytes of one forward over T tokens, per rank at TP4 in fp16: a + b*T for each op
# family's PyTorch path (the path the card takes when our kernels do not load; the fused ones
# allocate less), measured as max_memory_allocated above the inputs by
# worklogs/v0_activation_probe.py at T = 4,096 / 8,192 / 16,384 on an H100 (torch 2.11;
# worklogs/results/v0-activation-probe-h100-2026-12-06/): the line through the 4,096 and
# 16,384 points (8,192 lies on it within 2 %).
V0_ACTIVATION = {
    # router sort + per-expert-loop GEMMs + gather combine + shared expert
    "moe": (33_555_456, 104_640),
    # chunked gated delta rule (PyTorch path, 16 sequences)
    "gdn_chunk": (53_131_264, 36_342),
    # prefill attention: one chunk over a 65,536-token cached context (tiles bounded)
    "attention": (203_661_312, 12_320),
    # the vision tower (replicated, not sharded) on the image V0's profile puts into a step of
    # T tokens (engines/v0/qwen3_5_mm.dummy_data: isqrt(T - 2) merged tokens a side); its
    # attention's score budget is the intercept
    "vision": (934_181_034, 86_806),
}
# The checkpoint's largest image: 16,777,216 pixels = 16,384 tokens (engines/v0/qwen3_5_mm.py).
# An image larger than a step is encoded whole, above what the profile measured: that excess
# comes out of the memory outside gpu_memory_utilization.
V0_MAX_IMAGE_TOKENS = 16_384
# V0's Sampler on the profile's sampled rows (top-k + top-p, float32): the logits, their
# softmax and log-softmax, the sorted values + int64 indices, the cumulative sum and the mask
# scattered back: ~36 bytes per vocabulary entry and row (assumed from the op sequence).
V0_SAMPLER_BYTES_PER_VOCAB_ROW = 36


def gdn_state_bytes(facts: ModelFacts, tp: int, dtype_bytes: int = 2) -> int:
    """One sequence's GDN states on one rank, all GDN layers: a conv state ``(conv_dim / tp,
    kernel - 1)`` in the model dtype and a recurrent state ``(HV / tp, V, K)`` in
    ``mamba_ssm_dtype`` (float32), as ``engines/v0/gdn_state.GDNStateCache`` holds a slot. A
    GDN checkpoint saves the same two tensors, so it costs the same."""
    conv_dim = (
        facts.gdn_key_head_dim * facts.gdn_key_heads * 2
        + facts.gdn_value_head_dim * facts.gdn_value_heads
    )
    conv = conv_dim // tp * (facts.conv_kernel - 1) * dtype_bytes
    ssm = (
        facts.gdn_value_heads
        // tp
        * facts.gdn_value_head_dim
        * facts.gdn_key_head_dim
        * DTYPE_BYTES[facts.mamba_ssm_dtype]
    )
    return facts.gdn_layers * (conv + ssm)


def v0_weights_estimate_gib(facts: ModelFacts, tp: int, dtype_bytes: int = 2) -> float:
    """Weights per rank on the V0 line: the language model sharded as on 0.32.0, the vision
    tower replicated (engines/v0/qwen3_5_vision.py uses plain ``nn.Linear``)."""
    parts = weight_params_per_rank(facts, tp)
    parts["vision"] = weight_params_per_rank(facts, 1)["vision"]
    return sum(parts.values()) * dtype_bytes / GIB


def v0_block_bytes(facts: ModelFacts, tp: int, dtype_bytes: int = 2) -> int:
    """``CacheEngine.get_cache_block_size``: K and V of one 16-token block in every *attention*
    layer (``layers_block_type`` names them: 10 of 40), kv heads replicated up to one a rank."""
    kv_heads = max(1, facts.num_kv_heads // tp)
    return 2 * V0_BLOCK_SIZE * kv_heads * facts.head_dim * facts.attention_layers * dtype_bytes


def v0_activation_bytes(
    facts: ModelFacts, tokens: int, sampled_rows: int, dtype_bytes: int = 2, images: bool = True
) -> dict[str, Any]:
    """The profiling forward's transient peak, by part (V0's ``profile_run``: one forward of
    ``max_num_batched_tokens`` tokens over ``max_num_seqs`` sequences, then one sampler run)."""
    per_family = {k: a + b * tokens for k, (a, b) in V0_ACTIVATION.items()}
    if not images:
        per_family.pop("vision")
    # hidden states, residual, the normed input and the all-reduced output between layers
    stream = 4 * tokens * facts.hidden_size * dtype_bytes
    largest = max(per_family, key=per_family.__getitem__)
    forward = per_family[largest] + stream
    sampler = sampled_rows * facts.vocab_size * (V0_SAMPLER_BYTES_PER_VOCAB_ROW + dtype_bytes)
    peak = max(forward, sampler)
    a, b = V0_ACTIVATION["vision"]
    image_excess = max(0, a + b * V0_MAX_IMAGE_TOKENS - per_family.get("vision", 0))
    return {
        **{f"{k}_workspace": v for k, v in per_family.items()},
        "largest_family": largest,  # type: ignore[dict-item]
        "largest_image_excess": image_excess if images else 0,
        "residual_stream": stream,
        "forward": forward,
        "sampler": sampler,
        "peak": peak,
        "allocator_slack": int(peak * V0_ALLOCATOR_SLACK),
        "total": peak + int(peak * V0_ALLOCATOR_SLACK),
    }


@dataclass
class V0Plan:
    """V0's start-up arithmetic on one rank (``Worker.determine_num_available_blocks``):
    ``num_gpu_blocks = (total x util - peak) // block_bytes``, where ``peak`` is what the
    process allocated between ``init_device`` and the end of the profiling forward (weights,
    communicators, the GDN state slots and checkpoints our model allocates in that forward,
    the forward's own transients); the card's idle use is outside it."""

    tp: int
    card_bytes: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gdn_checkpoints: int
    ipc: bool
    rows: list[dict[str, Any]]
    block_bytes: int
    kv_bytes: int
    num_gpu_blocks: int
    needed_blocks: int
    watermark_blocks: int
    capacity_tokens: int
    margin_ratio: float
    headroom_bytes: int
    weights_estimate_gib: float

    @property
    def starts(self) -> bool:
        return (
            self.num_gpu_blocks * V0_BLOCK_SIZE >= self.max_model_len
            and self.num_gpu_blocks - self.needed_blocks >= self.watermark_blocks
        )


def v0_memory_plan(
    facts: ModelFacts,
    *,
    tp: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    gdn_checkpoints: int = V0_GDN_CHECKPOINTS,
    ipc: bool = True,
    dtype_bytes: int = 2,
    weights_gib: float | None = None,
    card_bytes: int = CARD_BYTES,
    images: bool = True,
) -> V0Plan:
    budget = int(card_bytes * gpu_memory_utilization)
    estimate = v0_weights_estimate_gib(facts, tp, dtype_bytes)
    weights = int((max(V0_WEIGHTS_GIB, estimate) if weights_gib is None else weights_gib) * GIB)
    state = gdn_state_bytes(facts, tp, dtype_bytes)
    # GDNStateCache: max_num_seqs slots + the reserved slot 0, made in the profiling forward.
    slots = (max_num_seqs + 1) * state
    ckpts = gdn_checkpoints * state
    act = v0_activation_bytes(facts, max_num_batched_tokens, max_num_seqs, dtype_bytes, images)
    ipc_bytes = IPC_REGION_BYTES if ipc else 0
    rows: list[dict[str, Any]] = [
        {"item": "card x gpu_memory_utilization", "bytes": budget,
         "note": f"{card_bytes:,} B x {gpu_memory_utilization:g}"},
        {"item": "weights", "bytes": -weights,
         "note": f"the larger of PLATFORM.md's {V0_WEIGHTS_GIB} and the config estimate "
                 f"{estimate:.2f} GiB (vision tower replicated)"},
        {"item": "IPC all-reduce region", "bytes": -ipc_bytes,
         "note": "ENABLE_CUSTOM_IPC=1" if ipc else "off"},
        {"item": "runtime (communicators, BLAS)", "bytes": -V0_RUNTIME_BYTES,
         "note": "assumed"},
        {"item": "GDN state slots", "bytes": -slots,
         "note": f"({max_num_seqs} + 1) x {state / MIB:.2f} MiB"},
        {"item": "GDN checkpoints", "bytes": -ckpts,
         "note": f"{gdn_checkpoints} x {state / MIB:.2f} MiB"},
        {"item": f"activation: {act['largest_family']} workspace",
         "bytes": -act[f"{act['largest_family']}_workspace"],
         "note": f"step of {max_num_batched_tokens:,} tokens: the largest family sets the peak "
                 "(measured, worklogs/v0_activation_probe.py)"},
        *[{"item": f"  ({k} workspace)", "bytes": 0,
           "note": f"{act[f'{k}_workspace'] / MIB:.1f} MiB, under the peak"}
          for k in V0_ACTIVATION if k != act["largest_family"] and f"{k}_workspace" in act],
        {"item": "activation: sampler", "bytes": -max(0, act["sampler"] - act["forward"]),
         "note": f"{act['sampler'] / MIB:.1f} MiB for {max_num_seqs} sampled rows of "
                 f"{facts.vocab_size:,} logits, after the forward's transients are freed"},
        {"item": "activation: residual stream", "bytes": -act["residual_stream"],
         "note": "4 x tokens x hidden"},
        {"item": "activation: allocator slack", "bytes": -act["allocator_slack"],
         "note": f"{V0_ALLOCATOR_SLACK:.0%} of the peak, assumed"},
    ]  # fmt: skip
    peak_parts = weights + ipc_bytes + V0_RUNTIME_BYTES + slots + ckpts + act["total"]
    kv = max(0, budget - peak_parts)
    block = v0_block_bytes(facts, tp, dtype_bytes)
    blocks = kv // block
    rows.append({"item": "= KV cache", "bytes": kv, "note": f"{blocks:,} blocks of {block:,} B"})
    needed = cdiv(max_model_len, V0_BLOCK_SIZE)
    watermark = int(V0_WATERMARK * blocks)
    required = needed + watermark
    # Outside the utilisation: the card's idle use, and the largest image's tower run above
    # the profiled step (the CUDA context must fit in what is left).
    headroom = card_bytes - budget - CARD_IDLE_BYTES - int(act["largest_image_excess"])
    return V0Plan(
        tp=tp,
        card_bytes=card_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        gdn_checkpoints=gdn_checkpoints,
        ipc=ipc,
        rows=rows,
        block_bytes=block,
        kv_bytes=kv,
        num_gpu_blocks=blocks,
        needed_blocks=needed,
        watermark_blocks=watermark,
        capacity_tokens=blocks * V0_BLOCK_SIZE,
        margin_ratio=blocks / required - 1 if required else 0.0,
        headroom_bytes=headroom,
        weights_estimate_gib=estimate,
    )


def format_v0_budget(plan: V0Plan) -> str:
    """The per-rank budget as a table (GiB and MiB)."""
    width = max(len(r["item"]) for r in plan.rows)
    lines = [f"{'per rank (TP' + str(plan.tp) + ')':<{width}}  {'GiB':>8}  {'MiB':>10}  note"]
    for r in plan.rows:
        b = r["bytes"]
        lines.append(f"{r['item']:<{width}}  {b / GIB:>8.3f}  {b / MIB:>10.1f}  {r['note']}")
    lines += [
        f"KV capacity: {plan.num_gpu_blocks:,} blocks = {plan.capacity_tokens:,} tokens; "
        f"a {plan.max_model_len:,}-token prompt needs {plan.needed_blocks:,} + watermark "
        f"{plan.watermark_blocks:,} (1 %) = {plan.needed_blocks + plan.watermark_blocks:,} "
        f"blocks (margin {plan.margin_ratio:+.1%})",
        f"outside gpu_memory_utilization: {plan.headroom_bytes / GIB:.2f} GiB left after the "
        f"card's {CARD_IDLE_BYTES // MIB} MiB idle use and the largest image's tower run above "
        f"the profiled step ({V0_MAX_IMAGE_TOKENS:,} tokens; for the CUDA context and anything "
        "else allocated after the profile)",
    ]
    return "\n".join(lines)


def check_v0_memory(plan: V0Plan) -> Check:
    data = asdict(plan)
    required = plan.needed_blocks + plan.watermark_blocks
    summary = (
        f"{plan.num_gpu_blocks:,} blocks ({plan.capacity_tokens:,} tokens) vs {required:,} for "
        f"max_model_len {plan.max_model_len:,} + 1 % watermark (margin {plan.margin_ratio:+.1%};"
        f" KV {plan.kv_bytes / GIB:.2f} GiB, {plan.gdn_checkpoints} GDN checkpoints, "
        f"activation at {plan.max_num_batched_tokens:,} batched tokens)"
    )
    if plan.headroom_bytes <= 0:
        return Check("KV capacity (V0)", NO_GO, "no memory left outside the utilisation", data)
    if not plan.starts:
        return Check("KV capacity (V0)", NO_GO, summary + ": a full-context prompt is never "
                     "scheduled (or V0 refuses to start)", data)  # fmt: skip
    if plan.margin_ratio < V0_MARGIN:
        return Check("KV capacity (V0)", WARN, summary + f": under the {V0_MARGIN:.0%} margin",
                     data)  # fmt: skip
    return Check("KV capacity (V0)", GO, summary, data)


def yaml_engine(config_path: Path) -> str:
    """Which engine a launch file is for: the repository's two files by where they are, any
    other by the installed vLLM (the platform's 0.6.3 when none is installed)."""
    path = Path(config_path).resolve()
    if path == V1_0_32_CONFIG.resolve():
        return "0.32.0"
    if path == PLATFORM_CONFIG.resolve():
        return "0.6.3"
    return installed_vllm() or "0.6.3"


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def check_yaml_schema(path: Path) -> tuple[Check, RunConfig | None]:
    try:
        config = load_run_config(path)
    except (OSError, ValueError) as exc:
        return Check("yaml schema", NO_GO, str(exc)), None
    import yaml

    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    problems = [
        f"unknown top-level key {k!r}" for k in raw if k not in ("concurrency", "command", "env")
    ]
    if config.command[:3] != ["python3", "-m", EXPECTED_MODULE]:
        problems.append(f"command must start with python3 -m {EXPECTED_MODULE}")
    names = [item["name"] for item in raw.get("env") or []]
    problems += [f"env {n!r} given twice" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [
        f"env name {n!r} is not a valid variable name"
        for n in names
        if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)
    ]
    if problems:
        return Check("yaml schema", NO_GO, "; ".join(problems)), config
    return Check(
        "yaml schema",
        GO,
        f"concurrency {config.concurrency}, {len(config.command)} argv items, "
        f"{len(config.env)} env values, all strings",
    ), config


def _parse_serve_args_v0(args: list[str]) -> None:
    """vLLM 0.6.3's parser and start-up checks of the API server: its argparse, its serve-args
    validator, and the tool parser it looks up (after importing ``--tool-parser-plugin``)."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    from vllm.utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    validate_parsed_serve_args(parsed)
    if parsed.tool_parser_plugin:
        ToolParserManager.import_tool_parser(parsed.tool_parser_plugin)
    if parsed.enable_auto_tool_choice and (
        parsed.tool_call_parser not in ToolParserManager.tool_parsers
    ):
        raise KeyError(f"tool call parser {parsed.tool_call_parser!r} is not registered")


def _parse_serve_args_v1(args: list[str]) -> None:
    """vLLM 0.32.0's parser and validators."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    validate_parsed_serve_args(parsed)
    validate_api_server_args(parsed)


def check_vllm_parser(config: RunConfig, engine: str | None = None) -> Check:
    """The installed vLLM's own parser and validators accept every flag (with /workspace ->
    checkout): 0.6.3's on the platform line, 0.32.0's on the reference line. A launch file for
    another engine than the installed one is not judged by the wrong parser (SKIP)."""
    version = installed_vllm()
    if engine is not None and version is not None and version != engine:
        return Check(
            "vLLM parser",
            SKIP,
            f"the launch is for vLLM {engine}, this interpreter has {version}: run preflight "
            f"with {engine}'s venv ({'.venv-v0' if engine == '0.6.3' else '.venv'})",
        )
    parse = _parse_serve_args_v0 if version == "0.6.3" else _parse_serve_args_v1
    argv, _ = build_launch(config, workspace=REPO_DIR)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(server_args(argv))
    except ImportError as exc:
        return Check("vLLM parser", SKIP, f"vLLM {version} not importable here: {exc}")
    except SystemExit:
        last = (err.getvalue().strip().splitlines() or ["argparse error"])[-1]
        return Check("vLLM parser", NO_GO, f"vLLM {version}: {last}")
    except Exception as exc:  # noqa: BLE001 - any validator error is a refusal at start-up
        return Check("vLLM parser", NO_GO, f"vLLM {version}: {type(exc).__name__}: {exc}")
    return Check(
        "vLLM parser",
        GO,
        f"vLLM {version}: {len(server_args(config.command))} args accepted and validated",
    )


def _dockerfile_workspace_files(dockerfile: Path) -> set[str]:
    """Paths (relative to /workspace) that the Dockerfile's COPY lines put under /workspace."""
    copied: set[str] = set()
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if not parts or parts[0].upper() != "COPY" or any(p.startswith("--from") for p in parts):
            continue
        *sources, dest = [p for p in parts[1:] if not p.startswith("--")]
        if not dest.startswith(WORKSPACE.rstrip("/")):
            continue
        under = dest[len(WORKSPACE) :] if dest.startswith(WORKSPACE) else ""
        for src in sources:
            src = src.rstrip("/")
            # COPY puts a directory's contents at dest, and a file at dest/name when dest ends
            # with "/".
            if dest.endswith("/") and not (REPO_DIR / src).is_dir():
                copied.add((under + Path(src).name).strip("/"))
            else:
                copied.add(under.strip("/"))
    return copied


def check_workspace_files(config: RunConfig, dockerfile: Path) -> Check:
    """Every /workspace/X named by the command is repo file X and the Dockerfile copies it."""
    named = [a for a in config.command if a.startswith(WORKSPACE)]
    if not named:
        return Check("files in image", GO, "the command names no /workspace file")
    try:
        copied = _dockerfile_workspace_files(dockerfile)
    except OSError as exc:
        return Check("files in image", NO_GO, f"{dockerfile}: {exc}")
    problems = []
    for arg in named:
        rel = arg[len(WORKSPACE) :]
        if not (REPO_DIR / rel).is_file():
            problems.append(f"{arg}: no file {rel} in the checkout")
        elif not any(rel == c or rel.startswith(c + "/") for c in copied):
            problems.append(f"{arg}: {dockerfile.name} does not COPY {rel} to {WORKSPACE}")
    if problems:
        return Check("files in image", NO_GO, "; ".join(problems))
    return Check("files in image", GO, ", ".join(named) + " copied by the Dockerfile")


def crlf_candidates(config_path: Path, config: RunConfig | None) -> list[Path]:
    files = {config_path.resolve()}
    if config is not None:
        files |= {
            (REPO_DIR / a[len(WORKSPACE) :]).resolve()
            for a in config.command
            if a.startswith(WORKSPACE) and (REPO_DIR / a[len(WORKSPACE) :]).is_file()
        }
    files |= {p.resolve() for p in REPO_DIR.glob("*.sh")}
    files |= {p.resolve() for p in REPO_DIR.glob("*.jinja")}
    files |= {p.resolve() for p in (REPO_DIR / "patches").rglob("*.patch")}
    files |= {p.resolve() for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts}
    files |= {p for p in (REPO_DIR / "Dockerfile",) if p.exists()}
    return sorted(files)


def check_crlf(files: list[Path]) -> Check:
    bad = [str(p) for p in files if p.exists() and b"\r" in p.read_bytes()]
    if bad:
        return Check("no CRLF", NO_GO, "carriage returns in " + ", ".join(bad))
    return Check("no CRLF", GO, f"{len(files)} files (yaml, template, scripts, patches, overlay)")


def check_context(config: RunConfig, required: int, facts: ModelFacts) -> Check:
    raw = get_flag(config.command, "--max-model-len")
    if raw is None:
        return Check("context length", NO_GO, "--max-model-len not set (model default applies)")
    value = int(raw)
    if value < required:
        return Check("context length", NO_GO, f"--max-model-len {value:,} < required {required:,}")
    if value > facts.max_position_embeddings:
        return Check(
            "context length",
            NO_GO,
            f"--max-model-len {value:,} > the model's {facts.max_position_embeddings:,} positions",
        )
    return Check("context length", GO, f"--max-model-len {value:,} >= {required:,}")


def check_patches(mode: str) -> Check:
    if mode == "skip":
        return Check("overlay manifest", SKIP, "--patches skip")
    try:
        from vllm_overrides import patching
    except ImportError as exc:
        return Check("overlay manifest", SKIP, f"cannot import patching: {exc}")
    try:
        site = patching.find_vllm_site()
        patching.check_version(site)
        # 'manifest' skips the fresh-interpreter imports (seconds each); 'verify' is exactly
        # what `patch_ops.sh verify` runs.
        problems = patching.verify(site, import_modules=mode == "verify")
    except patching.PatchError as exc:
        return Check("overlay manifest", NO_GO, str(exc))
    if problems:
        return Check("overlay manifest", NO_GO, f"{len(problems)} problem(s): " + problems[0])
    return Check("overlay manifest", GO, f"patch_ops verify ({mode}) clean at {site}")


def check_utilization(util: float) -> Check:
    if util >= UTIL_OBSERVED_OOM:
        return Check(
            "gpu_memory_utilization",
            NO_GO,
            f"{util:g} >= {UTIL_OBSERVED_OOM}: CUDA OOM at start-up on the platform",
        )
    if not 0 < util <= 1:
        return Check("gpu_memory_utilization", NO_GO, f"{util:g} is outside (0, 1]")
    return Check("gpu_memory_utilization", GO, f"{util:g} (< {UTIL_OBSERVED_OOM}, observed OOM)")


def check_memory(plan: MemoryPlan) -> Check:
    data = asdict(plan)
    if plan.weights_gib >= plan.mem_per_card_gib * plan.gpu_memory_utilization:
        return Check(
            "KV capacity",
            NO_GO,
            f"weights {plan.weights_gib:.1f} GiB/rank do not fit TP{plan.tp} at "
            f"{plan.gpu_memory_utilization:g} x {plan.mem_per_card_gib:g} GiB",
            data,
        )
    status = GO if plan.starts else NO_GO
    if plan.starts and plan.margin_tokens < UNCERTAINTY_BLOCKS * plan.block_size:
        status = WARN  # inside the calibration's own error: may still be refused
    hint = ""
    if not plan.starts:
        options = []
        if plan.max_batched_tokens_that_fit:
            options.append(f"--max-num-batched-tokens <= {plan.max_batched_tokens_that_fit:,}")
        if plan.min_util_that_fits:
            options.append(f"--gpu-memory-utilization >= {plan.min_util_that_fits:.3f}")
        hint = "; fits with " + " or ".join(options) if options else ""
    return Check(
        "KV capacity",
        status,
        f"{plan.kv_capacity_tokens:,} tokens {'>=' if plan.starts else '<'} max_model_len "
        f"{plan.max_model_len:,} (margin {plan.margin_tokens:+,}; KV {plan.kv_gib:.2f} GiB, "
        f"weights {plan.weights_gib:.2f}, profile peak {plan.activation_peak_gib:.2f}){hint}"
        + (
            f"; --max-num-seqs {plan.max_num_seqs} may free {plan.sampler_saving_gib:.2f} GiB "
            f"of sampler buffers: up to {plan.kv_capacity_tokens_upper:,} tokens"
            if plan.kv_capacity_tokens_upper
            else ""
        ),
        data,
    )


def check_kv_offload(config: RunConfig, tp: int, layout: KVLayout, gpu_tokens: int) -> Check:
    """What `--kv-offloading-size` asks of the host, and how many tokens it adds.

    vLLM's native CPU tier keeps every KV cache group's page of a block together (one chunk of
    ``(attention + GDN groups) x layers x page`` bytes per block and rank), in one `/dev/shm`
    file for all ranks; the server fits the size to the host it finds (patch 0012)."""
    raw = get_flag(config.command, "--kv-offloading-size")
    if raw is None:
        return Check("KV offload", GO, "off (no --kv-offloading-size)")
    gib = float(raw)
    chunk = (layout.attention_groups + layout.mamba_groups) * layout.bytes_per_block
    chunks = int(gib * GIB / tp // chunk)
    tokens = chunks * layout.block_size
    detail = (
        f"{gib:g} GiB of host memory in /dev/shm ({gib / tp:g} per rank): {chunks:,} blocks = "
        f"{tokens:,} tokens per rank, {tokens / max(gpu_tokens, 1):.1f}x the GPU pool; the "
        "server shrinks it to what /dev/shm and host memory hold, off below "
        "4 GiB (vllm_overrides/engines/v1_0_32/kv_offload_fit.py)"
    )
    if tokens <= gpu_tokens:
        # An LRU tier no larger than the GPU pool holds what the pool already holds.
        return Check("KV offload", WARN, detail + "; no larger than the GPU pool: no gain")
    return Check("KV offload", GO, detail)


def gdn_checkpoint_blocks(env: dict[str, str], prefix_caching: bool) -> int:
    """GDN prefill-checkpoint blocks per request and GDN group the launch reserves.

    Patch 0006 gives the GDN layers' KV spec one prefill-checkpoint block (vLLM's
    ``MambaSpec.num_prefill_checkpoint_blocks``) when the native GDN path runs
    (``GDN_NATIVE=1``) with prefix caching, unless ``GDN_PREFILL_CHECKPOINT=0``; vLLM then
    requires one more page per GDN group before it starts.
    """
    on = env.get("GDN_NATIVE") == "1" and env.get("GDN_PREFILL_CHECKPOINT", "1") != "0"
    return int(on and prefix_caching)


def run_preflight(args: argparse.Namespace) -> tuple[list[Check], dict[str, Any]]:
    checks: list[Check] = []
    schema, config = check_yaml_schema(args.config)
    checks.append(schema)
    facts = ModelFacts.load(args.model_config)
    engine = args.engine if args.engine != "auto" else yaml_engine(args.config)
    extra: dict[str, Any] = {"engine": engine, "assumed": list(facts.assumed)}
    if engine != "0.6.3":
        extra["calibration"] = asdict(calibrate(facts))
    if config is not None:
        checks.append(check_vllm_parser(config, engine))
        checks.append(check_workspace_files(config, args.dockerfile))
    checks.append(check_crlf(crlf_candidates(args.config, config)))
    checks.append(check_patches(args.patches))
    if config is None:
        return checks, extra

    def flag(name: str, override: Any, cast: type) -> Any:
        if override is not None:
            return override
        raw = get_flag(config.command, name)
        return cast(raw) if raw is not None else None

    tp = flag("--tensor-parallel-size", args.tp, int) or 1
    util = flag("--gpu-memory-utilization", args.gpu_mem_util, float) or 0.9  # vLLM's default
    mnbt = flag("--max-num-batched-tokens", args.max_num_batched_tokens, int) or 8192
    max_len = flag("--max-model-len", args.max_model_len, int) or facts.max_position_embeddings
    dtype = flag("--dtype", args.dtype, str) or "auto"
    if args.max_model_len is not None:
        config = RunConfig(
            config.concurrency,
            set_flag(config.command, "--max-model-len", str(args.max_model_len)),
            config.env,
        )
    checks.append(check_context(config, args.required_len, facts))
    checks.append(check_utilization(util))
    if engine == "0.6.3":
        v0 = v0_memory_plan(
            facts,
            tp=tp,
            gpu_memory_utilization=util,
            max_num_batched_tokens=mnbt,
            # V0's default is 256; the profile samples that many rows.
            max_num_seqs=flag("--max-num-seqs", None, int) or 256,
            max_model_len=max_len,
            gdn_checkpoints=(
                args.gdn_checkpoints
                if args.gdn_checkpoints is not None
                else int(config.env.get(V0_GDN_CHECKPOINTS_ENV, V0_GDN_CHECKPOINTS))
            ),
            ipc=config.env.get("ENABLE_CUSTOM_IPC") == "1",
            dtype_bytes=DTYPE_BYTES.get(dtype, 2),
            weights_gib=args.weights_gib,
            card_bytes=int(args.mem_per_card_gib * GIB) if args.mem_per_card_gib else CARD_BYTES,
        )
        checks.append(check_v0_memory(v0))
        extra["v0_memory"] = asdict(v0)
        extra["v0_budget_table"] = format_v0_budget(v0)
        return checks, extra
    cal = calibrate(facts)
    prefix_caching = "--enable-prefix-caching" in config.command
    ckpt = gdn_checkpoint_blocks(config.env, prefix_caching)
    extra["gdn_prefill_checkpoint_blocks"] = ckpt
    plan = memory_plan(
        facts,
        tp=tp,
        mem_per_card_gib=args.mem_per_card_gib or 32.0,
        gpu_memory_utilization=util,
        max_num_batched_tokens=mnbt,
        max_model_len=max_len,
        prefix_caching=prefix_caching,
        dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        weights_gib=args.weights_gib,
        calibration=cal,
        checkpoint_blocks=ckpt,
        max_num_seqs=flag("--max-num-seqs", None, int),
    )
    checks.append(check_memory(plan))
    extra["memory"] = asdict(plan)
    layout = kv_layout(
        facts, tp, DTYPE_BYTES.get(dtype, 2), prefix_caching, checkpoint_blocks=ckpt
    )  # as memory_plan's
    checks.append(check_kv_offload(config, tp, layout, plan.kv_capacity_tokens))
    return checks, extra


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    rows = [f"{'check':<{width}}  {'result':<6}  detail", f"{'-' * width}  ------  ------"]
    rows += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in checks]
    verdict = GO if all(c.status != NO_GO for c in checks) else NO_GO
    rows.append(f"{'VERDICT':<{width}}  {verdict}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vllm_overrides.preflight", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="computility-run.yaml")
    p.add_argument(
        "--model-config",
        type=Path,
        default=DEFAULT_MODEL_CONFIG,
        help="the checkpoint's config.json (default: the public facts file)",
    )
    p.add_argument("--dockerfile", type=Path, default=REPO_DIR / "Dockerfile")
    p.add_argument(
        "--engine",
        choices=["auto", "0.6.3", "0.32.0"],
        default="auto",
        help="whose memory model: auto = the launch file's line (the root YAML: 0.6.3)",
    )
    p.add_argument(
        "--mem-per-card-gib",
        type=float,
        help="card memory (default: 0.32.0 line 32; 0.6.3 line the BI-V100's "
        f"{CARD_BYTES:,} bytes)",
    )
    p.add_argument(
        "--gdn-checkpoints",
        type=int,
        help=f"V0: GDN state checkpoints in the pool (default: the YAML's "
        f"{V0_GDN_CHECKPOINTS_ENV}, else {V0_GDN_CHECKPOINTS})",
    )
    p.add_argument("--tp", type=int, help="default: the yaml's -tp")
    p.add_argument("--gpu-mem-util", type=float, help="default: the yaml's value")
    p.add_argument("--max-num-batched-tokens", type=int, help="default: the yaml's value")
    p.add_argument("--max-model-len", type=int, help="default: the yaml's value")
    p.add_argument("--dtype", help="default: the yaml's --dtype")
    p.add_argument("--weights-gib", type=float, help="weights per rank (default: calibrated)")
    p.add_argument(
        "--required-len",
        type=int,
        default=REQUIRED_CONTEXT,
        help=f"smallest acceptable --max-model-len (default {REQUIRED_CONTEXT:,})",
    )
    p.add_argument(
        "--patches",
        choices=["verify", "manifest", "skip"],
        default="verify",
        help="verify: as patch_ops.sh verify; manifest: hashes only, no import check",
    )
    p.add_argument("--explain", action="store_true", help="print the memory calibration")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checks, extra = run_preflight(args)
    ok = all(c.status != NO_GO for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks], **extra}, indent=2))
    else:
        print(format_table(checks))
        if "v0_budget_table" in extra:
            print("\n" + extra["v0_budget_table"])
        if args.explain and "calibration" in extra:
            facts = ModelFacts.load(args.model_config)
            print("\n" + explain(facts, calibrate(facts)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
