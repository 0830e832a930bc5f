"""The vision tower's RoPE takes upstream's PyTorch forward on CUDA too (``VISION_ROPE_NATIVE``):
its CUDA forward is a Triton kernel, which the target card cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Upstream's layer is what is patched: installed in CI, absent on the kernel machine.
pytest.importorskip("vllm.model_executor.layers.rotary_embedding.common")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb  # noqa: E402

from vllm_overrides.native import vision_rope  # noqa: E402


def test_apply_rotary_emb_cuda_forward_is_the_pytorch_one() -> None:
    with set_current_vllm_config(VllmConfig()):
        assert vision_rope.register()
        assert vision_rope.register()  # a second call is a no-op
        # What Qwen2_5_VisionAttention builds: forced on, so CUDA would pick forward_cuda.
        op = ApplyRotaryEmb(enforce_enable=True)
    assert isinstance(op, ApplyRotaryEmb) and type(op).__name__ == "NativeApplyRotaryEmb"
    x = torch.randn(2, 7, 4, 16)
    cos, sin = torch.randn(7, 8), torch.randn(7, 8)
    got = op.forward_cuda(x, cos, sin)  # upstream's imports vllm_flash_attn's Triton rotary
    assert torch.equal(got, ApplyRotaryEmb.forward_static(x, cos, sin, True, False))


def test_engine_registers_it_under_the_switch() -> None:
    code = (
        "from vllm.model_executor.custom_op import op_registry_oot as r\n"
        "import vllm_overrides.engines.v1_0_32.native_switch\n"
        "print(r['ApplyRotaryEmb'].__name__ if 'ApplyRotaryEmb' in r else 'none')\n"
    )
    for flag, want in (("1", "NativeApplyRotaryEmb"), ("0", "none")):
        env = {**os.environ, "VISION_ROPE_NATIVE": flag}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == want
