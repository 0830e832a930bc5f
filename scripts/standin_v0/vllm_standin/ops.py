"""PyTorch stand-ins for the ``torch.ops._C`` kernels that vLLM's own layers call.

On the card, ``vllm._custom_ops`` reaches the vendor's ixformer kernels; the stand-in has no
compiled vLLM at all, so vLLM's ``CustomOp.forward_cuda`` paths (RMSNorm, SiluAndMul, rotary
embedding) would fail on ``torch.ops._C``. These keep the card's call path (forward_cuda ->
``_custom_ops`` -> an in-place op) with plain PyTorch bodies, computed in float32 like the
kernels. An op that something else already defined (ours or a real ``vllm._C``) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_lib: torch.library.Library | None = None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # The kernels round to the activation dtype before the weight, as Hugging Face does.
    return normed.to(x.dtype) * weight


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    out.copy_(_rms(x, weight, epsilon))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    x.copy_(_rms(residual, weight, epsilon))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_((torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(out.dtype))


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool
) -> None:
    """Rotate the first ``2 * cos.shape[-1]`` dims of every head of ``x`` in place."""
    tokens = x.shape[:-1]
    heads = x.view(*tokens, -1, head_size)
    half = cos.shape[-1]
    rot = heads[..., : 2 * half].float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if is_neox:  # halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        x1, x2 = rot[..., :half], rot[..., half:]
        new = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:  # interleaved pairs (GPT-J style)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        new = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    heads[..., : 2 * half] = new.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    cache = cos_sin_cache[positions].float()  # [..., rot_dim]: cos half, then sin half
    half = cache.shape[-1] // 2
    cos, sin = cache[..., :half], cache[..., half:]
    _rotate(query, cos, sin, head_size, is_neox)
    _rotate(key, cos, sin, head_size, is_neox)


# name -> (schema, body); the schemas are those vLLM 0.6.3's _custom_ops calls with.
_OPS: dict[str, tuple[str, Callable[..., None]]] = {
    "rms_norm": (
        "rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()",
        rms_norm,
    ),
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()",
        fused_add_rms_norm,
    ),
    "silu_and_mul": ("silu_and_mul(Tensor! out, Tensor input) -> ()", silu_and_mul),
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor! query, Tensor! key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()",
        rotary_embedding,
    ),
}


def register() -> list[str]:
    """Define the ops that ``torch.ops._C`` lacks; returns the names this call defined."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library("_C", "FRAGMENT")
    defined = []
    for name, (schema, body) in _OPS.items():
        if hasattr(torch.ops._C, name):
            continue
        _lib.define(schema)
        _lib.impl(name, body, "CPU")
        defined.append(name)
    return defined
