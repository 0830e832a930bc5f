"""Fused CUDA C++ kernels for the decode hot paths, with the PyTorch ops as the portable path.

On a Triton-less card the engine runs eager, so every operator is a kernel launch and decode
speed is decided by how few launches a token takes. The extension ``vo_native_kernels``
(sources in ``csrc/``) fuses each hot path into one or two launches:

=====================  ======================================================  ==========
op                     what one call does                                      launches
=====================  ======================================================  ==========
``gdn_decode``         conv-state update + SiLU, q/k L2 norm, gates, the       1
                       delta-rule update of each state in its cache slot, the
                       output (padded / invalid slots skipped); with ``z`` the
                       layer's gated output norm too
``gdn_conv_prep``      prefill causal conv1d (varlen, conv states in place) +   2
                       post-conv prep: q/k L2 norm, v, gates ``g``, ``beta``
``gdn_chunk_prefill``  chunked gated delta rule over packed varlen             4
                       sequences (:func:`chunk_gated_delta_rule`): chunk
                       offsets, intra-chunk WY solve, per-sequence state pass,
                       output; q/k L2 norm fused
``dense_linear``       ``x @ W^T`` for a decode step's row: a GEMV streaming    1
                       the weight once (the op takes <= 8 rows; other shapes,
                       dtypes and layouts: ``at::linear``)
``rms_norm_gated``     GDN output norm ``rms(x) * w * silu(z)`` per head        1
``gemma_rms_norm``     Qwen ``(1 + w)`` RMSNorm, optionally with the residual   1
                       add fused
``moe_route``          softmax + top-k (ties to the lower expert) + renormalise 1
``moe_decode``         routed experts read in place (no gathered copies):       2
                       gate/up GEMV + SiLU-and-mul, down GEMV + weighted sum;
                       the sigmoid-gated shared expert rides along as one more
                       "expert"
``moe_decode_routed``  ``moe_route`` + ``moe_decode``: the up kernel routes     2
                       its token itself
``qk_norm_rope_gate``  gated attention's q/k ``(1 + w)`` RMSNorm + partial     1
                       NeoX RoPE (plain or interleaved MRoPE) + gate copy
``paged_write_kv``     new keys / values into the paged cache (pad slots        1
                       skipped on the device: no host sync)
``paged_decode``       one token per sequence over its paged context, split     1 (+ 1)
                       over the context, one log-sum-exp combine (none when
                       one partition covers it)
``paged_prefill``      a chunk of new tokens over its cached context, causal    1
                       in the chunk, varlen, online softmax (float32 FMA tiles)
``moe_prefill``        routing + expert counts, token rows into expert order,   4 + GEMMs
                       SiLU-and-mul x routing weight, the combine back to token
                       order with the gated shared expert added; the expert
                       GEMMs ``torch._grouped_mm`` where the device has it,
                       else our grouped GEMMs (``moe_grouped_gemm``, wmma:      5
                       gate/up gathers x's rows itself, SiLU-and-mul x weight
                       in its epilogue; no host sync), else per-expert ``mm``
=====================  ======================================================  ==========

Selection (``NATIVE_KERNELS``, read at import; :func:`set_backend` for tools and tests):

* ``auto`` (default): the extension when it loads and the tensors are on a CUDA-like device,
  else the PyTorch ops (one log line says which);
* ``cuda``: the extension or an error;
* ``torch``: always the PyTorch ops (:mod:`.gdn`, :mod:`.moe`, :mod:`.rmsnorm`,
  :mod:`.qk_norm_rope`);
* ``emulate`` (tests only): CPU tensors take the fused kernels' own source run on host threads
  (:func:`enable_cpu_emulation`), so a CPU server exercises the engine's calls into them.

No op changes path silently: the first call of each op on each path (``fused``, ``emulated``,
``torch``) logs one line naming the op family, the path and, for the PyTorch path, why
(:func:`note_path`; :data:`PATHS` holds what ran). ``tests/engines/v0/test_torch21_floor.py``
fails if the kernels load but an op family does not run on them. A library without some
family's ops (the image's kernels step leaves out a source its compiler refuses or does not
finish: ``scripts/image_kernels.py``) serves the other families; the ops it lacks
(:data:`LIB_OPS`) take their PyTorch path, and their log line says the library was built
without them.

The extension comes from the prebuilt wheel (``scripts/build_kernels_wheel.sh``; the image
installs it from ``build-inputs/wheelhouse/``) or, for development, from a JIT build of
``csrc/`` when ``NATIVE_KERNELS_JIT=1``. Every op is a ``torch.ops.vo_kernels`` operator with a
fake (meta) implementation where torch has the API for one (2.2+: :mod:`.torch_compat`), so it
can sit inside traced / compiled code and CUDA graphs; on the card's torch 2.1 (eager only) the
ops load and run without fakes.
Each op's contract is exactly its PyTorch path's; ``tests/native/test_cuda_kernels.py`` checks
both against the float64 references.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import gdn, moe, qk_norm_rope, rmsnorm, torch_compat
from . import paged_attention as pa

logger = logging.getLogger("vllm.vllm_overrides.native")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [*sorted(CSRC.glob("*.cu")), CSRC / "module.cpp"]
EXT_NAME = "vo_native_kernels"
# JIT builds are named per checkout: torch keeps one build directory per name, and two checkouts
# (a clean-clone CI beside a working tree) rebuilding one directory in turn can load each
# other's library -- a test then passes on sources it never built.
_CHECKOUT_TAG = hashlib.sha1(str(CSRC).encode()).hexdigest()[:8]
BACKENDS = ("auto", "cuda", "torch", "emulate")

_mode = os.environ.get("NATIVE_KERNELS", "auto").strip().lower() or "auto"
# The fused GDN chunk prefill is opt-in (GDN_CHUNK_KERNEL=fused; the YAML sets it): its first,
# float32-FMA version lost to the PyTorch path on the H200 (11.9 vs 2.2 ms at T=16K, TP4); the
# tensor-core version beats it (worklogs/LEDGER.md, issue 15), but no target card has run it.
GDN_CHUNK_FUSED = os.environ.get("GDN_CHUNK_KERNEL", "torch").strip().lower() == "fused"
# The routed experts' GEMMs in MoE prefill when the caller says "auto": torch._grouped_mm where
# the device has it (on the H200 it beats our own in bf16: LEDGER, issue 15), else our grouped
# GEMMs (csrc/moe_grouped_gemm.cu) where they fit -- the target's torch 2.1 has no _grouped_mm,
# and the alternative, one GEMM per expert after a host sync, is ~8x slower -- else that loop.
# fp16 takes ours even where _grouped_mm runs: torch 2.11 runs fp16 through a GEMM per group,
# a 16K prefill step 4.3x slower than ours on the H200 (LEDGER, session of 2026-12-05 18:29).
# MOE_PREFILL_GEMM=grouped|loop|wmma forces one (the benchmarks' A/B switch).
MOE_PREFILL_GEMM = os.environ.get("MOE_PREFILL_GEMM", "auto").strip().lower() or "auto"
if MOE_PREFILL_GEMM not in ("auto", "grouped", "loop", "wmma"):
    raise ValueError(f"MOE_PREFILL_GEMM: auto, grouped, loop or wmma, not {MOE_PREFILL_GEMM!r}")
_grouped_gemm_ok = True  # False once the device refused the kernel's launch
_loaded: bool | None = None  # None: not tried yet
_emulated = False  # tests: the kernels built for host threads serve CPU tensors
_emulation_built = False
_load_error = ""
_logged: set[str] = set()
# Ops that ran on the fused kernels in this process (the engine logs them with its paths).
FUSED_USED: set[str] = set()
# Ops that ran on their PyTorch path in this process.
TORCH_USED: set[str] = set()

# What the log calls each op (the families of the table above; paged attention's selector
# reports through note_path too). "_with_shared" variants share their op's name.
OP_FAMILIES = {
    "gemma_rms_norm": "RMSNorm (1 + w)",
    "rms_norm_gated": "gated RMSNorm (GDN output)",
    "dense_linear": "dense linear (decode GEMV)",
    "gdn_decode": "GDN decode",
    "gdn_conv_prep": "GDN prefill conv + prep",
    "gdn_chunk_prefill": "GDN prefill chunk rule",
    "moe_route": "MoE route",
    "moe_decode": "MoE decode",
    "moe_decode_routed": "MoE decode (routed in kernel)",
    "moe_prefill": "MoE prefill",
    "moe_grouped_gemm": "MoE prefill expert GEMMs (our grouped GEMM)",
    "qk_norm_rope_gate": "qk-norm-rope",
    "paged_attention": "paged attention",
    "paged_write_kv": "paged attention KV write",
    "paged_decode": "paged attention decode",
    "paged_prefill": "paged attention prefill",
}
# The library ops each selector op calls. Each kernel source (csrc/<family>.cu) registers its
# own; a library built without some source (the image's kernels step leaves out one that its
# compiler refuses or does not finish) serves the others, and an op whose library ops are
# missing takes its PyTorch path, logged once with why.
LIB_OPS: dict[str, tuple[str, ...]] = {
    "gemma_rms_norm": ("gemma_rms_norm", "gemma_fused_add_rms_norm"),
    "rms_norm_gated": ("rms_norm_gated",),
    "dense_linear": ("dense_linear",),
    "gdn_decode": ("gdn_decode",),
    "gdn_conv_prep": ("gdn_conv_prep",),
    "gdn_chunk_prefill": ("gdn_chunk_prefill",),
    "moe_route": ("moe_route",),
    "moe_decode": ("moe_decode",),
    "moe_decode_routed": ("moe_decode_routed",),
    "moe_prefill": ("moe_route_count", "moe_permute", "moe_order", "moe_act", "moe_combine"),
    "moe_grouped_gemm": ("moe_grouped_gemm",),
    "qk_norm_rope_gate": ("qk_norm_rope_gate",),
    "paged_write_kv": ("paged_write_kv",),
    "paged_decode": ("paged_decode",),
    "paged_prefill": ("paged_prefill",),
}
_has: dict[str, bool] = {}  # op -> whether the loaded library registers its LIB_OPS
# Every (op, path) that ran in this process: "fused" (the CUDA extension), "emulated" (the
# kernels on host threads, tests only) or "torch" (the PyTorch ops). One log line each.
PATHS: dict[str, set[str]] = {}
_PATH_WORDS = {
    "fused": "fused kernel (vo_native_kernels)",
    "emulated": "fused kernel emulated on host threads (NATIVE_KERNELS=emulate, tests only)",
    "torch": "PyTorch ops",
}


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def note_path(op: str, path: str, why: str = "") -> None:
    """Record that ``op`` ran on ``path`` (``fused`` / ``emulated`` / ``torch``) and log it the
    first time: no op family changes path silently."""
    paths = PATHS.setdefault(op, set())
    if path in paths:
        return
    paths.add(path)
    name = OP_FAMILIES.get(op.removesuffix("_with_shared"), op)
    logger.info(
        "native op %s [%s]: %s%s", name, op, _PATH_WORDS.get(path, path), f" ({why})" if why else ""
    )


def _used(op: str) -> None:
    # Eager decode runs this per op per layer: test membership first, it is the cheap part.
    if op not in FUSED_USED and not torch_compat.is_compiling():
        FUSED_USED.add(op)  # a side effect tracing need not replay
        note_path(op, "emulated" if _emulated else "fused")


def _torch_used(op: str, x: torch.Tensor, why: str = "") -> None:
    """``op`` took its PyTorch path on ``x`` (logged once per op, with the reason)."""
    if op not in TORCH_USED and not torch_compat.is_compiling():
        TORCH_USED.add(op)
        note_path(op, "torch", why or _why_torch(x, op))


def _log_plan(op: str, describe: Any) -> None:
    """Log once which variant of ``op``'s kernels runs here and the shared memory each block
    asks for (``describe()`` asks the library: the choice follows what the device reports,
    its opt-in shared memory per block capped by ``VO_SMEM_LIMIT``, and ``VO_KERNELS_WMMA``)."""
    key = "plan:" + op
    if key in _logged or torch_compat.is_compiling():
        return
    try:
        text = describe()
    except (RuntimeError, AttributeError) as e:  # a library without the plan op
        text = f"unknown ({e})"
    _log_once(key, "native op %s [%s]: %s", OP_FAMILIES.get(op, op), op, text)


def _lib_has(name: str) -> bool:
    """Whether the loaded library registers ``torch.ops.vo_kernels.<name>`` (a test seam)."""
    return hasattr(torch.ops.vo_kernels, name)


def has_ops(op: str) -> bool:
    """Whether the loaded library has what selector op ``op`` calls (:data:`LIB_OPS`); asked
    only once a library serves (checked once per op: eager decode asks every layer)."""
    ok = _has.get(op)
    if ok is None:
        ok = _has[op] = all(_lib_has(name) for name in LIB_OPS[op])
    return ok


def _fused(op: str, x: torch.Tensor) -> bool:
    """:func:`use_cuda` for ``x`` and the library has ``op``'s kernels."""
    return use_cuda(x) and has_ops(op)


