"""Fixes for vLLM 0.32.0's CPU kernels (the CPU image and the development server only).

``ops.causal_conv1d_fwd_cpu`` wants its input ``x`` ([dim, tokens]) as the transpose of a
contiguous [tokens, dim] tensor: strides exactly (1, dim). A one-token prefill (a one-token
/v1/completions prompt) arrives as a [dim, 1] view of a wider buffer, which PyTorch calls
contiguous, so the kernel raises "expect x to be transposed" inside the engine and the whole
engine dies. Hooked by patch 0002.

``flush_denormals_on_all_threads``: the native Gated-DeltaNet path on CPU turns on
flush-to-zero in every compute thread (no patch: called from ``native_switch``).
"""

from __future__ import annotations

import ctypes
import os

import torch


def conv1d_input_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` with strides (1, dim), copying only when it does not have them already."""
    dim, tokens = x.shape
    if x.stride() == (1, dim):
        return x
    out = torch.empty_strided((dim, tokens), (1, dim), dtype=x.dtype, device=x.device)
    return out.copy_(x)


_GOMP_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*fn)(void *data)


def flush_denormals_on_all_threads() -> bool:
    """Flush denormal floats to zero (x86 FTZ + DAZ) on this thread and on every thread of
    torch's OpenMP pool; returns whether every thread accepted it.

    Why: Gated-DeltaNet heads with strong decay (``exp(A_log)`` near 16, as in Qwen's
    initialisation and in trained checkpoints) drive ``exp(G)`` products below 1.2e-38. x86
    cores compute on such denormal floats through microcode assists, ~100x slower: the native
    chunked prefill took 340 ms per layer at 2,000 tokens instead of 26 ms. The values carry
    no information at float32 precision (GPUs flush them in their fast paths too).

    ``torch.set_flush_denormal`` sets only the calling thread's MXCSR; OpenMP workers keep
    their own (threads created later inherit the creator's). So one OpenMP parallel region of
    the pool's size runs ``torch.set_flush_denormal`` on each thread, through libgomp's
    ``GOMP_parallel`` entry point (torch's CPU builds use libgomp).
    """
    ok = torch.set_flush_denormal(True)
    gomp = _loaded_libgomp()
    if gomp is None:
        return False
    results: list[bool] = []

    def on_thread(_: int | None) -> None:
        results.append(torch.set_flush_denormal(True))

    callback = _GOMP_FN(on_thread)
    gomp.GOMP_parallel.argtypes = [_GOMP_FN, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel.restype = None
    gomp.GOMP_parallel(callback, None, torch.get_num_threads(), 0)
    return ok and len(results) == torch.get_num_threads() and all(results)


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp torch runs its OpenMP pool on: the copy in ``torch/lib`` if loaded (other
    wheels load private copies beside it), else the only one loaded; None if unknown."""
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib") + os.sep
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    ours = [p for p in paths if p.startswith(torch_lib)]
    if ours:
        return ctypes.CDLL(ours[0])
    return ctypes.CDLL(paths.pop()) if len(paths) == 1 else None
