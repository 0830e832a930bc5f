"""Fixes for vLLM 0.32.0's CPU kernels (the CPU image and the development server only).

``ops.causal_conv1d_fwd_cpu`` wants its input ``x`` ([dim, tokens]) as the transpose of a
contiguous [tokens, dim] tensor: strides exactly (1, dim). A one-token prefill (a one-token
/v1/completions prompt) arrives as a [dim, 1] view of a wider buffer, which PyTorch calls
contiguous, so the kernel raises "expect x to be transposed" inside the engine and the whole
engine dies. Hooked by patch 0002.
"""

from __future__ import annotations

import torch


def conv1d_input_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` with strides (1, dim), copying only when it does not have them already."""
    dim, tokens = x.shape
    if x.stride() == (1, dim):
        return x
    out = torch.empty_strided((dim, tokens), (1, dim), dtype=x.dtype, device=x.device)
    return out.copy_(x)
