"""Where vLLM 0.32.0 switches to our native kernels (the logic behind patches 0003-0006).

The diffs under ``patches/vllm-0.32.0/`` only import this module and call into it; everything
else lives here. The switches are read once, at import, from the environment:

========================  =====================================================================
``GDN_NATIVE=1``          Gated DeltaNet conv1d, gates, chunked prefill, recurrent decode and the
                          gated output norm through :mod:`native.gdn` / :mod:`native.rmsnorm`
                          (non-spec-decode batches; a batch with speculative tokens stays on
                          upstream's kernels).
                          On CPU the layer then runs ``forward_cuda`` (projections in the
                          compiled graph, core through the ``qwen_gdn_attention_core`` op) instead
                          of upstream's bf16-only ``cpu_gdn_attention_core``, and the
                          process flushes denormal floats to zero (see
                          ``cpu_kernel_fixes.flush_denormals_on_all_threads``).
                          Qwen3.5 layers run both input projections as one GEMM
                          (:mod:`native.gdn_in_proj`: one weight tensor, no copy).
``MOE_NATIVE=1``          MoE prefill (more than ``MOE_DECODE_MAX_TOKENS`` tokens) through the
                          sort-by-expert path, and MoE decode through the native gather + bmm
                          path (or sort-by-expert with ``MOE_DECODE_NATIVE=1``).
``MOE_DECODE_NATIVE=1``   MoE decode through the sort-by-expert path instead of gather + bmm.
                          Alone (``MOE_NATIVE=0``) it switches decode only; prefill stays upstream.
``RMSNORM_NATIVE=1``      ``GemmaRMSNorm`` (Qwen3.5 ``(1 + w)`` norms, plain and fused-add).
``VISION_ROPE_NATIVE=1``  The vision tower's RoPE (``ApplyRotaryEmb``) through upstream's PyTorch
                          forward on every platform (:mod:`native.vision_rope`: vLLM's
                          out-of-tree op registry, no patch); its CUDA forward is a Triton kernel.
``QK_NORM_ROPE_NATIVE=1`` Gated attention's q/k norm + RoPE + gate split through
                          :func:`native.kernels.qk_norm_rope_gate` (one launch where the extension
                          runs). Upstream's fused version of it is a Triton kernel that a CUDA
                          platform selects by default.
``GEMV_NATIVE=1``         Unquantised linear layers (patch 0011) whose upstream GEMM is the
                          generic ``F.linear`` run inputs of at most ``kernels.GEMV_MAX_ROWS``
                          rows (a decode step's tokens) through :func:`native.kernels.linear`: one
                          plain launch of our GEMV instead of cuBLAS's host cost per call.
``PROF_TRACE=1``          ``torch.profiler.record_function`` ranges around the native MoE / GDN
                          sections (visible in any torch-profiler trace).
``PROF_MOE_SUMMARY=N``    MoE timing summary per process: prefill and decode buckets with the
                          average routed, shared-expert and all-reduce ms; every N MoE-block
                          calls (``1`` means every 1,000) and at exit. Synchronises the device
                          around each section (never during CUDA-graph capture), so it slows
                          the server: a measuring tool, off by default.
========================  =====================================================================

Everything else -- quantised weights, expert parallelism, EPLB, sequence-parallel MoE, fused
or replicated shared experts -- keeps upstream's kernels, with one log line saying why.

Capture / compile safety: the routed experts are one opaque custom op
(``vllm_overrides::native_moe_routed``; the whole block, ``vllm_overrides::native_moe``, when
``PROF_MOE_SUMMARY`` times its sections or ``MOE_DECODE_NATIVE`` is on alone) so their
token-count dispatch and the prefill path's data-dependent work never enter the compiled graph;
router, shared expert and all-reduce are traced with the layer. Inside the op the decode paths
are static-shape and sync-free. The GDN core already runs inside
upstream's opaque ``qwen_gdn_attention_core`` op. The two norms are plain traceable code and
are traced into the graph (the ``USAGE`` counters prove they were).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from vllm_overrides.native import gdn_checkpoint, gdn_in_proj, kernels, moe, vision_rope

logger = logging.getLogger("vllm.vllm_overrides.native")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _int(name: str) -> int:
    raw = os.environ.get(name, "0").strip().lower()
    if raw in ("true", "yes", "on"):
        return 1
    try:
        return max(int(raw), 0)
    except ValueError:
        return 0


GDN_NATIVE = _flag("GDN_NATIVE")
MOE_NATIVE = _flag("MOE_NATIVE")
MOE_DECODE_NATIVE = _flag("MOE_DECODE_NATIVE")
RMSNORM_NATIVE = _flag("RMSNORM_NATIVE")
QK_NORM_ROPE_NATIVE = _flag("QK_NORM_ROPE_NATIVE")
VISION_ROPE_NATIVE = _flag("VISION_ROPE_NATIVE")
GEMV_NATIVE = _flag("GEMV_NATIVE")
PROF_TRACE = _flag("PROF_TRACE")
PROF_MOE_SUMMARY = _int("PROF_MOE_SUMMARY")
MOE_SUMMARY_EVERY = 1000 if PROF_MOE_SUMMARY == 1 else PROF_MOE_SUMMARY
# A MoE call with at most this many tokens is a "decode" call (static per captured batch size).
MOE_DECODE_MAX_TOKENS = 32

# The patched model modules import this one before any layer is built: the out-of-tree op
# must be registered by then.
if VISION_ROPE_NATIVE:
    vision_rope.register()

# Which native paths ran in this process. The norm counters are bumped while Dynamo traces
# (and wherever the traced bytecode replays the side effect), the others on every eager call.
USAGE: dict[str, int] = {}
_reported: set[str] = set()
_logged_once: set[str] = set()


def _mark(name: str) -> None:
    USAGE[name] = USAGE.get(name, 0) + 1


def _info_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        logger.info(msg, *args)


_reported_n = -1


def report_usage() -> None:
    """Log the set of native paths used so far, whenever it grows (eager contexts only)."""
    global _reported_n
    # Both sets only grow, so a changed size is the only case with anything to log: the
    # check costs two len() calls, not set building (this runs per layer and decode step).
    n = len(USAGE) + len(kernels.FUSED_USED)
    if n == _reported_n:
        return
    _reported_n = n
    used = set(USAGE) | {f"fused_{op}" for op in kernels.FUSED_USED}
    new = used - _reported
    if new:
        _reported.update(new)
        logger.info("vllm_overrides native paths in use (pid %d): %s", os.getpid(), sorted(used))


def _range(name: str) -> contextlib.AbstractContextManager[Any]:
    return torch.profiler.record_function(name) if PROF_TRACE else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# RMSNorm (patch 0005: GemmaRMSNorm.forward_native, which CPU and CUDA both dispatch to)
# --------------------------------------------------------------------------------------------


def gemma_rms_norm(
    layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``GemmaRMSNorm.forward_native`` through :mod:`native.rmsnorm` (traceable)."""
    _mark("gemma_rms_norm")
    return kernels.gemma_rms_norm(x, layer.weight, layer.variance_epsilon, residual)