def _why_torch(x: torch.Tensor, op: str = "") -> str:
    if _mode == "torch":
        return "NATIVE_KERNELS=torch"
    if (_loaded and x.is_cuda) or (_emulated and x.device.type == "cpu"):
        if op in LIB_OPS and not has_ops(op):
            missing = [name for name in LIB_OPS[op] if not _lib_has(name)]
            return (
                f"vo_native_kernels was built without {', '.join(missing)} "
                "(its source left out: the kernels build report says why)"
            )
        return "the kernel does not take these shapes, dtypes or layouts"
    if x.device.type != "cuda" and not _emulated:
        return f"tensors on {x.device.type}"
    if x.device.type != "cuda":
        return f"the emulation serves CPU tensors, not {x.device.type}"
    return f"vo_native_kernels not loaded: {_load_error or 'not tried'}"


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
        name=f"{EXT_NAME}_{_CHECKOUT_TAG}",
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
            name=f"vo_native_kernels_cpu_emulation_{_CHECKOUT_TAG}",
            sources=[str(CSRC / "cpu_emulation.cpp")],
            extra_cflags=["-O1", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
        )
        _loaded = _emulation_built = True
        _fakes()
    _emulated = True
    torch.ops.vo_kernels.emu_set_warp_size(warp_size)


