"""The vision tower's rotary embedding without Triton.

Qwen3.5/3.6's vision attention (upstream's ``Qwen2_5_VisionAttention``) builds
``ApplyRotaryEmb(enforce_enable=True)``, so on any CUDA platform it runs ``forward_cuda``, which
imports ``vllm.vllm_flash_attn.layers.rotary`` -- a Triton kernel. On a Triton-less card the
first image request would fail inside the engine. ``--compilation-config custom_ops`` cannot
turn it off (``enforce_enable`` wins), so we use vLLM's out-of-tree op registry instead of a
patch: ``CustomOp.register_oot`` makes every ``ApplyRotaryEmb(...)`` an instance of our
subclass, whose ``forward_cuda`` is upstream's own ``forward_native`` (plain PyTorch).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.vllm_overrides.native")


def register() -> bool:
    """Register the subclass (once per process). Returns whether it is registered."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    if "ApplyRotaryEmb" in op_registry_oot:
        return op_registry_oot["ApplyRotaryEmb"].__name__ == "NativeApplyRotaryEmb"

    @CustomOp.register_oot(name="ApplyRotaryEmb")
    class NativeApplyRotaryEmb(ApplyRotaryEmb):
        """``ApplyRotaryEmb`` whose CUDA path is upstream's PyTorch one (no Triton)."""

        def forward_cuda(
            self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> torch.Tensor:
            return self.forward_native(x, cos, sin)

    logger.info("VISION_ROPE_NATIVE: vision RoPE (ApplyRotaryEmb) runs its PyTorch forward")
    return True
