"""The platform line: our overlay on vLLM 0.6.3(+corex), the V0 engine of the platform's base."""

from __future__ import annotations

MODEL_ARCH = "Qwen3_5MoeForConditionalGeneration"
MODEL_CLASS = "vllm_overrides.engines.v0.qwen3_5:Qwen3_5MoeForConditionalGeneration"


def register() -> None:
    """vLLM 0.6.3 plugin entry point (``vllm.general_plugins``; runs in the engine process and in
    every worker): teach transformers 4.51.3 the ``qwen3_5_moe`` configs and vLLM's registry our
    model class (lazily, by name, so registering imports no torch model code)."""
    from vllm import ModelRegistry

    from .config import register_configs

    register_configs()
    ModelRegistry.register_model(MODEL_ARCH, MODEL_CLASS)