# --------------------------------------------------------------------------------------------
# Gated attention's q/k prep (patch 0010: Qwen3NextAttention)
# --------------------------------------------------------------------------------------------


def register_attention(layer: Any) -> None:
    """End of ``Qwen3NextAttention.__init__``: with ``QK_NORM_ROPE_NATIVE``, never upstream's
    Triton ``fused_qk_rmsnorm_rope_gate``; our op where its contract holds (output gate, NeoX
    rotation, plain or interleaved MRoPE), else upstream's unfused split + norms + RoPE."""
    layer._vo_qk_norm_rope = False
    if not QK_NORM_ROPE_NATIVE:
        return
    rope = layer.rotary_emb
    sec = getattr(rope, "mrope_section", None)
    ok = (
        layer.attn_output_gate
        and getattr(rope, "is_neox_style", False)
        and isinstance(getattr(rope, "cos_sin_cache", None), torch.Tensor)
        and (
            sec is None
            or (
                len(sec) == 3
                and getattr(rope, "mrope_interleaved", False)
                and sum(sec) == rope.rotary_dim // 2
            )
        )
    )
    layer.use_fused_qk_norm_rope_gate = False
    layer._vo_qk_norm_rope = bool(ok)
    if not ok:
        _info_once(
            "qk-upstream", "QK_NORM_ROPE_NATIVE: this rotary layout takes upstream's unfused path"
        )


