"""The torch-2.1 floor (issue 46): the shared core runs on the card's torch 2.1 / Python 3.10.

* every shared-core module (``vllm_overrides/`` outside ``engines/``) imports (the 0.32.0
  line's glue, which needs torch 2.4+, lives in ``engines/v1_0_32/``);
* each native op family, called through its selector (:mod:`vllm_overrides.native.kernels`, what
  the model calls), takes its PyTorch path on CPU, matches its float64 reference, and says so
  in ``kernels.PATHS``;
* the fused kernels, built for host threads (``NATIVE_KERNELS=emulate``: the kernels' own
  source, compiled with the host compiler against this torch), load under torch 2.1 and are
  the ones used: each family's path is ``emulated`` and the log says so. This is the check
  that fails if the kernels load but the ops silently run PyTorch (what torch 2.1 did before
  the fake registrations were made optional).

Runs in ``.venv-v0`` (``make test-v0``). It refuses any other torch, so it cannot pass by
running somewhere else. The emulation build is cached in ``build/torch_extensions/`` (about
30 s of CPU on a cold cache).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

assert torch.__version__.startswith("2.1"), (
    f"the floor test runs on the card's torch 2.1 (.venv-v0, make test-v0), not {torch.__version__}"
)
assert sys.version_info[:2] == (3, 10), f"the card's Python is 3.10, not {sys.version}"

import pytest  # noqa: E402

from vllm_overrides.native import gdn_reference as gref  # noqa: E402
from vllm_overrides.native import kernels, torch_compat  # noqa: E402
from vllm_overrides.native import moe_reference as mref  # noqa: E402
from vllm_overrides.native import paged_attention as pa  # noqa: E402
from vllm_overrides.native import paged_attention_reference as pref  # noqa: E402
from vllm_overrides.native import qk_norm_rope_reference as qref  # noqa: E402
from vllm_overrides.native import rmsnorm_reference as rref  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
# float32 PyTorch path / emulated kernels against float64 (relative L2 error); fp16 results
# (their names end in _fp16) against float64 of the same fp16 inputs.
TOL, TOL_FP16 = 1e-4, 3e-3


def _ok(errs: dict[str, float]) -> bool:
    return all(e <= (TOL_FP16 if k.endswith("_fp16") else TOL) for k, e in errs.items())


def _shared_core_modules() -> list[str]:
    root = REPO / "vllm_overrides"
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        if rel.parts[1] == "engines":  # per-generation code: each generation's tests import it
            continue
        if not (path.parent / "__init__.py").exists():  # csrc/setup.py: a build script
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(parts))
    return out


@pytest.mark.parametrize("module", _shared_core_modules())
def test_shared_core_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_newer_torch_apis_take_their_fallbacks() -> None:
    """torch 2.1 has neither ``register_fake`` (2.4) nor ``impl_abstract`` (2.2) nor
    ``torch.compiler.is_compiling`` (2.3): the compat layer's fallbacks are what runs here."""
    assert torch_compat.FAKE_API == "none"
    decorated = torch_compat.register_fake("vo_kernels::nothing")(len)
    assert decorated is len  # returned unregistered, no error
    # Dynamo's own flag: False in eager code, True while Dynamo traces (what _used relies on).
    assert torch_compat.is_compiling() is False

    def traced(x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 if torch_compat.is_compiling() else 0.0)

    got = torch.compile(traced, backend="eager", fullgraph=True)(torch.zeros(1))
    assert got.item() == 1.0 and traced(torch.zeros(1)).item() == 0.0


class _Records(logging.Handler):
    """The native ops' log records, read at the logger itself (vLLM's logging config stops
    ``vllm.*`` records from reaching pytest's root handler once vLLM is imported)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def native_log() -> Iterator[_Records]:
    log = logging.getLogger("vllm.vllm_overrides.native")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def test_moe_grouped_gemm_falls_back_to_the_expert_loop(
    native_log: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch._grouped_mm`` (newer torch) asked for by name: the per-expert loop, logged."""
    from vllm_overrides.native import moe

    assert not hasattr(torch, "_grouped_mm")
    monkeypatch.setattr(moe, "_LOGGED_NO_GROUPED", [])
    torch.manual_seed(0)
    x, logits = torch.randn(24, 64), torch.randn(24, 8)
    w13, w2 = torch.randn(8, 64, 64) * 0.125, torch.randn(8, 64, 32) * 0.18
    w, ids = moe.route(logits, 2, True)
    got = moe.moe_experts_prefill(x, w, ids, w13, w2, "grouped")
    dec = moe.moe_experts_decode(x[:3], w[:3], ids[:3], w13, w2, "grouped")
    assert torch.equal(got, moe.moe_experts_prefill(x, w, ids, w13, w2, "loop"))
    assert _err(got, mref.moe_experts_reference(x, w, ids, w13, w2)) <= TOL
    assert _err(dec, mref.moe_experts_reference(x[:3], w[:3], ids[:3], w13, w2)) <= TOL
    assert sum("no _grouped_mm" in line for line in native_log.lines) == 1, native_log.lines