def _fakes() -> None:
    """Register the ops' fake implementations where torch can (:mod:`.torch_compat`). They only
    serve tracing, compile and CUDA graphs: a torch without the API (2.1, the card's) or a
    failed registration leaves the loaded ops in use for eager calls, with one log line."""
    if torch_compat.FAKE_API == "none":
        logger.info(
            "vo_kernels: torch %s has no fake-op API; the ops run eager only (no tracing)",
            torch.__version__,
        )
        return
    try:
        _register_fakes()
    except Exception as e:  # noqa: BLE001 - eager calls do not need the fakes
        logger.warning("vo_kernels: fake implementations not registered (eager only): %s", e)


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
            # Any family's ops: a library built without some sources serves the others.
            _has.clear()
            _loaded = any(_lib_has(name) for names in LIB_OPS.values() for name in names)
            if _loaded:
                _fakes()
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
    if _fused("gemma_rms_norm", x) and x.shape[-1] == weight.numel():
        _used("gemma_rms_norm")
        if residual is None:
            return torch.ops.vo_kernels.gemma_rms_norm(x, weight, eps)
        out, res = torch.ops.vo_kernels.gemma_fused_add_rms_norm(x, residual, weight, eps)
        return out, res
    _torch_used("gemma_rms_norm", x)
    if residual is None:
        return rmsnorm.gemma_rms_norm(x, weight, eps)
    return rmsnorm.gemma_fused_add_rms_norm(x, residual, weight, eps)


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    """:func:`.rmsnorm.rms_norm_gated` (norm over the last dim, ``silu`` or ``sigmoid`` gate)."""
    if (
        _fused("rms_norm_gated", x)
        and activation in ("silu", "swish", "sigmoid")
        and x.shape == z.shape
    ):
        _used("rms_norm_gated")
        return torch.ops.vo_kernels.rms_norm_gated(x, z, weight, eps, activation == "sigmoid")
    _torch_used("rms_norm_gated", x)
    return rmsnorm.rms_norm_gated(x, z, weight, eps, activation)


