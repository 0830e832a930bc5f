"""Fused CUDA C++ kernels for the decode hot paths, with the PyTorch ops as the portable path.

On a Triton-less card the engine runs eager, so every operator is a kernel launch and decode
speed is decided by how few launches a token takes. The extension ``vo_native_kernels``
(sources in ``csrc/``) fuses each hot path into one or two launches:

=====================  ======================================================  ==========
op                     what one call does                                      launches
=====================  ======================================================  ==========
``gdn_decode``         conv-state update + SiLU, q/k L2 norm, gates, the       1
                       delta-rule update of each state in its cache slot, the
                       output (padded / invalid slots skipped)
``rms_norm_gated``     GDN output norm ``rms(x) * w * silu(z)`` per head        1
``gemma_rms_norm``     Qwen ``(1 + w)`` RMSNorm, optionally with the residual   1
                       add fused
``moe_route``          softmax + top-k (ties to the lower expert) + renormalise 1
``moe_decode``         routed experts read in place (no gathered copies):       2
                       gate/up GEMV + SiLU-and-mul, down GEMV + weighted sum;
                       the sigmoid-gated shared expert rides along as one more
                       "expert"
``qk_norm_rope_gate``  gated attention's q/k ``(1 + w)`` RMSNorm + partial     1
                       NeoX RoPE (plain or interleaved MRoPE) + gate copy
=====================  ======================================================  ==========

Selection (``NATIVE_KERNELS``, read at import; :func:`set_backend` for tools and tests):

* ``auto`` (default): the extension when it loads and the tensors are on a CUDA-like device,
  else the PyTorch ops (one log line says which);
* ``cuda``: the extension or an error;
* ``torch``: always the PyTorch ops (:mod:`.gdn`, :mod:`.moe`, :mod:`.rmsnorm`,
  :mod:`.qk_norm_rope`);
* ``emulate`` (tests only): CPU tensors take the fused kernels' own source run on host threads
  (:func:`enable_cpu_emulation`), so a CPU server exercises the engine's calls into them.

The extension comes from the prebuilt wheel (``scripts/build_kernels_wheel.sh``; the image
installs it from ``build-inputs/wheelhouse/``) or, for development, from a JIT build of
``csrc/`` when ``NATIVE_KERNELS_JIT=1``. Every op is a ``torch.ops.vo_kernels`` operator with a
fake (meta) implementation, so it can sit inside traced / compiled code and CUDA graphs.
Each op's contract is exactly its PyTorch path's; ``tests/native/test_cuda_kernels.py`` checks
both against the float64 references.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import gdn, moe, qk_norm_rope, rmsnorm

logger = logging.getLogger("vllm.vllm_overrides.native")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "native_kernels.cu", CSRC / "module.cpp"]
EXT_NAME = "vo_native_kernels"
BACKENDS = ("auto", "cuda", "torch", "emulate")

_mode = os.environ.get("NATIVE_KERNELS", "auto").strip().lower() or "auto"
_loaded: bool | None = None  # None: not tried yet
_emulated = False  # tests: the kernels built for host threads serve CPU tensors
_emulation_built = False
_load_error = ""
_logged: set[str] = set()
# Ops that ran on the fused kernels in this process (the engine logs them with its paths).
FUSED_USED: set[str] = set()


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def _used(op: str) -> None:
    # Eager decode runs this per op per layer: test membership first, it is the cheap part.
    if op not in FUSED_USED and not torch.compiler.is_compiling():
        FUSED_USED.add(op)  # a side effect tracing need not replay


def set_backend(name: str) -> None:
    """Choose ``auto`` / ``cuda`` / ``torch`` for this process (tools and tests)."""
    global _mode
    if name not in BACKENDS:
        raise ValueError(f"NATIVE_KERNELS must be one of {BACKENDS}, not {name!r}")
    _mode = name


def jit_build(verbose: bool = False) -> None:
    """Build and load ``csrc/`` with ``torch.utils.cpp_extension.load`` (development)."""
    from torch.utils.cpp_extension import load

    load(
        name=EXT_NAME,
        sources=[str(s) for s in SOURCES],
        extra_cuda_cflags=["-O3"],
        extra_cflags=["-O3"],
        is_python_module=False,
        verbose=verbose,
    )


def enable_cpu_emulation(warp_size: int = 64) -> None:
    """Tests only: build ``csrc/`` for host threads (``csrc/cpu_emulation.h``) and route CPU
    tensors through the very same kernels and wrappers, with ``warp_size``-lane warps."""
    global _loaded, _emulated, _emulation_built
    if not _emulation_built and _loaded:
        # Both builds register torch.ops.vo_kernels; loading a second one aborts the process.
        raise RuntimeError(
            "the CUDA build of vo_kernels is loaded; emulation needs a process of its own"
        )
    if not _emulation_built:
        from torch.utils.cpp_extension import load

        load(
            name="vo_native_kernels_cpu_emulation",
            sources=[str(CSRC / "cpu_emulation.cpp")],
            extra_cflags=["-O1", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
        )
        _register_fakes()
        _loaded = _emulation_built = True
    _emulated = True
    torch.ops.vo_kernels.emu_set_warp_size(warp_size)


def disable_cpu_emulation() -> None:
    """Tests only: CPU tensors take the PyTorch ops again (the built library stays loaded)."""
    global _emulated
    _emulated = False


def extension_loaded() -> bool:
    """Load the extension once (wheel, else JIT when ``NATIVE_KERNELS_JIT=1``)."""
    global _loaded, _load_error
    if _loaded is None:
        try:
            try:
                import vo_native_kernels  # noqa: F401  (registers torch.ops.vo_kernels)
            except ImportError:
                if os.environ.get("NATIVE_KERNELS_JIT", "0") != "1":
                    raise
                jit_build()
            _loaded = hasattr(torch.ops.vo_kernels, "gdn_decode")
            if _loaded:
                _register_fakes()
            else:
                _load_error = "the library loaded but registered no vo_kernels ops"
        except Exception as e:  # noqa: BLE001 - any failure means "use the PyTorch ops"
            _loaded, _load_error = False, f"{type(e).__name__}: {e}"
    return _loaded


def use_cuda(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve a call on ``x``'s device under the current backend."""
    if _loaded and x.is_cuda and _mode != "torch":  # the eager hot path: one test per op
        return True
    if _mode == "torch":
        return False
    if _mode == "emulate" and not _emulated:
        enable_cpu_emulation()
        _log_once("ext", "NATIVE_KERNELS=emulate: fused kernels on host threads (tests only)")
    if _emulated and x.device.type == "cpu":
        return True
    if x.device.type != "cuda":
        if _mode == "cuda":
            raise RuntimeError("NATIVE_KERNELS=cuda but the tensors are not on a CUDA device")
        return False
    if extension_loaded():
        _log_once("ext", "NATIVE_KERNELS=%s: fused CUDA kernels (vo_native_kernels)", _mode)
        return True
    if _mode == "cuda":
        raise RuntimeError(f"NATIVE_KERNELS=cuda but vo_native_kernels did not load: {_load_error}")
    _log_once("noext", "NATIVE_KERNELS=auto: PyTorch ops (vo_native_kernels: %s)", _load_error)
    return False