# ------------------------------------------------------------------------------------------
# The op families: small float32 cases through the selectors, each against float64.
# ------------------------------------------------------------------------------------------


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _rms_norm() -> dict[str, float]:
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64) * 0.1
    out = kernels.gemma_rms_norm(x, w, 1e-6)
    out2, s = kernels.gemma_rms_norm(x, w, 1e-6, res.clone())
    want2, want_s = rref.gemma_fused_add_rms_norm_reference(x, res, w, 1e-6)
    return {
        "rms_norm": _err(out, rref.gemma_rms_norm_reference(x, w, 1e-6)),
        "rms_norm_residual": max(_err(out2, want2), _err(s, want_s)),
    }


def _rms_norm_gated() -> dict[str, float]:
    x, z, w = torch.randn(5, 4, 32), torch.randn(5, 4, 32), torch.rand(32) + 0.5
    out = kernels.rms_norm_gated(x, z, w, 1e-6)
    return {"rms_norm_gated": _err(out, gref.rms_norm_gated_reference(x, z, w, 1e-6))}


def _dense_linear() -> dict[str, float]:
    # fp16, the card's dtype: the decode GEMV takes 16-bit rows only (else the op runs
    # at::linear, which torch 2.1 lacks for fp16 on the CPU).
    x = torch.randn(1, 64).half()
    w = (torch.randn(48, 64) * 0.125).half()
    if kernels.use_cuda(x):  # emulated: the GEMV itself, not the op's at::linear fallback
        assert torch.ops.vo_kernels.dense_linear_takes(x, w)
        return {"dense_linear_fp16": _err(kernels.linear(x, w), x.double() @ w.double().T)}
    return {"dense_linear": _err(kernels.linear(x.float(), w.float()), x.double() @ w.double().T)}


# GDN shapes: H key heads, HV value heads, K = V head dims, conv width 4.
H, HV, K, V, W = 2, 4, 32, 32, 4
D = 2 * H * K + HV * V


def _gdn_params() -> tuple[torch.Tensor, ...]:
    weight = torch.randn(D, W) * 0.5
    bias = torch.randn(D) * 0.1
    A_log = torch.rand(HV).log()
    dt_bias = torch.randn(HV) * 0.1
    return weight, bias, A_log, dt_bias


