"""Qwen3.5 / Qwen3.6 MoE configs for transformers 4.51.3 (which has no ``qwen3_5_moe``).

The checkpoint's ``config.json`` is a composite: top-level ``model_type: qwen3_5_moe`` with a
``text_config`` (``qwen3_5_moe_text``) and a ``vision_config`` (``qwen3_5_moe_vision``). vLLM
0.6.3 reads the language model's sizes from ``hf_text_config`` (``get_hf_text_config`` returns
``config.text_config``) but counts attention layers from the *top-level* config's
``layers_block_type`` (``ModelConfig.get_num_attention_layers`` counts ``"attention"``
entries): without it, V0 allocates KV for every layer, GDN layers included (~4x capacity lost
on Qwen3.6, where only 10 of 40 layers are full attention).

Only what the engine and our model read is given a default; every other key of ``config.json``
is kept as an attribute by ``PretrainedConfig`` (so nothing in the file is lost).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

TEXT_MODEL_TYPE = "qwen3_5_moe_text"
VISION_MODEL_TYPE = "qwen3_5_moe_vision"
MODEL_TYPE = "qwen3_5_moe"

# vLLM 0.6.3's names for the two layer kinds (only "attention" gets a KV cache).
ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"


class Qwen3_5MoeTextConfig(PretrainedConfig):
    """The language model: hybrid Gated DeltaNet / gated full attention decoder with MoE."""

    model_type = TEXT_MODEL_TYPE
    base_config_key = "text_config"

    def __init__(
        self,
        vocab_size: int = 248_320,
        hidden_size: int = 2048,
        num_hidden_layers: int = 40,
        full_attention_interval: int = 4,
        layer_types: list[str] | None = None,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 2,
        head_dim: int = 256,
        attention_bias: bool = False,
        linear_conv_kernel_dim: int = 4,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        num_experts: int = 256,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 512,
        shared_expert_intermediate_size: int = 512,
        norm_topk_prob: bool = True,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 262_144,
        rope_parameters: dict[str, Any] | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.full_attention_interval = full_attention_interval
        if layer_types is None:
            # Every `full_attention_interval`-th layer (3, 7, ...) is full attention.
            layer_types = [
                "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                for i in range(num_hidden_layers)
            ]
        if len(layer_types) != num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {num_hidden_layers} layers"
            )
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        self.layer_types = list(layer_types)
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.attention_bias = attention_bias
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = dict(
            rope_parameters
            or {
                "rope_type": "default",
                "rope_theta": 10_000_000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            }
        )
        # vLLM 0.6.3 reads `rope_scaling` to size max_model_len (`_get_and_verify_max_len`);
        # ours is plain RoPE in length terms (MRoPE only changes which position each
        # frequency sees), so it must not scale anything.
        kwargs.pop("rope_scaling", None)
        self.rope_scaling = None
        # Flat copies of what the model reads (newer checkpoints also repeat
        # partial_rotary_factor at this level; the rope_parameters value wins).
        rp = self.rope_parameters
        self.rope_theta = float(rp.get("rope_theta", kwargs.pop("rope_theta", 10_000_000)))
        self.partial_rotary_factor = float(
            rp.get("partial_rotary_factor", kwargs.pop("partial_rotary_factor", 1.0))
        )
        kwargs.pop("rope_theta", None)
        kwargs.pop("partial_rotary_factor", None)
        sec = rp.get("mrope_section")
        self.mrope_section = list(sec) if sec else None
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def layers_block_type(self) -> list[str]:
        return [ATTENTION if t == "full_attention" else LINEAR_ATTENTION for t in self.layer_types]


class Qwen3_5MoeVisionConfig(PretrainedConfig):
    """The vision tower's sizes (kept as given; the text path does not read them)."""

    model_type = VISION_MODEL_TYPE
    base_config_key = "vision_config"

    def __init__(
        self,
        depth: int = 27,
        hidden_size: int = 1152,
        num_heads: int = 16,
        intermediate_size: int = 4304,
        hidden_act: str = "gelu_pytorch_tanh",
        in_channels: int = 3,
        patch_size: int = 16,
        spatial_merge_size: int = 2,
        temporal_patch_size: int = 2,
        num_position_embeddings: int = 2304,
        out_hidden_size: int = 2048,
        **kwargs: Any,
    ) -> None:
        self.depth = depth
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.in_channels = in_channels
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.temporal_patch_size = temporal_patch_size
        self.num_position_embeddings = num_position_embeddings
        self.out_hidden_size = out_hidden_size
        super().__init__(**kwargs)


class Qwen3_5MoeConfig(PretrainedConfig):
    """The checkpoint's top-level config: ``text_config`` + ``vision_config`` + token ids."""

    model_type = MODEL_TYPE
    sub_configs = {"text_config": Qwen3_5MoeTextConfig, "vision_config": Qwen3_5MoeVisionConfig}

    def __init__(
        self,
        text_config: dict[str, Any] | Qwen3_5MoeTextConfig | None = None,
        vision_config: dict[str, Any] | Qwen3_5MoeVisionConfig | None = None,
        image_token_id: int = 248_056,
        video_token_id: int = 248_057,
        vision_start_token_id: int = 248_053,
        vision_end_token_id: int = 248_054,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(text_config, dict):
            text_config = Qwen3_5MoeTextConfig(**text_config)
        self.text_config = text_config or Qwen3_5MoeTextConfig()
        if isinstance(vision_config, dict):
            vision_config = Qwen3_5MoeVisionConfig(**vision_config)
        self.vision_config = vision_config or Qwen3_5MoeVisionConfig()
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # vLLM's `_get_and_verify_dtype` reads `torch_dtype` of the text config; newer
        # transformers write the checkpoint dtype as `dtype`, often only at the top level.
        dtype = getattr(self, "torch_dtype", None) or kwargs.get("dtype")
        if getattr(self.text_config, "torch_dtype", None) is None and dtype is not None:
            self.text_config.torch_dtype = dtype
        for cfg in (self, self.text_config):
            # transformers 4.51 turns a string torch_dtype into a torch.dtype only when it is
            # given as `torch_dtype`; vLLM compares it against torch dtypes.
            if isinstance(getattr(cfg, "torch_dtype", None), str):
                import torch

                cfg.torch_dtype = getattr(torch, cfg.torch_dtype)

    @property
    def layers_block_type(self) -> list[str]:
        """Read by vLLM 0.6.3's ``ModelConfig.get_num_attention_layers`` on the top-level
        config: KV is allocated for the ``"attention"`` entries only."""
        return self.text_config.layers_block_type


def register_configs() -> None:
    """Teach ``AutoConfig`` the three model types (idempotent; a transformers that already
    knows ``qwen3_5_moe`` keeps its own classes)."""
    for cls in (Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5MoeVisionConfig):
        try:
            AutoConfig.register(cls.model_type, cls)
        except ValueError:
            pass  # already registered (ours, or a transformers that has the model)