def qk_norm_rope_gate(
    layer: Any, qkv: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Qwen3NextAttention._project_qkv_gate``: ``(q, k, v, gate)`` after norm and RoPE."""
    _mark("qk_norm_rope_gate")
    q_gate, k, v = qkv.split([layer.q_size * 2, layer.kv_size, layer.kv_size], dim=-1)
    rope = layer.rotary_emb
    sec = getattr(rope, "mrope_section", None)
    if positions.dim() == 2 and not sec:
        positions = positions[0]
    q, k, gate = kernels.qk_norm_rope_gate(
        q_gate, k, layer.q_norm.weight, layer.k_norm.weight, rope.cos_sin_cache, positions,
        layer.q_norm.variance_epsilon, layer.num_heads, layer.num_kv_heads, layer.head_dim,
        rope.rotary_dim, sec if positions.dim() == 2 else None,
    )  # fmt: skip
    return q, k, v, gate


# --------------------------------------------------------------------------------------------
# Unquantised linear layers (patch 0011: UnquantizedLinearMethod.__init__)
# --------------------------------------------------------------------------------------------


def unquantized_gemm(impl: Any) -> Any:
    """The GEMM an ``UnquantizedLinearMethod`` calls: with ``GEMV_NATIVE``, upstream's generic
    choice (``default_unquantized_gemm``, i.e. ``F.linear``) becomes
    :func:`native_unquantized_gemm`; any other backend (CPU, ROCm, FlashInfer) stays."""
    if not GEMV_NATIVE:
        return impl
    from vllm.model_executor.layers.utils import default_unquantized_gemm

    if impl is not default_unquantized_gemm:
        _info_once("gemv-other", "GEMV_NATIVE: linear layers keep their backend (%s)", impl)
        return impl
    _info_once(
        "gemv", "GEMV_NATIVE: linear layers take <= %d rows through the GEMV kernel",
        kernels.GEMV_MAX_ROWS,
    )  # fmt: skip
    return native_unquantized_gemm


def native_unquantized_gemm(
    layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``default_unquantized_gemm`` with a decode step's rows on :func:`native.kernels.linear`."""
    return kernels.linear(x, weight, bias)


# --------------------------------------------------------------------------------------------
# Gated DeltaNet (patch 0003)
# --------------------------------------------------------------------------------------------


def gdn_forward_method(layer: Any) -> Any:
    """The layer's forward method (called once both input projections exist). With
    ``GDN_NATIVE``, where upstream picked the generic ``forward_cuda`` (and on CPU instead of
    upstream's CPU op): :func:`native.gdn_in_proj.forward_method`, the same forward with one input
    GEMM instead of two (falls back to ``forward_cuda`` where the merge does not apply). The
    core op lands in :func:`gdn_forward_core` either way."""
    from vllm.platforms import current_platform

    if not GDN_NATIVE:
        return layer._forward_method
    if current_platform.is_cpu():
        _info_once("gdn-cpu", "GDN_NATIVE: CPU GDN layers use the native pure-PyTorch path")
    elif layer._forward_method != layer.forward_cuda:
        return layer._forward_method  # ROCm / XPU forwards: not ours to replace
    return gdn_in_proj.forward_method(layer)


def gdn_output_norm(norm: Any, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``RMSNormGated(x, z)`` through :func:`native.rmsnorm.rms_norm_gated` (traceable)."""
    if norm.group_size is not None or not norm.norm_before_gate:
        return norm(x, z)
    _mark("rms_norm_gated")
    return kernels.rms_norm_gated(x, z, norm.weight, norm.eps, norm.activation)


def _conv_weight(layer: Any) -> torch.Tensor:
    # On AVX512-BF16 / Arm-bf16 CPUs the bf16 conv weight is packed in place at load time;
    # upstream keeps the plain [D, W] copy beside it.
    w = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if w is not None:
        return w
    w = layer.conv1d.weight
    return w.view(w.size(0), w.size(2)) if w.dim() == 3 else w


def _gate_params_f32(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_log`` and ``dt_bias`` as float32, converted once per layer (``dt_bias`` is a
    model-dtype parameter; converting it every step would be one more launch per layer)."""
    cached = getattr(layer, "_vo_gate_params_f32", None)
    if cached is None or cached[0].device != layer.A_log.device:
        cached = (layer.A_log.detach().float(), layer.dt_bias.detach().float())
        layer._vo_gate_params_f32 = cached
    return cached


_denormals_flushed = False


def _flush_cpu_denormals() -> None:
    """Once per process, from the thread that runs the model (the OpenMP master)."""
    global _denormals_flushed
    from vllm_overrides.engines.v1_0_32.cpu_kernel_fixes import flush_denormals_on_all_threads

    _denormals_flushed = True
    ok = flush_denormals_on_all_threads()
    _info_once("gdn-ftz", "GDN_NATIVE on CPU: denormals flushed on all threads: %s", ok)


def _gdn_metadata(layer: Any) -> Any:
    """This step's GDN attention metadata of ``layer`` (``None`` in profile / dummy runs)."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    return meta.get(layer.prefix) if isinstance(meta, dict) else None


def _gdn_states(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A native GDN core is about to run on ``x``: count and report it, flush CPU denormals once,
    and return the layer's (conv state as the kernels take it ``[slots, D, W-1]``, ssm state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    _mark("gdn_core")
    report_usage()
    if not _denormals_flushed and x.device.type == "cpu":
        _flush_cpu_denormals()
    kv = layer.kv_cache
    return (kv[0] if is_conv_state_dim_first() else kv[0].transpose(-1, -2)), kv[1]


def _decode(
    layer: Any,
    md: Any,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    out: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    z: torch.Tensor | None = None,
) -> None:
    """The batch's decode rows (first ``num_decode_tokens``) into ``out``; with ``z``, the
    layer's gated output norm applied too."""
    nd, ndt = md.num_decodes, md.num_decode_tokens
    norm = layer.norm if z is not None else None
    with _range("vo.gdn.decode"):
        # One fused launch where the extension serves this device (conv, gates, norms,
        # delta rule, output, with z the gated output norm); else the PyTorch ops.
        A_log, dt_bias = _gate_params_f32(layer)
        kernels.gdn_decode(
            mixed_qkv[:ndt], a[:ndt], b[:ndt], conv_state, _conv_weight(layer), layer.conv1d.bias,
            A_log, dt_bias, ssm_state, out[:ndt], md.non_spec_state_indices_tensor[:nd],
            layer.num_k_heads // layer.tp_size, layer.head_k_dim**-0.5, layer.activation,
            z=None if z is None else z[:ndt],
            norm_weight=None if norm is None else norm.weight,
            norm_eps=1e-6 if norm is None else norm.eps,
            norm_activation="silu" if norm is None else norm.activation,
        )  # fmt: skip


def gdn_decode_normed(
    layer: Any, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor
) -> torch.Tensor | None:
    """A decode-only batch's core output with the gated output norm already applied (one
    launch on the fused kernels instead of two, and no zero fill when every row is a decode
    row), or ``None`` to leave the batch to the core op and ``_output_projection``. Eager
    only: this bypasses the ``qwen_gdn_attention_core`` custom op, which is a boundary for
    ``torch.compile`` and nothing more (its impl calls the layer's ``_forward_core``)."""
    md = _gdn_metadata(layer)
    if (
        md is None
        or md.num_prefills > 0
        or md.num_decodes == 0
        or md.spec_sequence_masks is not None
        or md.num_accepted_tokens is not None
    ):
        return None
    _mark("gdn_decode_norm_fused")
    conv_state, ssm_state = _gdn_states(layer, mixed_qkv)
    n_all, ndt = mixed_qkv.size(0), md.num_decode_tokens
    shape = (n_all, layer.num_v_heads // layer.tp_size, layer.head_v_dim)
    # Rows past the batch (padding) stay zero, as upstream's zeroed buffer leaves them.
    alloc = torch.empty if ndt == n_all else torch.zeros
    out = alloc(shape, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    _decode(layer, md, mixed_qkv, b, a, out, conv_state, ssm_state, z)
    return out


def gdn_norm_fusable(norm: Any) -> bool:
    """Whether the layer's ``RMSNormGated`` is the per-head norm the decode kernel fuses."""
    return (
        norm.group_size is None
        and norm.norm_before_gate
        and norm.activation in ("silu", "swish", "sigmoid")
    )


def gdn_forward_core(
    layer: Any,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> bool:
    """``_forward_core`` for non-spec batches; returns False to leave a batch to upstream.

    Batch order is vLLM's: decode tokens first, then the prefill tokens.
    """
    md = _gdn_metadata(layer)
    if md is None:
        return True  # profile / dummy run: nothing to warm up (no autotuned kernels)
    if md.spec_sequence_masks is not None or md.num_accepted_tokens is not None:
        _info_once("gdn-spec", "GDN_NATIVE: speculative-decode batches use upstream kernels")
        return False
    conv_state, ssm_state = _gdn_states(layer, mixed_qkv)
    n = md.num_actual_tokens
    mixed_qkv, b, a = mixed_qkv[:n], b[:n], a[:n]
    weight = _conv_weight(layer)
    bias = layer.conv1d.bias
    idx = md.non_spec_state_indices_tensor
    nd, ndt, npf = md.num_decodes, md.num_decode_tokens, md.num_prefills
    H = layer.num_k_heads // layer.tp_size
    K, V = layer.head_k_dim, layer.head_v_dim

    if nd > 0:
        _decode(layer, md, mixed_qkv, b, a, core_attn_out, conv_state, ssm_state)
    if npf > 0:
        with _range("vo.gdn.prefill"):
            qsl = md.non_spec_query_start_loc[nd : nd + npf + 1] - ndt
            pidx = idx[nd : nd + npf].to(torch.long)
            has_init = md.has_initial_state[nd : nd + npf]
            # Conv (states updated in place) + q/k L2 norm, v, gates: two launches where the
            # extension serves this device, else the PyTorch ops.
            A_log, dt_bias = _gate_params_f32(layer)
            q, k, v, g, beta = kernels.gdn_conv_prep(
                mixed_qkv[ndt:n], weight, bias, conv_state, qsl, pidx, has_init,
                layer.activation, a[ndt:n], b[ndt:n], A_log, dt_bias, H, K, V,
            )  # fmt: skip
            h0 = ssm_state.index_select(0, pidx)
            h0 = torch.where(has_init.view(-1, 1, 1, 1), h0, torch.zeros_like(h0))
            # Patch 0007: rows with a prefill checkpoint (md.checkpoint) run as two chained
            # segments and export the state at the checkpoint into its slot.
            ckpt = gdn_checkpoint.prefill_checkpoints(md, nd, npf)
            if ckpt is not None:
                o, final = gdn_checkpoint.chunk_rule_with_checkpoints(
                    kernels.chunk_gated_delta_rule, q, k, v, g, beta, h0, qsl, ckpt[0], ckpt[1],
                    mixed_qkv[ndt:n], conv_state, ssm_state,
                )  # fmt: skip
            else:
                o, final = kernels.chunk_gated_delta_rule(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                    beta.unsqueeze(0), initial_state=h0, output_final_state=True,
                    cu_seqlens=qsl, use_qk_l2norm_in_kernel=False,
                )  # fmt: skip
            assert final is not None
            ssm_state.index_copy_(0, pidx, final.to(ssm_state.dtype))
            core_attn_out[ndt:n] = o[0].to(core_attn_out.dtype)
    return True


# --------------------------------------------------------------------------------------------
# MoE (patch 0004: Qwen3NextSparseMoeBlock; patch 0006: CPU keeps plain expert weights)
# --------------------------------------------------------------------------------------------

_MOE_BLOCKS: dict[str, Any] = {}


def moe_native_wanted() -> bool:
    return MOE_NATIVE or MOE_DECODE_NATIVE


def register_moe_block(block: Any, vllm_config: Any, prefix: str) -> None:
    """Decide once, at construction, whether this block runs the native op (sets
    ``block._vo_native_moe``); the reasons for staying upstream are logged once."""
    block._vo_native_moe = False
    if not moe_native_wanted():
        return
    config = vllm_config.model_config.hf_text_config
    why = []
    if vllm_config.quant_config is not None:
        why.append("quantised weights")
    # Only the flag means EP: ``block.ep_size`` is the size of vLLM's EP *group*, which spans
    # the TP ranks whether or not experts are split (it is 4 at -tp 4 without EP).
    if vllm_config.parallel_config.enable_expert_parallel:
        why.append("expert parallelism")
    if getattr(block, "enable_eplb", False):
        why.append("EPLB")
    if getattr(block, "is_sequence_parallel", False):
        why.append("sequence-parallel MoE")
    if getattr(block, "is_fused_shared_expert_enabled", False):
        why.append("fused shared expert")
    if getattr(block, "replicate_shared_expert", False):
        why.append("replicated shared expert")
    if not why and _expert_weights(block) is None:
        why.append("expert weights not in [E,2I,H]/[E,H,I]")
    if why:
        _info_once("moe-upstream", "MOE_NATIVE: upstream MoE kernels kept (%s)", ", ".join(why))
        return
    block._vo_native_moe = True
    # With MOE_NATIVE every bucket is native, so only the routed experts need the opaque op:
    # router, shared expert and all-reduce stay in the traced graph (compiled with the rest of
    # the layer). PROF_MOE_SUMMARY times the sections one by one, so it keeps the whole block
    # in the op, as does MOE_DECODE_NATIVE alone (its prefill is upstream's whole block).
    block._vo_split = MOE_NATIVE and not MOE_SUMMARY_EVERY
    block._vo_name = prefix
    block._vo_top_k = int(config.num_experts_per_tok)
    block._vo_renormalize = bool(getattr(config, "norm_topk_prob", True))
    _MOE_BLOCKS[prefix] = block
    _info_once(
        "moe-native",
        "MoE switches: prefill %s, decode %s (<= %d tokens)",
        "native sort-by-expert" if MOE_NATIVE else "upstream",
        "native sort-by-expert"
        if MOE_DECODE_NATIVE
        else ("native gather+bmm" if MOE_NATIVE else "upstream"),
        MOE_DECODE_MAX_TOKENS,
    )


def stash_plain_expert_weights(layer: torch.nn.Module) -> None:
    """CPU only: keep a plain ``[E, 2I, H]`` / ``[E, H, I]`` copy before upstream prepacks the
    expert weights into its grouped-GEMM layout (the native path reads the plain layout)."""
    if moe_native_wanted():
        layer._vo_w13 = layer.w13_weight.detach().clone()
        layer._vo_w2 = layer.w2_weight.detach().clone()


def _expert_weights(block: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    ex = getattr(block.experts, "routed_experts", block.experts)  # MoERunner -> RoutedExperts
    w13 = getattr(ex, "_vo_w13", None)
    w2 = getattr(ex, "_vo_w2", None)
    if w13 is None:
        w13, w2 = ex.w13_weight, ex.w2_weight
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        return None
    if w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        return None
    return w13, w2


class _MoeStats:
    def __init__(self) -> None:
        self.calls = {"prefill": 0, "decode": 0}
        self.tokens = {"prefill": 0, "decode": 0}
        self.ms: dict[tuple[str, str], float] = {}
        self.path = {"prefill": "-", "decode": "-"}
        self.total = 0

    def add(self, bucket: str, section: str, ms: float) -> None:
        self.ms[(bucket, section)] = self.ms.get((bucket, section), 0.0) + ms

    def summary(self) -> str:
        parts = []
        for bucket in ("prefill", "decode"):
            c = self.calls[bucket]
            if not c:
                parts.append(f"{bucket}: no calls")
                continue
            avg = {s: self.ms.get((bucket, s), 0.0) / c for s in ("routed", "shared", "allreduce")}
            parts.append(
                f"{bucket} [{self.path[bucket]}]: calls={c} "
                f"tokens/call={self.tokens[bucket] / c:.1f} "
                f"routed={avg['routed']:.3f}ms shared={avg['shared']:.3f}ms "
                f"allreduce={avg['allreduce']:.3f}ms"
            )
        return f"MoE summary (pid {os.getpid()}): " + " | ".join(parts)


_STATS = _MoeStats()


def _log_summary() -> None:
    if _STATS.total:
        logger.info(_STATS.summary())


if MOE_SUMMARY_EVERY:
    atexit.register(_log_summary)


def _sync(x: torch.Tensor) -> bool:
    """Synchronise for timing; False during CUDA-graph capture (then nothing is timed)."""
    if x.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return False
        torch.cuda.synchronize(x.device)
    return True


@contextlib.contextmanager
def _timed(x: torch.Tensor, bucket: str, section: str, on: bool) -> Iterator[None]:
    with _range(f"vo.moe.{bucket}.{section}"):
        if not on:
            yield
            return
        t0 = time.perf_counter()
        yield
        _sync(x)
        _STATS.add(bucket, section, (time.perf_counter() - t0) * 1e3)


def _moe_native_impl(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    block = _MOE_BLOCKS[layer_name]
    T = x.shape[0]
    bucket = "decode" if T <= MOE_DECODE_MAX_TOKENS else "prefill"
    native = MOE_NATIVE or (bucket == "decode" and MOE_DECODE_NATIVE)
    weights = _expert_weights(block) if native else None
    if native and weights is None:
        _info_once("moe-layout", "MOE_NATIVE: expert weights not in [E,2I,H]/[E,H,I]; upstream")
        native = False
    timing = bool(MOE_SUMMARY_EVERY) and _sync(x)
    if native:
        path = "native " + (
            "sort-by-expert" if bucket == "prefill" or MOE_DECODE_NATIVE else "gather+bmm"
        )
    else:
        path = "upstream fused (routed+shared+allreduce)"
    _mark(f"moe_{bucket}_{'native' if native else 'upstream'}")
    report_usage()

    if not native:
        with _timed(x, bucket, "routed", timing):
            out = block.experts(hidden_states=x, router_logits=x)
    else:
        assert weights is not None
        w13, w2 = weights
        with _timed(x, bucket, "routed", timing):
            logits = block.gate(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            out = _routed_experts(block, x, logits, bucket, w13, w2)
        if block.shared_expert is not None:
            with _timed(x, bucket, "shared", timing):
                out = out + block.shared_expert(x)
        if block.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            with _timed(x, bucket, "allreduce", timing):
                out = tensor_model_parallel_all_reduce(out)

    if timing:
        _STATS.calls[bucket] += 1
        _STATS.tokens[bucket] += T
        _STATS.path[bucket] = path
        _STATS.total += 1
        if _STATS.total % MOE_SUMMARY_EVERY == 0:
            _log_summary()
    return out


@torch.library.custom_op("vllm_overrides::native_moe", mutates_args=())
def native_moe(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The whole sparse-MoE block (router, experts, shared expert, all-reduce) for one layer;
    opaque to torch.compile."""
    return _moe_native_impl(x, layer_name)


@native_moe.register_fake
def _native_moe_fake(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _routed_experts(
    block: Any,
    x: torch.Tensor,
    logits: torch.Tensor,
    bucket: str,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    if bucket == "prefill":
        # Fused routing / expert order / activation / combine around the expert GEMMs where
        # the extension serves this device, else moe.route + moe.moe_experts_prefill.
        return kernels.moe_prefill(x, logits, block._vo_top_k, block._vo_renormalize, w13, w2)
    topk_w, topk_ids = kernels.moe_route(logits, block._vo_top_k, block._vo_renormalize)
    if MOE_DECODE_NATIVE:
        if moe.grouped_mm_available(x.device, x.dtype):
            return moe.moe_experts_decode(x, topk_w, topk_ids, w13, w2, "grouped")
        return moe.moe_experts_prefill(x, topk_w, topk_ids, w13, w2, "loop")
    # Fused kernels where they serve this device (expert weights read in place), else the
    # PyTorch gather + bmm path.
    return kernels.moe_decode(x, topk_w, topk_ids, w13, w2)


def _shared_weights(block: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The shared expert's plain weights ``(gate_up [2Is, H], down [H, Is], gate [1, H])``."""
    se = block.shared_expert
    if se is None:
        return None
    gate = getattr(se, "expert_gate", None)
    return se.gate_up_proj.weight, se.down_proj.weight, None if gate is None else gate.weight


@torch.library.custom_op("vllm_overrides::native_moe_experts", mutates_args=())
def native_moe_experts(
    x: torch.Tensor, router_logits: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """Routed and shared experts of one layer (no all-reduce), for CUDA-like devices: at decode
    sizes, where the fused kernels serve, routing + both expert kinds are 2 launches (routing in
    the up kernel; the shared expert rides along as one more expert); at prefill sizes the fused
    prefill kernels around the expert GEMMs; otherwise the routed op plus upstream's shared
    expert module."""
    block = _MOE_BLOCKS[layer_name]
    decode = x.shape[0] <= MOE_DECODE_MAX_TOKENS
    if not (decode and MOE_DECODE_NATIVE) and kernels.use_cuda(x):
        bucket = "decode" if decode else "prefill"
        # Decode: routing in the up kernel; prefill: the shared expert's gate and sum ride in
        # the combine kernel.
        fused = kernels.moe_decode_routed if decode else kernels.moe_prefill
        weights = _expert_weights(block)
        assert weights is not None  # checked when the block registered
        _mark(f"moe_{bucket}_native_fused")
        report_usage()
        with _range(f"vo.moe.{bucket}.fused"):
            return fused(
                x, router_logits, block._vo_top_k, block._vo_renormalize, *weights,
                _shared_weights(block),
            )  # fmt: skip
    out = native_moe_routed(x, router_logits, layer_name)
    if block.shared_expert is not None:
        out = out + block.shared_expert(x)
    return out


@native_moe_experts.register_fake
def _native_moe_experts_fake(
    x: torch.Tensor, router_logits: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("vllm_overrides::native_moe_routed", mutates_args=())
def native_moe_routed(
    x: torch.Tensor, router_logits: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """The routed experts of one layer (routing included; no shared expert, no all-reduce);
    opaque to torch.compile: its token-count dispatch and the prefill's data-dependent work stay
    out of the traced graph."""
    block = _MOE_BLOCKS[layer_name]
    bucket = "decode" if x.shape[0] <= MOE_DECODE_MAX_TOKENS else "prefill"
    weights = _expert_weights(block)
    assert weights is not None  # checked when the block registered
    _mark(f"moe_{bucket}_native")
    report_usage()
    with _range(f"vo.moe.{bucket}.routed"):
        return _routed_experts(block, x, router_logits, bucket, *weights)


@native_moe_routed.register_fake
def _native_moe_routed_fake(
    x: torch.Tensor, router_logits: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(x)


def moe_block_forward(block: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3NextSparseMoeBlock.forward`` on the native path (traceable)."""
    orig_shape = hidden_states.shape
    x = hidden_states.view(-1, hidden_states.shape[-1])
    if not block._vo_split:
        return torch.ops.vllm_overrides.native_moe(x, block._vo_name).view(orig_shape)
    logits = block.gate(x)
    logits = logits[0] if isinstance(logits, tuple) else logits
    if x.device.type == "cuda":
        out = torch.ops.vllm_overrides.native_moe_experts(x, logits, block._vo_name)
    else:
        # CPU: the shared expert stays in the compiled graph (eager it cost ~0.5 ms per layer).
        out = torch.ops.vllm_overrides.native_moe_routed(x, logits, block._vo_name)
        if block.shared_expert is not None:
            out = out + block.shared_expert(x)
    if block.tp_size > 1:
        from vllm.distributed import tensor_model_parallel_all_reduce

        out = tensor_model_parallel_all_reduce(out)
    return out.view(orig_shape)
