"""The fused CUDA kernels (``vllm_overrides.native.kernels``) against the float64 references and
against the PyTorch path.

Every test runs twice over: on a GPU (``cuda``: the real build; skipped without one, and run by
``scripts/gpu_kernel_tests.sh``, which JIT-builds the extension -- there a missing extension is
a failure, not a skip), and on the CPU through ``csrc/cpu_emulation.h`` (``emu64`` / ``emu32``:
the very same kernel source and host wrappers on host threads, with the target's 64-lane warps
and NVIDIA's 32), at smaller sizes, so CPU CI checks the kernels' logic, indexing, slot
handling and warp-width independence. Speed and graph capture need the GPU.

Tolerances (relative L2 error against float64): fp32 activations 1e-5, fp16 3e-3, bf16 1.5e-2 --
the PyTorch path's own errors on the same inputs are of that order, and the tests also require
the fused result to be no further from float64 than twice the PyTorch path's error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from native_util import rel_err

from vllm_overrides.native import gdn, kernels, moe
from vllm_overrides.native import gdn_reference as gref
from vllm_overrides.native import moe_reference as mref
from vllm_overrides.native import qk_norm_rope_reference as qref
from vllm_overrides.native import rmsnorm_reference as rref

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(
    not CUDA,
    reason="GPU-only: the fused CUDA kernels run on the device (scripts/gpu_kernel_tests.sh); "
    "CPU CI covers the PyTorch path and the backend selection",
)
# One process holds one build of the ``vo_kernels`` library: where the CUDA build serves the GPU,
# the emulated build cannot be loaded beside it (the emulated cases are CPU CI's).
emu = pytest.mark.skipif(
    CUDA, reason="emulation cases run in CPU CI; on a GPU the CUDA build of vo_kernels is loaded"
)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _cpu_half_gemm() -> bool:
    a = torch.ones(1, 2, 2, dtype=torch.float16)
    try:
        torch.bmm(a, a), torch.mm(a[0], a[0])
    except RuntimeError:  # torch 2.1: "addmm_impl_cpu_" not implemented for 'Half'
        return False
    return True


CPU_HALF_GEMM = _cpu_half_gemm()


def needs_cpu_half_gemm(kdev: str, dtype: torch.dtype) -> None:
    """Skip an emulated fp16 case whose PyTorch comparison needs an fp16 GEMM on the CPU, which
    torch 2.1 (the card's, .venv-v0) lacks; these cases run in .venv and on the GPU."""
    if kdev == "cpu" and dtype == torch.float16 and not CPU_HALF_GEMM:
        pytest.skip(f"torch {torch.__version__} has no fp16 GEMM on the CPU")


DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture
def kdev(request: pytest.FixtureRequest) -> Iterator[str]:
    """The device the fused kernels run on: ``cuda``, or ``cpu`` under emulation."""
    name = request.param
    if name == "cuda":
        kernels.set_backend("cuda")
        assert kernels.extension_loaded(), f"vo_native_kernels did not load: {kernels._load_error}"
    else:
        kernels.enable_cpu_emulation(warp_size=int(name.removeprefix("emu")))
        kernels.set_backend("cuda")
    yield "cuda" if name == "cuda" else "cpu"
    kernels.disable_cpu_emulation()
    kernels.set_backend("auto")


def cases(gpu_sizes: list, emu_sizes: list) -> list:
    """(device, size) pairs: every GPU size, the emulation's sizes with 64-lane warps, and the
    first emulation size again with 32-lane warps."""
    out = [pytest.param("cuda", s, marks=gpu, id=f"cuda-{s}") for s in gpu_sizes]
    out += [pytest.param("emu64", s, marks=emu, id=f"emu64-{s}") for s in emu_sizes]
    return out + [pytest.param("emu32", emu_sizes[0], marks=emu, id=f"emu32-{emu_sizes[0]}")]


def _both(fn, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202 - small test helper
    """Run ``fn`` on the fused kernels and on the PyTorch path (inputs cloned for each)."""
    out = {}
    for name in ("cuda", "torch"):
        kernels.set_backend(name)
        a = [x.clone() if torch.is_tensor(x) else x for x in args]
        out[name] = (fn(*a, **kw), a)
    kernels.set_backend("cuda")
    return out


def _check(fused: torch.Tensor, torch_path: torch.Tensor, ref: torch.Tensor, dtype) -> None:  # noqa: ANN001
    e_f, e_t = rel_err(fused, ref), rel_err(torch_path, ref)
    assert e_f <= max(TOL[dtype], 2 * e_t), (e_f, e_t)


# ------------------------------------------------------------------------------------------
# RMSNorms
# ------------------------------------------------------------------------------------------


def _both_in_place(fn, *args):  # noqa: ANN001, ANN002, ANN202 - small test helper
    """:func:`_both` without the clones (they would realign misaligned views)."""
    out = {}
    for name in ("cuda", "torch"):
        kernels.set_backend(name)
        out[name] = (fn(*args), args)
    kernels.set_backend("cuda")
    return out


def _check_gemma(
    x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, clone: bool = True
) -> None:
    """Both gemma norms (plain and residual-fused) on the kernels vs float64 and PyTorch."""
    run = _both if clone else _both_in_place
    r = run(kernels.gemma_rms_norm, x, w, 1e-6)
    ref = rref.gemma_rms_norm_reference(x.cpu(), w.cpu(), 1e-6)
    _check(r["cuda"][0].cpu(), r["torch"][0].cpu(), ref, dtype)
    r = run(kernels.gemma_rms_norm, x, w, 1e-6, res)
    ref_out, ref_sum = rref.gemma_fused_add_rms_norm_reference(x.cpu(), res.cpu(), w.cpu(), 1e-6)
    (out_c, res_c), (out_t, res_t) = r["cuda"][0], r["torch"][0]
    _check(out_c.cpu(), out_t.cpu(), ref_out, dtype)
    assert torch.equal(res_c, res_t)  # the new residual is x + residual rounded once
    assert rel_err(res_c.cpu(), ref_sum) <= TOL[dtype]


# Hidden sizes (every lane geometry of gemma_rms_norm_launch): whole 16-byte vectors (2048: one
# per lane of a 256-thread block; 128, 400: a 16-lane group per row with 1 to 4 vectors per lane,
# the last block partly idle; 1024, 4160: the test build's 128-thread blocks with 1 and more than
# 4 vectors per lane, the latter read twice) and the scalar path (13, 30, 42: a lane group with 1
# to 4 elements per lane, rows over several blocks; 100 in 16-bit types; 2050: longer than the
# registers hold).
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize(
    "kdev,shape",
    cases(
        [(1, 2048), (7, 2048), (32, 2048), (16384, 2048), (3, 5, 128), (4, 400), (5, 100),
         (17, 13), (6, 30), (9, 42), (2, 2050), (3, 8200)],
        [(2, 2048), (1, 2048), (3, 5, 128), (4, 400), (3, 1024), (2, 4160), (5, 100), (17, 13),
         (6, 30), (9, 42), (2, 2050)],
    ),
    indirect=["kdev"],
)  # fmt: skip
def test_gemma_rms_norm(kdev: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=kdev).to(dtype)
    res = torch.randn(shape, device=kdev).to(dtype)
    w = (torch.randn(shape[-1], device=kdev) * 0.1).to(dtype)
    _check_gemma(x, res, w, dtype)


# Rows of whole vectors whose pointers are one element off 16-byte alignment: the scalar path.
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize("kdev,which", cases(["x", "residual", "weight"], ["x", "residual", "weight"]),
                         indirect=["kdev"])  # fmt: skip
def test_gemma_rms_norm_misaligned(kdev: str, dtype: torch.dtype, which: str) -> None:
    rows, H = 3, 256

    def make(n: int, off: bool, scale: float = 1.0) -> torch.Tensor:
        t = (torch.randn(n + 1, device=kdev) * scale).to(dtype)
        return t[1:] if off else t[:n]

    x = make(rows * H, which == "x").view(rows, H)
    res = make(rows * H, which == "residual").view(rows, H)
    w = make(H, which == "weight", 0.1)
    for name, t in (("x", x), ("residual", res), ("weight", w)):
        assert (t.data_ptr() % 16 != 0) == (which == name)
    _check_gemma(x, res, w, dtype, clone=False)


# (T, HV, V): rows of whole 16-byte vectors (the vector loads; 40 rows leave the last block's
# lane groups partly idle), and rows of 100 elements (the scalar loads).
@pytest.mark.parametrize("shape", [(5, 8, 128), (37, 3, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize("kdev,activation", cases(["silu", "sigmoid"], ["silu", "sigmoid"]),
                         indirect=["kdev"])  # fmt: skip
def test_rms_norm_gated_strided_gate(
    kdev: str, dtype: torch.dtype, activation: str, shape: tuple[int, int, int]
) -> None:
    T, HV, V = shape
    x = torch.randn(T, HV, V, device=kdev).to(dtype)
    # z as vLLM slices it out of the projection: rows wider than HV * V.
    proj = torch.randn(T, 3 * HV * V, device=kdev).to(dtype)
    z = proj[:, HV * V : 2 * HV * V].view(T, HV, V)
    w = (1 + 0.1 * torch.randn(V, device=kdev)).to(dtype)
    r = _both(kernels.rms_norm_gated, x, z, w, 1e-6, activation)
    if activation == "silu":
        ref = gref.rms_norm_gated_reference(x.cpu(), z.cpu(), w.cpu(), 1e-6)
    else:
        x64, z64 = x.cpu().double(), z.cpu().double()
        ref = x64 * torch.rsqrt((x64**2).mean(-1, keepdim=True) + 1e-6) * w.cpu().double()
        ref = ref * torch.sigmoid(z64)
    _check(r["cuda"][0].cpu(), r["torch"][0].cpu(), ref, dtype)


# ------------------------------------------------------------------------------------------
# Decode GEMV
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
# K = 2560: rounds of four steps and a remainder (one step = warpSize x 16 bytes of a row).
@pytest.mark.parametrize("NK", [(37, 264), (256, 2048), (3088, 1024), (40, 2560)])
@pytest.mark.parametrize("kdev,M", cases([1, 3, 8], [2]), indirect=["kdev"])
def test_dense_linear_vs_reference_and_torch(
    kdev: str, dtype: torch.dtype, NK: tuple[int, int], M: int
) -> None:
    """The decode GEMV against float64 and F.linear: row counts that are not a multiple of a
    warp's rows, K not a multiple of a warp's span, x a row-strided view."""
    needs_cpu_half_gemm(kdev, dtype)
    N, K = NK
    w = (torch.randn(N, K, device=kdev) * K**-0.5).to(dtype)
    x = torch.randn(M, K + 16, device=kdev).to(dtype)[:, 8 : 8 + K]  # rows 16-byte aligned
    assert torch.ops.vo_kernels.dense_linear_takes(x, w)  # the GEMV, not its fallback
    got = torch.ops.vo_kernels.dense_linear(x, w)
    ref = x.cpu().double() @ w.cpu().double().T
    assert got.shape == (M, N) and got.dtype == dtype
    _check(got.cpu(), F.linear(x, w).cpu(), ref, dtype)
    # kernels.linear sends GEMV_MAX_ROWS rows there, more to F.linear
    want = got if M <= kernels.GEMV_MAX_ROWS else F.linear(x, w)
    assert torch.equal(kernels.linear(x, w), want)


@pytest.mark.parametrize("kdev,case", cases(["rows", "misaligned", "fp32"], ["rows"]),
                         indirect=["kdev"])  # fmt: skip
def test_dense_linear_falls_back_to_at_linear(kdev: str, case: str) -> None:
    """What the GEMV does not take goes to at::linear inside the op: results equal F.linear."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    M = kernels.GEMV_MAX_ROWS + 1 if case == "rows" else 2
    w = torch.randn(40, 64, device=kdev).to(dtype)
    x = torch.randn(M, 65, device=kdev).to(dtype)
    x = x[:, 1:] if case == "misaligned" else x[:, :64]
    assert not torch.ops.vo_kernels.dense_linear_takes(x, w)
    got = torch.ops.vo_kernels.dense_linear(x, w)
    assert torch.equal(got, F.linear(x, w))


# ------------------------------------------------------------------------------------------
# Gated DeltaNet decode
# ------------------------------------------------------------------------------------------


def _padded(t: torch.Tensor, pad: int = 96) -> torch.Tensor:
    """``t`` copied into slots with ``pad`` unused elements after each (contiguous within)."""
    buf = torch.full((t.shape[0], t[0].numel() + pad), float("nan"), device=t.device)
    buf[:, : t[0].numel()] = t.reshape(t.shape[0], -1)
    return buf[:, : t[0].numel()].view(t.shape)


def _gdn_inputs(
    B: int, dtype: torch.dtype, slots: list[int], n_slots: int, dev: str = "cuda", W: int = 4
) -> dict:
    H, HV, K, V = 4, 8, 128, 128
    D = 2 * H * K + HV * V
    return {
        "H": H, "HV": HV, "K": K, "V": V, "D": D,
        # vLLM's "SD" conv cache [slots, W-1, D], passed transposed as the kernels' view.
        "conv_sd": torch.randn(n_slots, W - 1, D, device=dev).to(dtype),
        "conv_w": (torch.randn(D, W, device=dev) * 0.5).to(dtype),
        "conv_b": (torch.randn(D, device=dev) * 0.1).to(dtype),
        "A_log": torch.log(torch.empty(HV, device=dev).uniform_(0.05, 16.0)),
        "dt_bias": torch.randn(HV, device=dev),
        # vLLM pads each mamba page to the attention page size: slots are not back to back.
        "ssm": _padded(torch.randn(n_slots, HV, V, K, device=dev) * 0.2),
        "slots": torch.tensor(slots, device=dev, dtype=torch.int32),
    }  # fmt: skip


def _gdn_step(inp: dict, conv_sd: torch.Tensor, ssm: torch.Tensor, qkv, a, b, dtype):  # noqa: ANN001, ANN202
    out = torch.full((qkv.shape[0], inp["HV"], inp["V"]), float("nan"), device=qkv.device,
                     dtype=dtype)  # fmt: skip
    kernels.gdn_decode(
        qkv, a, b, conv_sd.transpose(-1, -2), inp["conv_w"], inp["conv_b"], inp["A_log"],
        inp["dt_bias"], ssm, out, inp["slots"], inp["H"], inp["K"] ** -0.5,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", DTYPES)
# B x 8 value heads <= 132 (the emulation's SM count, an H200's) takes one value head a block,
# more takes a key head's two (gdn_decode_kernel)
@pytest.mark.parametrize("kdev,B", cases([1, 3, 64, 256], [3, 1, 17]), indirect=["kdev"])
@pytest.mark.parametrize("W", [4, 2])  # the model's conv width (its own code path) and another
def test_gdn_decode_vs_reference_and_torch(kdev: str, dtype: torch.dtype, B: int, W: int) -> None:
    n_slots = B + 8
    perm = (torch.randperm(n_slots - 1) + 1)[:B].tolist()
    # Dead rows: vLLM's null block (0) and padding (-1) in the batch.
    if B >= 3:
        perm[1], perm[-1] = 0, -1
    inp = _gdn_inputs(B, dtype, perm, n_slots, kdev, W)
    live = [i for i, s in enumerate(perm) if s > 0]
    live_slots = [perm[i] for i in live]
    dead_slots = sorted(set(range(n_slots)) - set(live_slots))
    states = {name: (inp["conv_sd"].clone(), _padded(inp["ssm"])) for name in ("cuda", "torch")}
    assert not states["cuda"][1].is_contiguous()
    ref_conv = inp["conv_sd"][live_slots].transpose(-1, -2).double().cpu()
    ref_ssm = inp["ssm"][live_slots].double()
    for _step in range(3):  # state carry across steps
        qkv = torch.randn(B, inp["D"], device=kdev).to(dtype)
        a = torch.randn(B, inp["HV"], device=kdev).to(dtype)
        b = torch.randn(B, inp["HV"], device=kdev).to(dtype)
        outs = {}
        for name in ("cuda", "torch"):
            kernels.set_backend(name)
            outs[name] = _gdn_step(inp, *states[name], qkv, a, b, dtype)
        kernels.set_backend("cuda")
        # float64 reference: conv (one token per live sequence), gates, recurrence.
        n = len(live)
        x, fin = gref.conv1d_reference(
            qkv[live].cpu(), inp["conv_w"].cpu(), inp["conv_b"].cpu(), list(range(n + 1)), ref_conv
        )
        ref_conv = fin
        x = x.to(dtype).to(torch.float64)  # upstream's conv output is in the activation dtype
        q, k, v = gdn.split_mixed_qkv(x, inp["H"], inp["K"], inp["V"])
        g, beta = gref.gdn_gating_reference(
            inp["A_log"].cpu(), a[live].cpu(), inp["dt_bias"].cpu(), b[live].cpu()
        )
        o_ref, ref_ssm = gref.gated_delta_rule_reference_fast(
            q.to(kdev), k.to(kdev), v.to(kdev), g.view(n, -1).to(kdev), beta.view(n, -1).to(kdev),
            list(range(n + 1)), initial_state=ref_ssm,
        )  # fmt: skip
        _check(outs["cuda"][live].cpu(), outs["torch"][live].cpu(), o_ref.cpu(), dtype)
        for o in outs.values():
            assert not torch.isnan(o).any()
            if len(live) < B:
                assert torch.count_nonzero(o[[i for i in range(B) if i not in live]]) == 0
    for name in ("cuda", "torch"):
        conv_sd, ssm = states[name]
        # float32 state; its inputs are rounded conv outputs, where a 1-ulp rounding difference
        # against the float64 conv moves the state at the activation dtype's precision.
        assert rel_err(ssm[live_slots].cpu(), ref_ssm.cpu()) <= TOL[dtype]
        assert rel_err(conv_sd[live_slots].transpose(-1, -2).cpu(), ref_conv) <= TOL[dtype]
        assert torch.equal(ssm[dead_slots], inp["ssm"][dead_slots])
        assert torch.equal(conv_sd[dead_slots], inp["conv_sd"][dead_slots])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("kdev,B", cases([1, 5, 64], [5, 17]), indirect=["kdev"])
def test_gdn_decode_fused_output_norm(
    kdev: str, dtype: torch.dtype, activation: str, B: int
) -> None:
    """``gdn_decode(..., z=, norm_weight=)`` equals the decode step followed by the layer's
    gated RMSNorm: on the fused kernel (one launch) and on the PyTorch path, against the
    float64 norm of the unfused output; dead rows stay zero and states advance identically."""
    n_slots = B + 4
    perm = (torch.randperm(n_slots - 1) + 1)[:B].tolist()
    if B >= 3:
        perm[1] = 0  # vLLM's null block: the row must come out zero, normed or not
    inp = _gdn_inputs(B, dtype, perm, n_slots, kdev)
    HV, V = inp["HV"], inp["V"]
    qkv = torch.randn(B, inp["D"], device=kdev).to(dtype)
    a = torch.randn(B, HV, device=kdev).to(dtype)
    b = torch.randn(B, HV, device=kdev).to(dtype)
    # z as the merged projection hands it over: a strided slice of a wider row.
    proj = torch.randn(B, 2 * HV * V + 8, device=kdev).to(dtype)
    z = proj[:, 8 : 8 + HV * V].view(B, HV, V)
    w = (1 + 0.1 * torch.randn(V, device=kdev)).to(dtype)
    ssm0 = inp["ssm"]

    def step(norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        conv_sd, ssm = inp["conv_sd"].clone(), _padded(ssm0)
        out = torch.full((B, HV, V), float("nan"), device=kdev, dtype=dtype)
        kernels.gdn_decode(
            qkv, a, b, conv_sd.transpose(-1, -2), inp["conv_w"], inp["conv_b"], inp["A_log"],
            inp["dt_bias"], ssm, out, inp["slots"], inp["H"], inp["K"] ** -0.5,
            z=z if norm else None, norm_weight=w if norm else None, norm_eps=1e-6,
            norm_activation=activation,
        )  # fmt: skip
        return out, conv_sd, ssm

    outs = {}
    for name in ("cuda", "torch"):
        kernels.set_backend(name)
        raw, conv_r, ssm_r = step(False)
        normed, conv_n, ssm_n = step(True)
        assert torch.equal(ssm_r, ssm_n) and torch.equal(conv_r, conv_n)
        outs[name] = (raw, normed)
    kernels.set_backend("cuda")
    raw64, z64 = outs["cuda"][0].cpu().double(), z.cpu().double()
    ref = raw64 * torch.rsqrt((raw64**2).mean(-1, keepdim=True) + 1e-6) * w.cpu().double()
    ref = ref * (torch.sigmoid(z64) if activation == "sigmoid" else torch.nn.functional.silu(z64))
    live = [i for i, s in enumerate(perm) if s > 0]
    _check(outs["cuda"][1][live].cpu(), outs["torch"][1][live].cpu(), ref[live], dtype)
    for _raw, normed in outs.values():
        assert not torch.isnan(normed).any()
        dead = [i for i in range(B) if i not in live]
        if dead:
            assert torch.count_nonzero(normed[dead]) == 0


# ------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("kdev,T", cases([1, 5, 32], [5]), indirect=["kdev"])
def test_moe_route_ties_and_weights(
    kdev: str, dtype: torch.dtype, renormalize: bool, T: int
) -> None:
    E, k = 256, 8
    logits = torch.randn(T, E, device=kdev).to(dtype)
    # Many exact ties: a few distinct values, so the tie order decides the picks.
    logits[: (T + 1) // 2] = torch.randint(-2, 3, (((T + 1) // 2), E), device=kdev).to(dtype)
    r = _both(kernels.moe_route, logits, k, renormalize)
    (w_c, id_c), (w_t, id_t) = r["cuda"][0], r["torch"][0]
    assert id_c.dtype == torch.int64 and w_c.dtype == torch.float32
    assert torch.equal(id_c, id_t)
    assert rel_err(w_c, w_t) <= 1e-6
    w_ref, id_ref = mref.route_reference(logits.cpu(), k, renormalize)
    assert torch.equal(id_c.cpu(), id_ref)
    assert rel_err(w_c.cpu(), w_ref) <= 1e-6


@pytest.mark.parametrize("E", [8, 256, 320])
@pytest.mark.parametrize(
    "kdev", [pytest.param("emu64", marks=emu), pytest.param("cuda", marks=gpu)], indirect=True
)
def test_moe_route_expert_counts_and_minus_inf(kdev: str, E: int) -> None:
    """Fewer experts than a lane group holds (8), the register-resident logits (256) and the
    shared-memory rounds beyond them (320); rows with fewer finite logits than top-k, so -inf
    ties are picked by expert index."""
    T, k = 4, 8
    logits = torch.randn(T, E, device=kdev)
    logits[1, : E - 3] = -torch.inf  # 3 finite logits, then the lowest -inf indices
    logits[2] = torch.randint(-2, 3, (E,), device=kdev).float()  # exact ties
    logits[3, ::2] = -torch.inf
    for renormalize in (True, False):
        r = _both(kernels.moe_route, logits, k, renormalize)
        (w_c, id_c), (w_t, id_t) = r["cuda"][0], r["torch"][0]
        w_ref, id_ref = mref.route_reference(logits.cpu(), k, renormalize)
        assert torch.equal(id_c.cpu(), id_ref) and torch.equal(id_t.cpu(), id_ref)
        assert rel_err(w_c.cpu(), w_ref) <= 1e-6 and rel_err(w_t.cpu(), w_ref) <= 1e-6


def _moe_weights(E: int, H: int, I: int, dtype: torch.dtype, dev: str = "cuda") -> tuple:  # noqa: E741
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kdev,T", cases([1, 4, 32], [3]), indirect=["kdev"])
def test_moe_decode_vs_reference_and_torch(
    kdev: str, dtype: torch.dtype, shared: bool, T: int
) -> None:
    needs_cpu_half_gemm(kdev, dtype)
    # Qwen3.6-35B-A3B at TP4 on the GPU; fewer experts under emulation (same H and I).
    E, H, I, k = (256 if kdev == "cuda" else 16), 2048, 128, 8  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    logits = torch.randn(T, E, device=kdev)
    if T > 1:
        logits[1] = logits[0]  # two tokens on the same experts
    w, ids = moe.route(logits, k, True)
    sh = None
    if shared:
        sw13, sw2 = _moe_weights(1, H, I, dtype, kdev)
        sh = (sw13[0], sw2[0], (torch.randn(1, H, device=kdev) * H**-0.5).to(dtype))
    r = _both(kernels.moe_decode, x, w, ids, w13, w2, sh)
    ref = mref.moe_experts_reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    if sh is not None:
        ref = ref + mref.shared_expert_reference(x.cpu(), *(t.cpu() for t in sh))
    _check(r["cuda"][0].cpu(), r["torch"][0].cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("kdev,T", cases([1, 8, 32], [3]), indirect=["kdev"])
def test_moe_decode_routed_equals_route_then_decode(
    kdev: str, dtype: torch.dtype, renormalize: bool, T: int
) -> None:
    """Routing inside the up kernel gives the very same experts, weights and output as the
    separate routing launch (bit for bit: the same arithmetic), ties included, with and without
    the shared expert."""
    # TP4 shapes on the GPU; under emulation small ones (every up block routes its token).
    E, H, I, k = (256, 2048, 128, 8) if kdev == "cuda" else (16, 256, 16, 4)  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    logits = torch.randn(T, E, device=kdev).to(dtype)
    logits[0] = torch.randint(-2, 3, (E,), device=kdev).to(dtype)  # exact ties
    sw13, sw2 = _moe_weights(1, H, I, dtype, kdev)
    sh = (sw13[0], sw2[0], (torch.randn(1, H, device=kdev) * H**-0.5).to(dtype))
    for shared in (None, sh):
        kernels.FUSED_USED.discard("moe_decode_routed")
        out = kernels.moe_decode_routed(x, logits, k, renormalize, w13, w2, shared)
        # Routing in the up kernel up to MOE_ROUTED_MAX_TOKENS tokens, the two ops beyond.
        used = "moe_decode_routed" in kernels.FUSED_USED
        assert used == (T <= kernels.MOE_ROUTED_MAX_TOKENS)
        w, ids = kernels.moe_route(logits, k, renormalize)
        want = kernels.moe_decode(x, w, ids, w13, w2, shared)
        assert torch.equal(out, want)
        s13, s2, sg = shared if shared is not None else (None, None, None)
        out_r, w_r, ids_r = torch.ops.vo_kernels.moe_decode_routed(
            x, logits, k, renormalize, w13, w2, s13, s2, sg
        )
        assert torch.equal(ids_r, ids) and torch.equal(w_r, w) and torch.equal(out_r, want)


@pytest.mark.parametrize(
    "kdev", [pytest.param("emu64", marks=emu), pytest.param("cuda", marks=gpu)], indirect=True
)
def test_moe_decode_small_model_shapes(kdev: str) -> None:
    """The tiny test model's sizes (H 128, I 64, 8 experts top-2) in float32."""
    E, H, I, k, T = 8, 128, 64, 2, 3  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, torch.float32, kdev)
    x = torch.randn(T, H, device=kdev)
    w, ids = kernels.moe_route(torch.randn(T, E, device=kdev), k, True)
    out = kernels.moe_decode(x, w, ids, w13, w2)
    ref = mref.moe_experts_reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdev,T", cases([1, 3], [2]), indirect=["kdev"])
def test_moe_decode_wide_experts_narrow_shared(kdev: str, dtype: torch.dtype, T: int) -> None:
    """An expert width that takes the down kernel's lanes several passes (TP1's 512 is one such
    width), a shared expert narrower than the routed ones, and more pairs (8 + shared) than
    the down kernel keeps in flight at once."""
    needs_cpu_half_gemm(kdev, dtype)
    E, H, I, Is, k = 16, 256, 192, 64, 8  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    w, ids = moe.route(torch.randn(T, E, device=kdev), k, True)
    sw13, sw2 = _moe_weights(1, H, Is, dtype, kdev)
    sh = (sw13[0], sw2[0], (torch.randn(1, H, device=kdev) * H**-0.5).to(dtype))
    kernels.FUSED_USED.discard("moe_decode_with_shared")
    r = _both(kernels.moe_decode, x, w, ids, w13, w2, sh)
    assert "moe_decode_with_shared" in kernels.FUSED_USED  # the kernel ran, not its fallback
    ref = mref.moe_experts_reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    ref = ref + mref.shared_expert_reference(x.cpu(), *(t.cpu() for t in sh))
    _check(r["cuda"][0].cpu(), r["torch"][0].cpu(), ref, dtype)


# ------------------------------------------------------------------------------------------
# Gated attention: q/k norm + RoPE + gate
# ------------------------------------------------------------------------------------------


def _qk_inputs(T: int, nq: int, nkv: int, D: int, rot: int, mrope: bool, dtype, dev: str) -> dict:  # noqa: ANN001
    # q_gate and k as upstream slices them out of the qkv projection (row stride = qkv width).
    qkv = torch.randn(T, 2 * nq * D + 2 * nkv * D, device=dev).to(dtype)
    q_gate, k, _ = qkv.split([2 * nq * D, nkv * D, nkv * D], dim=-1)
    inv = 1.0 / 1e4 ** (torch.arange(0, rot, 2, device=dev).float() / rot)
    f = torch.arange(4096, device=dev).float()[:, None] * inv
    half = rot // 2
    sec = [half - 2 * (half // 3), half // 3, half // 3]  # sums to rot / 2, like [11, 11, 10]
    return {
        "q_gate": q_gate, "k": k,
        "q_weight": (torch.randn(D, device=dev) * 0.1).to(dtype),
        "k_weight": (torch.randn(D, device=dev) * 0.1).to(dtype),
        "cos_sin_cache": torch.cat([f.cos(), f.sin()], -1).to(dtype),
        "positions": torch.randint(0, 4096, (3, T) if mrope else (T,), device=dev),
        "eps": 1e-6, "num_q_heads": nq, "num_kv_heads": nkv, "head_dim": D, "rotary_dim": rot,
        "mrope_section": sec if mrope else None,
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize(
    "kdev,size",
    # (T, nq, nkv, head_dim, rotary_dim): Qwen3.6 at TP4 (4 q heads, 1 kv head, 256, 64)
    cases([(1, 4, 1, 256, 64), (37, 4, 1, 256, 64), (300, 8, 2, 128, 128)], [(3, 2, 1, 64, 16)]),
    indirect=["kdev"],
)
def test_qk_norm_rope_gate_vs_reference_and_torch(
    kdev: str, dtype: torch.dtype, mrope: bool, size: tuple[int, ...]
) -> None:
    T, nq, nkv, D, rot = size
    kw = _qk_inputs(T, nq, nkv, D, rot, mrope, dtype, kdev)
    r = _both(kernels.qk_norm_rope_gate, **kw)
    ref = qref.qk_norm_rope_gate_reference(**kw)
    fused, torch_path = r["cuda"][0], r["torch"][0]
    assert kernels.backend_for(kw["q_gate"]) == "cuda"
    for i, name in enumerate(("q", "k", "gate")):
        assert fused[i].shape == torch_path[i].shape == ref[i].shape, name
        assert fused[i].is_contiguous() and fused[i].dtype == dtype, name
        _check(fused[i].cpu(), torch_path[i].cpu(), ref[i], dtype)
    assert torch.equal(fused[2], torch_path[2])  # the gate is copied verbatim


# ------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("kdev", ["cuda"], indirect=True)
def test_decode_ops_capture_and_replay(kdev: str) -> None:
    """One decode layer's fused ops captured in a CUDA graph replay what eager computes."""
    dtype, B = torch.bfloat16, 4
    inp = _gdn_inputs(B, dtype, [3, 0, 5, 1], 8)
    E, H, I = 256, 2048, 128  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype)
    norm_w = (torch.randn(H, device="cuda") * 0.1).to(dtype)
    static = {
        "qkv": torch.randn(B, inp["D"], device="cuda").to(dtype),
        "a": torch.randn(B, inp["HV"], device="cuda").to(dtype),
        "b": torch.randn(B, inp["HV"], device="cuda").to(dtype),
        "x": torch.randn(B, H, device="cuda").to(dtype),
        "res": torch.randn(B, H, device="cuda").to(dtype),
        "logits": torch.randn(B, E, device="cuda").to(dtype),
    }

    def step(conv_sd: torch.Tensor, ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = _gdn_step(inp, conv_sd, ssm, static["qkv"], static["a"], static["b"], dtype)
        y, _ = kernels.gemma_rms_norm(static["x"], norm_w, 1e-6, static["res"])
        w, ids = kernels.moe_route(static["logits"], 8, True)
        return o, kernels.moe_decode(y, w, ids, w13, w2)

    eager_states = (inp["conv_sd"].clone(), inp["ssm"].clone())
    graph_states = (inp["conv_sd"].clone(), inp["ssm"].clone())
    warm = (inp["conv_sd"].clone(), inp["ssm"].clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*warm)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out = step(*graph_states)
    # Capture ran nothing: reset the graph's states, then replay twice with fresh inputs.
    graph_states[0].copy_(inp["conv_sd"])
    graph_states[1].copy_(inp["ssm"])
    for _ in range(2):
        for t in static.values():
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
        g.replay()
        e_out = step(*eager_states)
        for got, want in zip(g_out, e_out, strict=True):
            assert torch.equal(got, want)
    assert torch.equal(graph_states[1], eager_states[1])


# ------------------------------------------------------------------------------------------
# Selection (runs everywhere)
# ------------------------------------------------------------------------------------------


def test_backend_selection_on_cpu_tensors() -> None:
    x = torch.randn(2, 16)
    try:
        kernels.set_backend("auto")
        assert kernels.backend_for(x) == "torch"
        kernels.set_backend("torch")
        assert kernels.backend_for(x) == "torch"
        kernels.set_backend("cuda")
        with pytest.raises(RuntimeError, match="not on a CUDA device"):
            kernels.backend_for(x)
        with pytest.raises(ValueError):
            kernels.set_backend("triton")
    finally:
        kernels.set_backend("auto")


def test_torch_backend_ops_match_the_pytorch_modules() -> None:
    """On the PyTorch path every op is exactly the module function it stands for."""
    from vllm_overrides.native import rmsnorm

    kernels.set_backend("torch")
    try:
        x, w = torch.randn(3, 64), torch.randn(64) * 0.1
        assert torch.equal(kernels.gemma_rms_norm(x, w, 1e-6), rmsnorm.gemma_rms_norm(x, w, 1e-6))
        logits = torch.randint(-2, 3, (4, 16)).float()
        for got, want in zip(kernels.moe_route(logits, 4), moe.route(logits, 4), strict=True):
            assert torch.equal(got, want)
    finally:
        kernels.set_backend("auto")