def _gdn_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: tuple[torch.Tensor, ...],
    cu: list[int],
    conv0: torch.Tensor,
    ssm0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv, gates and the delta rule of packed sequences from float64 references:
    ``(o [T, HV, V], conv finals [N, D, W-1], state finals [N, HV, V, K])``."""
    weight, bias, A_log, dt_bias = params
    conv, conv_fin = gref.conv1d_reference(x, weight, bias, cu, conv0, "silu")
    q = conv[:, : H * K].reshape(-1, H, K)
    k = conv[:, H * K : 2 * H * K].reshape(-1, H, K)
    v = conv[:, 2 * H * K :].reshape(-1, HV, V)
    g, beta = gref.gdn_gating_reference(A_log, a, dt_bias, b)
    o, fin = gref.gated_delta_rule_reference(q, k, v, g, beta, cu, K**-0.5, ssm0, True)
    return o, conv_fin, fin


def _gdn_decode() -> dict[str, float]:
    """One decode step of three rows: slots 2 and 1, and a padding row (slot 0: zeros out,
    no state touched)."""
    params = _gdn_params()
    weight, bias, A_log, dt_bias = params
    slots = torch.tensor([2, 0, 1])
    x, a, b = torch.randn(3, D), torch.randn(3, HV), torch.randn(3, HV)
    conv_state = torch.randn(3, D, W - 1)
    ssm_state = torch.randn(3, HV, V, K) * 0.1
    conv_before, ssm_before = conv_state.clone(), ssm_state.clone()
    out = torch.full((3, HV, V), float("nan"))
    kernels.gdn_decode(
        x, a, b, conv_state, weight, bias, A_log, dt_bias, ssm_state, out, slots, H, K**-0.5
    )
    live = [0, 2]
    o, conv_fin, fin = _gdn_reference(
        x[live], a[live], b[live], params, [0, 1, 2], conv_before[[2, 1]], ssm_before[[2, 1]]
    )
    untouched = torch.equal(conv_state[0], conv_before[0]) and torch.equal(
        ssm_state[0], ssm_before[0]
    )
    return {
        "gdn_decode_out": _err(out[live], o),
        "gdn_decode_padding_row": 0.0 if torch.equal(out[1], torch.zeros(HV, V)) else 1.0,
        "gdn_decode_null_slot_untouched": 0.0 if untouched else 1.0,
        "gdn_decode_conv_state": _err(conv_state[[2, 1]], conv_fin),
        "gdn_decode_ssm_state": _err(ssm_state[[2, 1]], fin),
    }


def _gdn_prefill() -> dict[str, float]:
    """Two packed sequences (5 and 7 tokens), the first resuming from its cached states."""
    params = _gdn_params()
    weight, bias, A_log, dt_bias = params
    cu = [0, 5, 12]
    T = cu[-1]
    x, a, b = torch.randn(T, D), torch.randn(T, HV), torch.randn(T, HV)
    cache_indices = torch.tensor([2, 1])
    has_initial = torch.tensor([True, False])
    conv_states = torch.randn(3, D, W - 1)
    ssm_states = torch.randn(3, HV, V, K) * 0.1
    conv0 = conv_states[[2, 1]].clone()
    conv0[1] = 0
    ssm0 = ssm_states[[2, 1]].clone()
    ssm0[1] = 0
    q, k, v, g, beta = kernels.gdn_conv_prep(
        x, weight, bias, conv_states, torch.tensor(cu), cache_indices, has_initial, "silu",
        a, b, A_log, dt_bias, H, K, V,
    )  # fmt: skip
    o, final = kernels.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], K**-0.5, ssm0,
        cu_seqlens=torch.tensor(cu), use_qk_l2norm_in_kernel=False,
    )  # fmt: skip
    o_ref, conv_fin, fin = _gdn_reference(x, a, b, params, cu, conv0, ssm0)
    return {
        "gdn_prefill_out": _err(o[0], o_ref),
        "gdn_prefill_conv_state": _err(conv_states[[2, 1]], conv_fin),
        "gdn_prefill_ssm_state": _err(final, fin),
    }


# MoE shapes: E experts, top-k, hidden Hm, expert intermediate I, shared expert Is.
E, TOPK, Hm, I, Is = 16, 4, 64, 32, 32  # noqa: E741


def _moe_weights() -> tuple[torch.Tensor, ...]:
    w13 = torch.randn(E, 2 * I, Hm) * Hm**-0.5
    w2 = torch.randn(E, Hm, I) * I**-0.5
    shared = (torch.randn(2 * Is, Hm) * Hm**-0.5, torch.randn(Hm, Is) * Is**-0.5,
              torch.randn(1, Hm) * Hm**-0.5)  # fmt: skip
    return w13, w2, *shared


def _moe_reference(x: torch.Tensor, logits: torch.Tensor, weights: tuple) -> torch.Tensor:
    w13, w2, sg, sd, sgate = weights
    return mref.sparse_moe_block_reference(
        x, None, w13, w2, TOPK, True, sg, sd, sgate, router_logits=logits
    )


def _moe_route() -> dict[str, float]:
    logits = torch.randn(6, E)
    w, ids = kernels.moe_route(logits, TOPK, True)
    want_w, want_ids = mref.route_reference(logits, TOPK, True)
    return {"moe_route_ids": 0.0 if torch.equal(ids, want_ids) else 1.0,
            "moe_route_weights": _err(w, want_w)}  # fmt: skip


def _moe_decode() -> dict[str, float]:
    weights = _moe_weights()
    x, logits = torch.randn(2, Hm), torch.randn(2, E)
    out = kernels.moe_decode_routed(x, logits, TOPK, True, weights[0], weights[1], weights[2:])
    # More tokens than the routed kernel takes: route, then the decode experts.
    x8, logits8 = torch.randn(8, Hm), torch.randn(8, E)
    w, ids = kernels.moe_route(logits8, TOPK, True)
    out8 = kernels.moe_decode(x8, w, ids, weights[0], weights[1], weights[2:])
    return {"moe_decode_routed": _err(out, _moe_reference(x, logits, weights)),
            "moe_decode": _err(out8, _moe_reference(x8, logits8, weights))}  # fmt: skip


def _moe_prefill() -> dict[str, float]:
    weights = _moe_weights()
    x, logits = torch.randn(40, Hm), torch.randn(40, E)
    out = kernels.moe_prefill(x, logits, TOPK, True, weights[0], weights[1], weights[2:])
    return {"moe_prefill": _err(out, _moe_reference(x, logits, weights))}


def _qk_norm_rope() -> dict[str, float]:
    """Gated attention's q/k prep: Qwen3.6's partial rotary (a quarter of the head) with
    interleaved MRoPE positions, and plain 1-D positions."""
    T, nq, nkv, Dh, rot, max_pos = 5, 2, 1, 64, 16, 64
    inv = 1.0 / (1e4 ** (torch.arange(0, rot, 2).double() / rot))
    freqs = torch.arange(max_pos).double()[:, None] * inv[None]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
    q_gate, k = torch.randn(T, nq * 2 * Dh), torch.randn(T, nkv * Dh)
    qw, kw = torch.randn(Dh) * 0.1, torch.randn(Dh) * 0.1
    errs = {}
    for name, pos, sec in (("mrope", torch.randint(0, max_pos, (3, T)), [3, 3, 2]),
                           ("rope", torch.randint(0, max_pos, (T,)), None)):  # fmt: skip
        args = (q_gate, k, qw, kw, cache, pos, 1e-6, nq, nkv, Dh, rot, sec)
        got = kernels.qk_norm_rope_gate(*args)
        want = qref.qk_norm_rope_gate_reference(*args)
        errs[f"qk_norm_rope_{name}"] = max(_err(g, w) for g, w in zip(got, want, strict=True))
    return errs


def _paged_attention() -> dict[str, float]:
    """Two sequences on a paged cache (GQA 2, head 64, blocks of 8, tables in scattered
    blocks): new keys / values written through their slots (one a pad slot, skipped), a
    decode step over 20 and 12 cached tokens, and a prefill chunk of 3 new tokens over the
    first one's cache plus 4 tokens with none cached."""
    Hq, KVh, Dh, bs = 4, 2, 64, 8
    kc, vc = pa.split_kv_cache(torch.randn(pa.kv_cache_shape(6, bs, KVh, Dh)))
    key, value = torch.randn(3, KVh, Dh), torch.randn(3, KVh, Dh)
    slots = torch.tensor([9, -1, 20])
    want_k, want_v = pref.write_kv_reference(key, value, kc, vc, slots)
    kernels.paged_write_kv(key, value, kc, vc, slots)
    tables = torch.tensor([[1, 3, 5], [4, 2, 0]], dtype=torch.int32)
    scale = Dh**-0.5
    q = torch.randn(2, Hq, Dh)
    lens = torch.tensor([20, 12], dtype=torch.int32)
    dec = kernels.paged_decode_attention(q, kc, vc, tables, lens, scale, 20)
    qlens, clens = [3, 4], [20, 0]
    qp, kp, vp = torch.randn(7, Hq, Dh), torch.randn(7, KVh, Dh), torch.randn(7, KVh, Dh)
    pre = kernels.paged_prefill_attention(qp, kp, vp, kc, vc, tables, qlens, clens, scale)
    want_pre = pref.prefill_attention_reference(qp, kp, vp, kc, vc, tables, qlens, clens, scale)
    return {
        "paged_write_kv": max(_err(kc, want_k), _err(vc, want_v)),
        "paged_decode": _err(dec, pref.decode_attention_reference(q, kc, vc, tables, [20, 12],
                                                                  scale)),
        "paged_prefill": _err(pre, want_pre),
    }  # fmt: skip