# Rows that take the decode GEMV; more go to F.linear. One: at M = 1 the GEMV's GPU time
# matches cuBLAS at every decode shape while its host cost is ~13 instead of ~20 us, but at
# M = 4 / 8 cuBLAS's GPU time is 2-4x lower (worklogs/remote_scripts/gemv_probe.py, LEDGER).
# The platform drives one request at a time, so decode steps are M = 1. The op itself takes
# up to 8 rows (tests run them).
GEMV_MAX_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; a 2-D ``x`` of at most :data:`GEMV_MAX_ROWS` rows (a decode step's tokens)
    without bias goes to the decode GEMV where the fused kernels serve (one plain launch
    instead of cuBLAS's host cost; the op itself hands other dtypes and layouts to
    ``at::linear``)."""
    decode_row = bias is None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
    if decode_row and _fused("dense_linear", x):
        _used("dense_linear")
        return torch.ops.vo_kernels.dense_linear(x, weight)
    _torch_used("dense_linear", x, "" if decode_row else "F.linear: not a bias-free decode row")
    return F.linear(x, weight, bias)


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
    z: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_activation: str = "silu",
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
        z, norm_weight: with both, ``out`` gets the layer's gated output norm applied,
            ``rms_norm_gated(o, z, norm_weight, norm_eps, norm_activation)`` with ``z``
            ``[B, HV, V]`` -- in the same launch on the fused kernels.
    """
    silu = gdn.is_silu(activation)
    norm = z is not None and norm_weight is not None
    ok = (
        _fused("gdn_decode", mixed_qkv)
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
        and (
            not norm
            or (
                norm_activation in ("silu", "swish", "sigmoid")
                and z.dtype == norm_weight.dtype == out.dtype
                and z.shape[1:] == out.shape[1:]
                and z.shape[0] >= mixed_qkv.shape[0]
                and z.stride(-1) == 1
            )
        )
    )
    if ok:
        _used("gdn_decode")
        torch.ops.vo_kernels.gdn_decode(
            mixed_qkv, a, b, conv_state, conv_weight.contiguous(), conv_bias,
            A_log.float(), dt_bias.float(), ssm_state, out, slots.to(torch.int32),
            num_k_heads, scale, silu, z if norm else None,
            norm_weight.contiguous() if norm else None, norm_eps, norm_activation == "sigmoid",
        )  # fmt: skip
        return
    _torch_used("gdn_decode", mixed_qkv)
    x = gdn.causal_conv1d_decode(mixed_qkv, conv_state, conv_weight, conv_bias, activation, slots)
    gdn.fused_recurrent_gated_delta_rule_packed_decode(
        x, a, b, A_log, dt_bias, scale, ssm_state, out.unsqueeze(1), slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    if norm:
        out.copy_(rms_norm_gated(out, z[: out.shape[0]], norm_weight, norm_eps, norm_activation))


def gdn_conv_prep(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    activation: str | bool | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    apply_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.gdn.causal_conv1d_prefill` then :func:`.gdn.post_conv_prep` (same arguments,
    results and in-place conv-state update): two launches where the extension serves, else
    those two functions. Returns ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``."""
    silu = gdn.is_silu(activation)
    nv = 16 // x.element_size()
    ok = (
        _fused("gdn_conv_prep", x)
        and (silu or activation in (None, False))
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * x.element_size()) % 16 == 0
        and head_k_dim % nv == 0
        and head_v_dim % nv == 0
        and weight.dim() == 2
        and weight.shape[1] == 4  # the kernel's conv width (Qwen3.5 / 3.6)
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and (bias is None or (bias.is_contiguous() and bias.data_ptr() % 16 == 0))
        and conv_states.dtype == a.dtype == b.dtype == weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and a.stride(-1) == 1
        and b.stride(-1) == 1
        and a.shape[-1] <= 256
    )
    if not ok:
        _torch_used("gdn_conv_prep", x)
        out = gdn.causal_conv1d_prefill(
            x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
            activation,
        )  # fmt: skip
        return gdn.post_conv_prep(
            out, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm
        )
    _used("gdn_conv_prep")
    return torch.ops.vo_kernels.gdn_conv_prep(
        x, weight, bias, conv_states, query_start_loc,
        cache_indices.to(torch.long), has_initial_state, silu, a, b, A_log.float(),
        dt_bias.float(), num_k_heads, head_k_dim, head_v_dim, apply_l2norm, gdn.PAD_SLOT_ID,
    )  # fmt: skip


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    core_attn_out: torch.Tensor | None = None,
    layout: gdn.ChunkLayout | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`.gdn.chunk_gated_delta_rule` (same arguments, layouts and results): the fused
    launches where ``GDN_CHUNK_KERNEL=fused`` (:data:`GDN_CHUNK_FUSED`) and the kernels support
    the shapes, else the PyTorch path.

    ``chunk_indices`` / ``chunk_offsets`` / ``layout`` only matter to the PyTorch path (the
    kernels derive the chunk grid from ``cu_seqlens`` on the device, without a host sync);
    ``kw`` (``tri_solve``, ``tf32``) is passed to it unchanged.
    """
    global GDN_CHUNK_FUSED  # cleared when the device refuses the kernel (below)

    def torch_path() -> tuple[torch.Tensor, torch.Tensor | None]:
        why = "" if GDN_CHUNK_FUSED else "GDN_CHUNK_KERNEL is not 'fused', or the device refused it"
        _torch_used("gdn_chunk_prefill", q, why)
        return gdn.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            chunk_indices, chunk_offsets, use_qk_l2norm_in_kernel, core_attn_out, layout, **kw,
        )  # fmt: skip

    B_, T_ = q.shape[0], q.shape[1]
    ok = (
        GDN_CHUNK_FUSED
        and _fused("gdn_chunk_prefill", q)
        and q.dim() == 4
        and k.shape == q.shape
        and v.dim() == 4
        and v.shape[:2] == q.shape[:2]
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and k.dtype == v.dtype == q.dtype
        and v.shape[2] % q.shape[2] == 0
        and q.shape[3] in (32, 64, 128)
        and v.shape[3] in (32, 64, 128)
        and (cu_seqlens is None or B_ == 1)
        and (initial_state is None or initial_state.shape[1:] == (*v.shape[2:], q.shape[3]))
    )
    if not ok:
        return torch_path()
    _used("gdn_chunk_prefill")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    Ttot = B_ * T_
    if cu_seqlens is None:  # B equal-length rows
        cu = torch.arange(B_ + 1, device=q.device, dtype=torch.long) * T_
    else:
        cu = cu_seqlens.to(q.device)
    h0 = None if initial_state is None else initial_state.to(torch.float32)
    try:
        o, final = _gdn_chunk_op(
            q.reshape(Ttot, H, K), k.reshape(Ttot, H, K), v.reshape(Ttot, HV, V),
            g.reshape(Ttot, HV).float(), beta.reshape(Ttot, HV).float(), cu, h0,
            K**-0.5 if scale is None else scale, use_qk_l2norm_in_kernel, 0,
        )  # fmt: skip
    except RuntimeError as e:
        # A device that refuses the kernels' launch configuration (its shared memory or
        # registers per block fall short) must not fail requests: the PyTorch path serves
        # this and every later call of the process.
        GDN_CHUNK_FUSED = False
        logger.warning("GDN chunk prefill kernel failed, PyTorch path from now on: %s", e)
        return torch_path()
    _log_plan("gdn_chunk_prefill", lambda: torch.ops.vo_kernels.gdn_chunk_plan(q, K, V))
    if core_attn_out is not None:
        core_attn_out[:Ttot].copy_(o)
    return o.view(B_, T_, HV, V), (final if output_final_state else None)


def _gdn_chunk_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op (a seam for the fallback test)."""
    return torch.ops.vo_kernels.gdn_chunk_prefill(*args)


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
    # The kernel's lane groups hold up to 16 picks (Qwen3.5 / 3.6 route to 8 of 256).
    if (
        _fused("moe_route", logits)
        and logits.shape[-1] <= 1024
        and 1 <= top_k <= min(logits.shape[-1], 16)
    ):
        _used("moe_route")
        w, ids = torch.ops.vo_kernels.moe_route(logits, top_k, renormalize)
        return w, ids
    _torch_used("moe_route", logits)
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
    if _fused("moe_decode", x) and _moe_decode_fits(x, w13, w2, shared):
        _used("moe_decode" if shared is None else "moe_decode_with_shared")
        sh_w13 = sh_w2 = sh_gate = None
        if shared is not None:
            sh_w13, sh_w2, sh_gate = shared
        return torch.ops.vo_kernels.moe_decode(
            x, topk_weights.float(), topk_ids, w13, w2, sh_w13, sh_w2, sh_gate
        )
    _torch_used("moe_decode", x)
    out = moe.moe_experts_decode(x, topk_weights, topk_ids, w13, w2, "gather")
    if shared is not None:
        out = out + moe.shared_expert(x, *shared)
    return out


# Routing inside the up kernel pays off for a few tokens only: every up block routes its token
# again (H200, one TP4 rank's decode step: B=1 graph 3.93 vs 3.99 ms and eager 10.8 vs 16.3 ms
# against the separate routing launch; B=32 graph 13.8 ms against 9.5 ms).
MOE_ROUTED_MAX_TOKENS = 4


def moe_decode_routed(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """:func:`moe_route` + :func:`moe_decode` in two launches instead of three for up to
    :data:`MOE_ROUTED_MAX_TOKENS` tokens: the up kernel routes each block's token itself (the
    same arithmetic as ``moe_route``, so the same experts, weights and results). Eager decode is
    launch-bound; this is one launch fewer per layer. More tokens take the two ops."""
    E = w13.shape[0]
    if (
        x.shape[0] <= MOE_ROUTED_MAX_TOKENS
        and _fused("moe_decode_routed", x)
        and _moe_decode_fits(x, w13, w2, shared)
        and router_logits.dim() == 2
        and router_logits.shape == (x.shape[0], E)
        and router_logits.stride(1) == 1
        and router_logits.dtype == x.dtype
        and E <= 1024
        and 1 <= top_k <= min(E, 16)
    ):
        _used("moe_decode_routed")
        sh_w13, sh_w2, sh_gate = shared if shared is not None else (None, None, None)
        out, _, _ = torch.ops.vo_kernels.moe_decode_routed(
            x, router_logits, top_k, renormalize, w13, w2, sh_w13, sh_w2, sh_gate
        )
        return out
    topk_w, topk_ids = moe_route(router_logits, top_k, renormalize)
    return moe_decode(x, topk_w, topk_ids, w13, w2, shared)


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
    # A layer's weights are checked once (the per-token call pays only for x), keyed by their
    # addresses: shapes would cost eager decode ~2 us a layer to key on, and a stale entry
    # (another tensor at a freed address) can only make the op's own checks raise.
    key = (
        x.dtype,
        w13.data_ptr(),
        w2.data_ptr(),
        None if shared is None else tuple(t.data_ptr() for t in shared if t is not None),
    )
    ok = _weights_fit.get(key)
    if ok is None:
        weights = [w13, w2] + ([t for t in shared if t is not None] if shared else [])
        ok = (
            all(t.dtype == x.dtype and t.is_contiguous() for t in weights)
            and all(t.data_ptr() % 16 == 0 for t in weights)
            and w2.shape[2] % vec == 0
            and (shared is None or shared[1].shape[1] % vec == 0)
        )
        _weights_fit[key] = ok
    return ok


_weights_fit: dict[tuple[Any, ...], bool] = {}


def moe_prefill(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """Routed experts of a large batch from the router logits, plus the shared expert when
    ``shared`` is given: :func:`.moe.route` + :func:`.moe.moe_experts_prefill` (+
    :func:`.moe.shared_expert`), same results up to rounding.

    Fused: route + expert counts (1 launch + a memset), rows into expert order (1), the two
    expert GEMMs -- ``torch._grouped_mm`` where the device has it (``method="grouped"``), else
    one GEMM per non-empty expert slice after one host sync (``"loop"``, what a device without
    grouped GEMM runs) -- with SiLU-and-mul x routing weight between them (1), and one weighted
    combine back to token order that also adds the gated shared expert (1). ``"wmma"``: our
    own grouped GEMMs instead (``moe_grouped_gemm``, tensor cores through wmma): the expert
    order without moving rows (1), gate/up reading x's rows in place with SiLU-and-mul x
    routing weight in its epilogue (1), down (1); no host sync and no grouped-GEMM library,
    for 16-bit weights of fitting shapes (else ``"auto"``'s choice serves).

    Args:
        x: ``[T, H]``; router_logits: ``[T, E]``.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (vLLM's layouts, read in place).
        shared: ``(gate_up [2Is, H], down [H, Is], gate [1, H] or None)``.
        method: ``"grouped"``, ``"loop"``, ``"wmma"`` or ``"auto"`` (:data:`MOE_PREFILL_GEMM`
            if set, else grouped where it runs and x is not fp16, else wmma where it fits,
            else the library's choice).

    Returns:
        ``[T, H]`` in ``x.dtype`` (this rank's partial sum, before the all-reduce).
    """
    global _grouped_gemm_ok
    library = "grouped" if moe.grouped_mm_available(x.device, x.dtype) else "loop"
    fused = _fused("moe_prefill", x) and _moe_prefill_fits(x, router_logits, w13, w2, shared, top_k)
    wmma_ok = fused and _grouped_gemm_ok and _grouped_gemm_fits(x, w13, w2)
    if wmma_ok and not has_ops("moe_grouped_gemm"):  # its source left out of the library
        _torch_used("moe_grouped_gemm", x)
        wmma_ok = False
    if method == "auto":
        method = MOE_PREFILL_GEMM
    if method == "auto":  # see MOE_PREFILL_GEMM
        ours = library == "loop" or x.dtype == torch.float16
        method = "wmma" if ours and wmma_ok else library
    if method == "wmma" and not wmma_ok:
        method = library
    if method == "grouped" and library != "grouped":  # forced where it does not run (torch 2.1)
        _log_once("no-grouped", "MoE prefill: torch._grouped_mm does not run here, expert loop")
        method = "loop"
    if fused:
        _used("moe_prefill" if shared is None else "moe_prefill_with_shared")
        ops = torch.ops.vo_kernels
        w, ids, counts, slot = ops.moe_route_count(router_logits, top_k, renormalize)
        y = None
        if method == "wmma":  # our grouped GEMMs: x's rows gathered in place, no host sync
            src, ws, inverse, ends, tiles = ops.moe_order(w, ids, counts, slot)
            try:
                y = _grouped_gemms(x, src, w13, w2, ends, tiles, ws)
                _used("moe_grouped_gemm")
                _log_plan(
                    "moe_grouped_gemm",
                    lambda: f"gate/up: {ops.moe_grouped_gemm_plan(x, w13.shape[2], True)}; "
                    f"down: {ops.moe_grouped_gemm_plan(x, w2.shape[2], False)}",
                )
            except RuntimeError as e:
                # A device that refuses the launch (shared memory, registers) must not fail
                # requests: the library path serves this and every later call.
                _grouped_gemm_ok = False
                logger.warning(
                    "MoE grouped GEMM kernel failed, %s path from now on: %s", library, e
                )
                method = library
        if y is None:
            xs, ws, inverse, ends = ops.moe_permute(x, w, ids, counts, slot)
            if method == "grouped":
                h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
                y = torch._grouped_mm(ops.moe_act(h, ws), w2.transpose(1, 2), offs=ends)
            else:
                y = _expert_loop(xs, ws, ends, w13, w2)
        sh_out = sh_gate = None
        if shared is not None:
            gate_up, down, gate = shared
            sh_out = F.linear(ops.moe_act(F.linear(x, gate_up), None), down)
            sh_gate = None if gate is None else F.linear(x, gate)
        return ops.moe_combine(y, inverse, top_k, sh_out, sh_gate)
    _torch_used("moe_prefill", x)
    topk_w, topk_ids = moe.route(router_logits, top_k, renormalize)
    out = moe.moe_experts_prefill(x, topk_w, topk_ids, w13, w2, method)
    if shared is not None:
        out = out + moe.shared_expert(x, *shared)
    return out


def _expert_loop(
    xs: torch.Tensor, ws: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Both expert GEMMs as one ``mm`` per non-empty expert slice (one host sync for the
    group ends), the fused activation over all rows in between."""
    bounds = [0, *ends.tolist()]
    h = xs.new_empty(xs.shape[0], w13.shape[1])
    for e in range(w13.shape[0]):
        if bounds[e] < bounds[e + 1]:
            torch.mm(xs[bounds[e] : bounds[e + 1]], w13[e].t(), out=h[bounds[e] : bounds[e + 1]])
    act = torch.ops.vo_kernels.moe_act(h, ws)
    y = xs.new_empty(xs.shape[0], w2.shape[1])
    for e in range(w2.shape[0]):
        if bounds[e] < bounds[e + 1]:
            torch.mm(act[bounds[e] : bounds[e + 1]], w2[e].t(), out=y[bounds[e] : bounds[e + 1]])
    return y


def _grouped_gemms(
    x: torch.Tensor,
    src: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    tiles: torch.Tensor,
    ws: torch.Tensor,
) -> torch.Tensor:
    """gate/up (x's rows gathered, silu(gate) * up * weight) then down: [P, H] in expert order.
    A seam for the fallback test."""
    ops = torch.ops.vo_kernels
    act = ops.moe_grouped_gemm(x, src, w13, ends, tiles, ws)
    return ops.moe_grouped_gemm(act, None, w2, ends, tiles, None)


def _grouped_gemm_fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``moe_grouped_gemm``'s shapes: 16-bit operands (bf16 from compute capability 8), K of
    both GEMMs (H, I) a multiple of 32, N of both (2I, H) a multiple of 128, weights contiguous."""
    E, I2, H = w13.shape
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and (x.dtype != torch.bfloat16 or x.device.type != "cuda" or _bf16_mma(x.device))
        and H % 128 == 0
        and I2 % 128 == 0
        and w2.shape == (E, H, I2 // 2)
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def _bf16_mma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8


def _moe_prefill_fits(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    top_k: int,
) -> bool:
    """Rows of x, of the expert activations and of the shared expert's are 16-byte vectors."""
    vec = 16 // x.element_size()
    E = w13.shape[0]
    return (
        x.dim() == 2
        and x.is_contiguous()
        and x.data_ptr() % 16 == 0
        and x.shape[1] % vec == 0
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.shape[1] == E <= 1024
        and 1 <= top_k <= min(E, 16)  # the prefill routing kernel's lane groups
        and w13.dtype == w2.dtype == x.dtype
        and w2.shape[2] % vec == 0
        and (shared is None or (shared[1].shape[1] % vec == 0 and shared[0].dtype == x.dtype))
    )


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
        _fused("qk_norm_rope_gate", q_gate)
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
    _torch_used("qk_norm_rope_gate", q_gate)
    return qk_norm_rope.qk_norm_rope_gate(
        q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads,
        num_kv_heads, head_dim, rotary_dim, mrope_section,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Paged attention (csrc/paged_attention.cu; the PyTorch path is .paged_attention). The KV cache
# layout is that module's: key / value caches [blocks, kv_heads, block_size, D].
# --------------------------------------------------------------------------------------------

# Cleared for the process when the device refuses a kernel (its shared memory or registers per
# block fall short): that op family then runs its PyTorch path; the other families keep theirs.
_paged_ok = {"paged_write_kv": True, "paged_decode": True, "paged_prefill": True}


def _paged_refused(op: str, x: torch.Tensor, e: Exception) -> None:
    _paged_ok[op] = False
    logger.warning("%s kernel failed, PyTorch path from now on: %s", OP_FAMILIES[op], e)
    _torch_used(op, x, f"the device refused the kernel: {e}")


def _vec_rows(t: torch.Tensor, row_stride: int) -> bool:
    """Rows of 16-byte vectors: aligned start, row stride a whole number of vectors."""
    vec = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and row_stride % vec == 0


def _caches_fit(x: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Checked once per cache (keyed by address and shape): eager decode calls this every
    layer, and the caches live for the whole process."""
    key = (x.dtype, key_cache.data_ptr(), value_cache.data_ptr(), tuple(key_cache.shape))
    ok = _cache_checked.get(key)
    if ok is None:
        ok = _cache_checked[key] = _caches_fit_now(x, key_cache, value_cache)
    return ok


_cache_checked: dict[tuple[Any, ...], bool] = {}


def _caches_fit_now(x: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    return (
        key_cache.dim() == 4
        and value_cache.shape == key_cache.shape
        and key_cache.dtype == value_cache.dtype == x.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and _vec_rows(key_cache, key_cache.shape[3])
        and _vec_rows(value_cache, value_cache.shape[3])
    )


def paged_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`.paged_attention.write_kv` (same arguments and result): one launch and no host
    sync where the kernel serves (the PyTorch path syncs once to drop pad slots)."""
    op = "paged_write_kv"
    ok = (
        _paged_ok[op]
        and _fused(op, key)
        and key.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and key.dim() == 3
        and value.shape == key.shape
        and value.dtype == key.dtype
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key_cache.dim() == 4
        and key_cache.dtype == value_cache.dtype == key.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key_cache.shape == value_cache.shape
        and key_cache.shape[1] == key.shape[1]
        and key_cache.shape[3] == key.shape[2]
        and slot_mapping.dtype in (torch.int32, torch.int64)
    )
    if ok:
        try:
            torch.ops.vo_kernels.paged_write_kv(
                key, value, key_cache, value_cache, slot_mapping.reshape(-1).contiguous()
            )
            _used(op)
            return
        except (RuntimeError, AttributeError) as e:  # refused, or a library without it
            _paged_refused(op, key, e)
    else:
        _torch_used(op, key)
    pa.write_kv(key, value, key_cache, value_cache, slot_mapping)


# Tokens a decode partition; 0: the kernel's choice (enough partitions to fill the device).
PAGED_DECODE_PARTITION = int(os.environ.get("VO_PAGED_DECODE_PARTITION", "0") or 0)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """:func:`.paged_attention.decode_attention`: ``[B, H, D]`` in ``query.dtype``. Fused: one
    launch over (context partitions, kv heads, sequences) and one combine (none when one
    partition covers the longest context)."""
    op = "paged_decode"
    B, H, D = query.shape
    KV = key_cache.shape[1] if key_cache.dim() == 4 else 0
    vec = 16 // query.element_size()
    dv = D // vec if D % vec == 0 else 0
    ok = (
        _paged_ok[op]
        and _fused(op, query)
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and KV > 0
        and key_cache.shape[3] == D
        and H % KV == 0
        and H // KV in (1, 2, 4, 8)
        and dv > 0
        and dv & (dv - 1) == 0
        and dv <= 128
        and query.stride(2) == 1
        and query.stride(1) == D
        and _vec_rows(query, query.stride(0))
        and _caches_fit(query, key_cache, value_cache)
        and block_tables.dim() == 2
    )
    if ok:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if B else 0
        try:
            out = torch.ops.vo_kernels.paged_decode(
                query, key_cache, value_cache, _int32(block_tables, inner=True),
                _int32(seq_lens), float(scale), int(max_seq_len), PAGED_DECODE_PARTITION,
            )  # fmt: skip
            _used(op)
            _log_plan("paged_decode", lambda: torch.ops.vo_kernels.paged_attention_plan(
                query, H // KV, D, int(max_seq_len), B * KV))  # fmt: skip
            return out
        except (RuntimeError, AttributeError) as e:  # refused, or a library without it
            _paged_refused(op, query, e)
    else:
        _torch_used(op, query)
    return pa.decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len
    )


def _int32(t: torch.Tensor, inner: bool = False) -> torch.Tensor:
    """``t`` as int32 (a no-op for vLLM's tables and lengths), rows contiguous."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    if inner:
        return t if t.stride(-1) == 1 else t.contiguous()
    return t.contiguous()


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    context_lens_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`.paged_attention.prefill_attention` (same arguments and result), one launch
    where the kernel serves. ``query_start_loc`` ``[N + 1]`` / ``context_lens_tensor`` ``[N]``:
    the lengths already on the device (vLLM's metadata has both); else built from the lists."""
    op = "paged_prefill"
    T, H, D = query.shape
    KV = key.shape[1] if key.dim() == 3 else 0
    has_cache = key_cache is not None and value_cache is not None
    ok = (
        _paged_ok[op]
        and _fused(op, query)
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and KV > 0
        and D in (64, 128, 256)
        and H % KV == 0
        and 64 % (H // KV) == 0
        and value.shape == key.shape
        and key.dtype == value.dtype == query.dtype
        and query.stride(2) == 1
        and query.stride(1) == D
        and key.stride(2) == 1
        and key.stride(1) == D
        and value.stride() == key.stride()
        and _vec_rows(query, query.stride(0))
        and _vec_rows(key, key.stride(0))
        and _vec_rows(value, value.stride(0))
        and (
            not has_cache
            or (
                _caches_fit(query, key_cache, value_cache)
                and key_cache.shape[1] == KV
                and key_cache.shape[3] == D
                and block_tables is not None
                and block_tables.dim() == 2
            )
        )
        and (has_cache or not any(int(c) for c in context_lens))
    )
    if ok:
        if query_start_loc is None:
            cu = [0]
            for n in query_lens:
                cu.append(cu[-1] + int(n))
            query_start_loc = torch.tensor(cu, dtype=torch.int32, device=query.device)
        if context_lens_tensor is None:
            context_lens_tensor = torch.tensor(
                [int(c) for c in context_lens], dtype=torch.int32, device=query.device
            )
        n = len(query_lens)
        try:
            out = torch.ops.vo_kernels.paged_prefill(
                query, key, value, key_cache if has_cache else None,
                value_cache if has_cache else None,
                _int32(block_tables, inner=True) if has_cache else None,
                _int32(query_start_loc[: n + 1]), _int32(context_lens_tensor[:n]),
                max((int(q) for q in query_lens), default=0), float(scale),
            )  # fmt: skip
            _used(op)
            return out
        except (RuntimeError, AttributeError) as e:  # refused, or a library without it
            _paged_refused(op, query, e)
    else:
        _torch_used(op, query)
    return pa.prefill_attention(
        query, key, value, key_cache, value_cache, block_tables, query_lens, context_lens, scale
    )


# Fake (meta) implementations: shapes only, for tracing and torch.compile.
def _register_fakes() -> None:
    lib = "vo_kernels::"

    @torch_compat.register_fake(lib + "gemma_rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch_compat.register_fake(lib + "gemma_fused_add_rms_norm")
    def _(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch_compat.register_fake(lib + "dense_linear")
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch_compat.register_fake(lib + "rms_norm_gated")
    def _(
        x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, sigmoid: bool
    ) -> torch.Tensor:
        return torch.empty_like(x)

    @torch_compat.register_fake(lib + "gdn_conv_prep")
    def _(x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        H, K, V = args[11], args[12], args[13]  # after weight, bias, ..., A_log, dt_bias
        T, D = x.shape
        HV = (D - 2 * H * K) // V
        return (
            x.new_empty(T, H, K), x.new_empty(T, H, K), x.new_empty(T, HV, V),
            x.new_empty(T, HV, dtype=torch.float32), x.new_empty(T, HV, dtype=torch.float32),
        )  # fmt: skip

    @torch_compat.register_fake(lib + "gdn_chunk_prefill")
    def _(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, scale: float,
        l2norm: bool, v_split: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        N = cu_seqlens.shape[0] - 1
        HV, V = v.shape[1], v.shape[2]
        return v.new_empty(v.shape), q.new_empty(N, HV, V, q.shape[2], dtype=torch.float32)

    @torch_compat.register_fake(lib + "moe_route")
    def _(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        T = logits.shape[0]
        return (
            logits.new_empty(T, top_k, dtype=torch.float32),
            logits.new_empty(T, top_k, dtype=torch.int64),
        )

    @torch_compat.register_fake(lib + "moe_decode")
    def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(x)

    @torch_compat.register_fake(lib + "moe_decode_routed")
    def _(
        x: torch.Tensor, logits: torch.Tensor, top_k: int, *args: Any
    ) -> tuple[torch.Tensor, ...]:  # noqa: E501
        T = x.shape[0]
        return (
            torch.empty_like(x),
            x.new_empty(T, top_k, dtype=torch.float32),
            x.new_empty(T, top_k, dtype=torch.int64),
        )

    @torch_compat.register_fake(lib + "moe_route_count")
    def _(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, ...]:
        T, E = logits.shape
        return (
            logits.new_empty(T, top_k, dtype=torch.float32),
            logits.new_empty(T, top_k, dtype=torch.int64),
            logits.new_empty(E, dtype=torch.int32),
            logits.new_empty(T, top_k, dtype=torch.int32),
        )

    @torch_compat.register_fake(lib + "moe_permute")
    def _(
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        counts: torch.Tensor,
        slot: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # noqa: E501
        P = ids.numel()
        return (
            x.new_empty(P, x.shape[1]),
            x.new_empty(P, dtype=torch.float32),
            x.new_empty(P, dtype=torch.int64),
            x.new_empty(counts.shape[0], dtype=torch.int32),
        )

    @torch_compat.register_fake(lib + "moe_order")
    def _(
        w: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        P, E = ids.numel(), counts.shape[0]
        return (
            w.new_empty(P, dtype=torch.int32),
            w.new_empty(P),
            w.new_empty(P, dtype=torch.int64),
            w.new_empty(E, dtype=torch.int32),
            w.new_empty(E + 1, dtype=torch.int32),
        )

    @torch_compat.register_fake(lib + "moe_grouped_gemm")
    def _(a: torch.Tensor, src: torch.Tensor | None, w: torch.Tensor, *args: Any) -> torch.Tensor:
        if src is None:
            return a.new_empty(a.shape[0], w.shape[1])
        return a.new_empty(src.shape[0], w.shape[1] // 2)

    @torch_compat.register_fake(lib + "moe_act")
    def _(h: torch.Tensor, ws: torch.Tensor | None) -> torch.Tensor:
        return h.new_empty(h.shape[0], h.shape[1] // 2)

    @torch_compat.register_fake(lib + "moe_combine")
    def _(y: torch.Tensor, inverse: torch.Tensor, top_k: int, *args: Any) -> torch.Tensor:
        return y.new_empty(inverse.shape[0] // top_k, y.shape[1])

    @torch_compat.register_fake(lib + "paged_decode")
    def _(query: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(query)

    @torch_compat.register_fake(lib + "paged_prefill")
    def _(query: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(query)

    @torch_compat.register_fake(lib + "paged_write_kv")
    def _(key: torch.Tensor, *args: Any) -> None:
        return None

    @torch_compat.register_fake(lib + "qk_norm_rope_gate")
    def _(q_gate: torch.Tensor, k: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        T, qw = q_gate.shape[0], q_gate.shape[1] // 2
        return q_gate.new_empty(T, qw), k.new_empty(k.shape), q_gate.new_empty(T, qw)
