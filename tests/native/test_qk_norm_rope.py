"""The PyTorch path of gated attention's q/k prep (``native.qk_norm_rope``) against upstream's
own unfused path: GemmaRMSNorm-style ``(1 + w)`` norms, then vLLM's MRotaryEmbedding
``forward_native`` (interleaved MRoPE, partial rotary) -- bit for bit in float32."""

from __future__ import annotations

import pytest
import torch

# Upstream is the reference: installed in CI, absent on the kernel machine (reason shown there).
pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
# Its API here is vLLM 0.32.0's; under the platform line's 0.6.3 (.venv-v0) the float64
# reference covers this path instead (tests/engines/v0/test_torch21_floor.py).
if not hasattr(pytest.importorskip("vllm.config"), "VllmConfig"):
    pytest.skip("upstream's MRoPE reference here is vLLM 0.32.0's API", allow_module_level=True)
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from vllm_overrides.native import qk_norm_rope, rmsnorm  # noqa: E402


def test_matches_upstream_norm_then_mrope() -> None:
    torch.manual_seed(0)
    T, nq, nkv, D = 5, 2, 1, 64
    params = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2],
              "mrope_interleaved": True, "partial_rotary_factor": 0.25}  # fmt: skip
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_size=D, max_position=512, rope_parameters=params, dtype=torch.float32)
    positions = torch.randint(0, 500, (3, T))
    positions[:, 0] = 7  # a text token: all three rows equal
    q, gate = torch.randn(T, nq, D), torch.randn(T, nq, D)
    k = torch.randn(T, nkv * D)
    qw, kw = torch.randn(D) * 0.1, torch.randn(D) * 0.1
    # Upstream's unfused order: norm each head, then rotate q and k together.
    q_n = rmsnorm.gemma_rms_norm(q, qw, 1e-6).reshape(T, nq * D)
    k_n = rmsnorm.gemma_rms_norm(k.view(T, nkv, D), kw, 1e-6).reshape(T, nkv * D)
    want_q, want_k = rope.forward_native(positions, q_n.clone(), k_n.clone())
    q_gate = torch.stack([q, gate], dim=2).reshape(T, nq * 2 * D)  # per head [q | gate]
    got_q, got_k, got_gate = qk_norm_rope.qk_norm_rope_gate(
        q_gate, k, qw, kw, rope.cos_sin_cache, positions, 1e-6, nq, nkv, D, rope.rotary_dim,
        rope.mrope_section,
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_gate, gate.reshape(T, nq * D))