# Each family's runner and the selector ops it must have gone through.
FAMILIES: dict[str, tuple[Callable[[], dict[str, float]], tuple[str, ...]]] = {
    "RMSNorm": (_rms_norm, ("gemma_rms_norm",)),
    "gated RMSNorm": (_rms_norm_gated, ("rms_norm_gated",)),
    "dense linear": (_dense_linear, ("dense_linear",)),
    "GDN decode": (_gdn_decode, ("gdn_decode",)),
    "GDN prefill": (_gdn_prefill, ("gdn_conv_prep", "gdn_chunk_prefill")),
    "MoE route": (_moe_route, ("moe_route",)),
    "MoE decode": (_moe_decode, ("moe_decode_routed", "moe_decode_with_shared")),
    "MoE prefill": (_moe_prefill, ("moe_prefill_with_shared",)),
    "qk-norm-rope": (_qk_norm_rope, ("qk_norm_rope_gate",)),
    "paged attention": (_paged_attention, ("paged_write_kv", "paged_decode", "paged_prefill")),
}


def run_families() -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    return {family: run() for family, (run, _) in FAMILIES.items()}


@pytest.fixture
def torch_backend() -> Iterator[None]:
    """CPU tensors on the PyTorch ops (what the stand-in's engine runs by default), whatever
    another test of the session left behind; path records cleared, so the first call logs."""
    mode, emulated = kernels._mode, kernels._emulated
    kernels.set_backend("auto")
    kernels.disable_cpu_emulation()
    kernels.PATHS.clear()
    kernels.TORCH_USED.clear()
    kernels.FUSED_USED.clear()
    yield
    kernels.set_backend(mode)
    kernels._emulated = emulated


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pytorch_path_matches_float64(
    family: str, torch_backend: None, native_log: _Records
) -> None:
    torch.manual_seed(0)
    run, ops = FAMILIES[family]
    errs = run()
    assert _ok(errs), errs
    # The selector took (and recorded) the PyTorch path; MoE decode's routed variant falls
    # back to its two parts, which record themselves.
    ops = tuple(op.removesuffix("_with_shared") for op in ops if op != "moe_decode_routed")
    for op in ops:
        assert kernels.PATHS.get(op) == {"torch"}, (op, kernels.PATHS)
        logged = [line for line in native_log.lines if f"[{op}]: PyTorch ops" in line]
        assert len(logged) == 1, native_log.lines  # once, however many calls
    assert not kernels.FUSED_USED