def backend_for(x: torch.Tensor) -> str:
    """``"cuda"`` or ``"torch"``: which implementation a call on ``x`` takes."""
    return "cuda" if use_cuda(x) else "torch"


# --------------------------------------------------------------------------------------------
# Ops. Each checks what its kernel supports and otherwise takes the PyTorch path.
# --------------------------------------------------------------------------------------------


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`.rmsnorm.gemma_rms_norm`, or with ``residual`` the fused add
    (:func:`.rmsnorm.gemma_fused_add_rms_norm`, returns ``(out, new_residual)``)."""
    if use_cuda(x) and x.shape[-1] == weight.numel():
        _used("gemma_rms_norm")
        if residual is None:
            return torch.ops.vo_kernels.gemma_rms_norm(x, weight, eps)
        out, res = torch.ops.vo_kernels.gemma_fused_add_rms_norm(x, residual, weight, eps)
        return out, res
    if residual is None:
        return rmsnorm.gemma_rms_norm(x, weight, eps)
    return rmsnorm.gemma_fused_add_rms_norm(x, residual, weight, eps)


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    """:func:`.rmsnorm.rms_norm_gated` (norm over the last dim, ``silu`` or ``sigmoid`` gate)."""
    if use_cuda(x) and activation in ("silu", "swish", "sigmoid") and x.shape == z.shape:
        _used("rms_norm_gated")
        return torch.ops.vo_kernels.rms_norm_gated(x, z, weight, eps, activation == "sigmoid")
    return rmsnorm.rms_norm_gated(x, z, weight, eps, activation)


def gdn_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    scale: float,
    activation: str | bool | None = "silu",
) -> None:
    """One Gated-DeltaNet decode step for ``B`` sequences (one token each), in place.

    Args:
        mixed_qkv: ``[B, 2HK + HV*V]`` projected (pre-conv) ``q|k|v``.
        a, b: ``[B, HV]`` gate inputs.
        conv_state: ``[num_slots, D, W-1]`` (any strides: vLLM's cache transposed is fine).
        conv_weight: ``[D, W]``; conv_bias: ``[D]`` or ``None``.
        A_log, dt_bias: ``[HV]``.
        ssm_state: ``[num_slots, HV, V, K]``.
        out: ``[B, HV, V]`` (written).
        slots: ``[B]`` cache slot per row; ``<= 0`` (null block / padding) rows get zeros and
            leave every state untouched.
        num_k_heads: ``H`` (per rank); ``scale``: ``K ** -0.5``.
    """
    silu = activation is True or activation in ("silu", "swish")
    ok = (
        use_cuda(mixed_qkv)
        and (silu or activation in (None, False))
        and ssm_state.dtype == torch.float32
        and _rows_contiguous(ssm_state)
        and conv_state.dtype == mixed_qkv.dtype
        and a.dtype == b.dtype == mixed_qkv.dtype
        and a.stride(-1) == 1
        and b.stride(-1) == 1
        and mixed_qkv.stride(-1) == 1
        and ssm_state.shape[-1] <= 128
        and out.dtype == mixed_qkv.dtype
        and out.stride(-1) == 1
        and out.stride(-2) == out.shape[-1]
    )
    if ok:
        _used("gdn_decode")
        torch.ops.vo_kernels.gdn_decode(
            mixed_qkv, a, b, conv_state, conv_weight.contiguous(), conv_bias,
            A_log.float(), dt_bias.float(), ssm_state, out, slots.to(torch.int32),
            num_k_heads, scale, silu,
        )  # fmt: skip
        return
    x = gdn.causal_conv1d_decode(mixed_qkv, conv_state, conv_weight, conv_bias, activation, slots)
    gdn.fused_recurrent_gated_delta_rule_packed_decode(
        x, a, b, A_log, dt_bias, scale, ssm_state, out.unsqueeze(1), slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Contiguous within a slot (``[HV, V, K]``); the slot stride may be anything (vLLM pads
    mamba pages to the attention page size) that keeps the rows' 16-byte vector loads aligned."""
    if t.shape[0] == 0:
        return True
    _, _, v, k = t.shape
    s0, s1, s2, s3 = t.stride()
    return (
        s3 == 1
        and s2 == k
        and s1 == v * k
        and t.data_ptr() % 16 == 0
        and (s0 * t.element_size()) % 16 == 0
    )


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.moe.route`: ``(weights [T, k] float32, ids [T, k] int64)``, same tie order."""
    if use_cuda(logits) and logits.shape[-1] <= 1024 and top_k <= logits.shape[-1]:
        _used("moe_route")
        w, ids = torch.ops.vo_kernels.moe_route(logits, top_k, renormalize)
        return w, ids
    return moe.route(logits, top_k, renormalize)


def moe_decode(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Routed experts of a few tokens, plus the shared expert when ``shared`` is given.

    Args:
        x: ``[T, H]``; topk_weights ``[T, k]`` float32; topk_ids ``[T, k]``.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (vLLM's layouts, read in place).
        shared: ``(gate_up [2Is, H], down [H, Is], gate [1, H] or None)``: adds
            ``sigmoid(x gate^T) * down(silu(gate(x)) * up(x))``.

    Returns:
        ``[T, H]`` in ``x.dtype`` (this rank's partial sum, before the all-reduce).
    """
    if use_cuda(x) and _moe_decode_fits(x, w13, w2, shared):
        _used("moe_decode" if shared is None else "moe_decode_with_shared")
        sh_w13 = sh_w2 = sh_gate = None
        if shared is not None:
            sh_w13, sh_w2, sh_gate = shared
        return torch.ops.vo_kernels.moe_decode(
            x, topk_weights.float(), topk_ids, w13, w2, sh_w13, sh_w2, sh_gate
        )
    out = moe.moe_experts_decode(x, topk_weights, topk_ids, w13, w2, "gather")
    if shared is not None:
        out = out + moe.shared_expert(x, *shared)
    return out


def _moe_decode_fits(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
) -> bool:
    """The kernels read 16-byte vectors along ``H`` and ``I``: contiguous, aligned rows."""
    vec = 16 // x.element_size()
    if not (
        x.dim() == 2
        and x.shape[0] <= 64
        and x.is_contiguous()
        and x.data_ptr() % 16 == 0
        and x.shape[1] % vec == 0
    ):
        return False
    weights = [w13, w2] + ([t for t in shared if t is not None] if shared else [])
    # A layer's weights are checked once (the per-token call pays only for x).
    key = (x.dtype, *((t.data_ptr(), t.shape) for t in weights))
    ok = _weights_fit.get(key)
    if ok is None:
        ok = (
            all(t.dtype == x.dtype and t.is_contiguous() for t in weights)
            and all(t.data_ptr() % 16 == 0 for t in weights)
            and w2.shape[2] % vec == 0
            and (shared is None or shared[1].shape[1] % vec == 0)
        )
        _weights_fit[key] = ok
    return ok


_weights_fit: dict[tuple[Any, ...], bool] = {}


def qk_norm_rope_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    mrope_section: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.qk_norm_rope.qk_norm_rope_gate`: ``(q, k, gate)``, one launch where it runs."""
    ok = (
        use_cuda(q_gate)
        and q_gate.dim() == 2
        and k.dim() == 2
        and q_gate.stride(-1) == 1
        and k.stride(-1) == 1
        and k.dtype == q_gate.dtype
        and cos_sin_cache.stride(-1) == 1
        and (positions.dim() == 1 or mrope_section is not None)
    )
    if ok:
        _used("qk_norm_rope_gate")
        sec_h, sec_w = (mrope_section[1], mrope_section[2]) if positions.dim() == 2 else (0, 0)
        q, kk, gate = torch.ops.vo_kernels.qk_norm_rope_gate(
            q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads,
            num_kv_heads, head_dim, rotary_dim, sec_h, sec_w, 1.0,  # norm_beta: (1 + w)
        )  # fmt: skip
        return q, kk, gate
    return qk_norm_rope.qk_norm_rope_gate(
        q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads,
        num_kv_heads, head_dim, rotary_dim, mrope_section,
    )  # fmt: skip


# Fake (meta) implementations: shapes only, for tracing and torch.compile.
def _register_fakes() -> None:
    lib = "vo_kernels::"

    @torch.library.register_fake(lib + "gemma_rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "gemma_fused_add_rms_norm")
    def _(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(lib + "rms_norm_gated")
    def _(
        x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, sigmoid: bool
    ) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "moe_route")
    def _(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        T = logits.shape[0]
        return (
            logits.new_empty(T, top_k, dtype=torch.float32),
            logits.new_empty(T, top_k, dtype=torch.int64),
        )

    @torch.library.register_fake(lib + "moe_decode")
    def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "qk_norm_rope_gate")
    def _(q_gate: torch.Tensor, k: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        T, qw = q_gate.shape[0], q_gate.shape[1] // 2
        return q_gate.new_empty(T, qw), k.new_empty(k.shape), q_gate.new_empty(T, qw)
