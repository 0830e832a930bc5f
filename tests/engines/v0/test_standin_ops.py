"""The stand-in's ``torch.ops._C`` ops (``vllm_standin.ops``) agree with vLLM's own native forms.

On the card ixformer serves these ops behind ``vllm._custom_ops``; on the stand-in our PyTorch
bodies do, and vLLM's layers reach them through ``forward_cuda`` as on the card. The oracle is
each layer's ``forward_native`` (vLLM's pure-PyTorch form of the same op), in float32, for the
shapes that matter: rotary embedding neox and GPT-J style, full and partial (Qwen3.6's 0.25)
rotary at head_dim 256, several heads; RMSNorm with and without the fused residual add.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_standin")

from vllm.model_executor.layers.activation import SiluAndMul  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from vllm_standin import ops  # noqa: E402

ops.register()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_and_fused_add() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    _close(norm.forward_cuda(x.clone()), norm.forward_native(x.clone()))
    got_x, got_res = norm.forward_cuda(x.clone(), residual.clone())
    want_x, want_res = norm.forward_native(x.clone(), residual.clone())
    _close(got_x, want_x)
    _close(got_res, want_res)


def test_silu_and_mul() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 2 * 48)
    act = SiluAndMul()
    _close(act.forward_cuda(x), act.forward_native(x))


@pytest.mark.parametrize("rotary_dim", [256, 64])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding(rotary_dim: int, is_neox: bool) -> None:
    torch.manual_seed(2)
    head, tokens = 256, 9
    rope = RotaryEmbedding(head, rotary_dim, 4096, 10000.0, is_neox, torch.float32)
    positions = torch.tensor([0, 1, 2, 17, 300, 301, 4000, 5, 6])
    q, k = torch.randn(tokens, 4 * head), torch.randn(tokens, 2 * head)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_cuda(positions, q.clone(), k.clone())
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert not torch.equal(got_q, q)  # it did rotate