def _run_emulated(*hidden: str) -> tuple[dict, str]:
    """The families in a subprocess on the emulated kernels (``NATIVE_KERNELS=emulate``), with
    the library ops ``hidden`` reported missing (as from a library built without their source):
    ``(its JSON result, its log)``."""
    env = dict(os.environ)
    env.update(
        NATIVE_KERNELS="emulate",
        GDN_CHUNK_KERNEL="fused",  # the fused chunk prefill is opt-in (the YAML turns it on)
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    # One build per torch: the .venv (newer torch) builds the same sources under its own name.
    env.setdefault(
        "TORCH_EXTENSIONS_DIR",
        str(REPO / "build" / "torch_extensions" / f"py310-torch{torch.__version__.split('+')[0]}"),
    )
    proc = subprocess.run(
        [sys.executable, __file__, *hidden], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_fused_kernels_emulated_are_the_ops_used() -> None:
    """The kernels compiled for host threads under this torch serve every op family: each
    family's path is ``emulated`` (never ``torch``), results match float64, and the log has
    one line per op naming the path."""
    result, log = _run_emulated()
    errs, paths = result["errs"], result["paths"]
    for family, (_, ops) in FAMILIES.items():
        assert _ok(errs[family]), (family, errs[family])
        for op in ops:
            assert paths.get(op) == ["emulated"], (family, op, paths)
            assert f"[{op}]: fused kernel emulated on host threads" in log, op
    assert not [op for op, p in paths.items() if p != ["emulated"]], paths  # no PyTorch path
    assert set(result["fused_used"]) >= {op for _, ops in FAMILIES.values() for op in ops}


# moe_prefill.cu's ops: a library whose build left that source out lacks exactly these.
MOE_PREFILL_CU_OPS = ("moe_route", "moe_route_count", "moe_permute", "moe_order", "moe_act",
                      "moe_combine")  # fmt: skip


def test_a_family_missing_from_the_library_takes_its_pytorch_path_alone() -> None:
    """The library loads without one source's ops (``moe_prefill.cu``'s: routing and MoE
    prefill): those selectors take their PyTorch path, each with one log line saying the
    library was built without them, and every other family still runs on the kernels."""
    result, log = _run_emulated(*MOE_PREFILL_CU_OPS)
    errs, paths = result["errs"], result["paths"]
    for family in FAMILIES:
        assert _ok(errs[family]), (family, errs[family])
    for op in ("moe_route", "moe_prefill"):
        assert paths.get(op) == ["torch"], (op, paths)
        line = f"[{op}]: PyTorch ops (vo_native_kernels was built without "
        assert log.count(line) == 1, log[-5000:]
    others = {op for family, (_, ops) in FAMILIES.items() if family not in ("MoE route",
              "MoE prefill") for op in ops}  # fmt: skip
    for op in others:  # MoE decode's ops live in native_kernels.cu: still on the kernels
        assert paths.get(op) == ["emulated"], (op, paths)


def _emulated_main() -> None:
    """The subprocess of :func:`test_fused_kernels_emulated_are_the_ops_used`."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    hidden = set(sys.argv[1:])  # library ops to report missing (see _run_emulated)
    if hidden:
        has = kernels._lib_has
        kernels._lib_has = lambda name: name not in hidden and has(name)
    errs = run_families()
    out = {
        "errs": errs,
        "paths": {op: sorted(p) for op, p in kernels.PATHS.items()},
        "fused_used": sorted(kernels.FUSED_USED),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    _emulated_main()
