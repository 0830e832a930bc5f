"""The fused MoE prefill kernels (``kernels.moe_prefill``: route + counts, rows into expert order,
activation, our grouped GEMMs, combine with the shared expert) against float64 and the PyTorch
path.

Same split as ``test_cuda_kernels.py`` (whose fixtures these tests use): ``cuda`` cases run on a
GPU through ``scripts/gpu_kernel_tests.sh`` and skip in CPU CI with that reason; ``emu64`` /
``emu32`` cases run the same kernel source on host threads in CPU CI, at smaller sizes.
"""

# ruff: noqa: F811 - the `kdev` fixture is imported and then named by the tests that use it

from __future__ import annotations

import pytest
import torch
from native_util import rel_err
from test_cuda_kernels import (  # noqa: F401
    TOL,
    _both,
    _check,
    _moe_weights,
    cases,
    emu,
    gpu,
    kdev,
    needs_cpu_half_gemm,  # noqa: I001 - kept apart from the line above
)

from vllm_overrides.native import kernels, moe
from vllm_overrides.native import moe_reference as mref


def _ref_by_expert(x, w, ids, w13, w2, shared) -> torch.Tensor:  # noqa: ANN001
    """float64 routed (+ shared) output computed one expert at a time on x's device (the
    token-by-token reference is too slow for 16K tokens)."""
    xd = x.double()
    out = torch.zeros_like(xd)
    I = w2.shape[2]  # noqa: E741
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = xd[t] @ w13[e].double().t()
        act = h[:, :I] * torch.sigmoid(h[:, :I]) * h[:, I:]
        out.index_add_(0, t, (act @ w2[e].double().t()) * w[t, j].double().unsqueeze(1))
    if shared is not None:
        gate_up, down, gate = (None if s is None else s.double() for s in shared)
        Is = down.shape[1]
        h = xd @ gate_up.t()
        y = (h[:, :Is] * torch.sigmoid(h[:, :Is]) * h[:, Is:]) @ down.t()
        out += y if gate is None else torch.sigmoid(xd @ gate.t()) * y
    return out


def _shared(H: int, I: int, dtype: torch.dtype, dev: str, gated: bool = True) -> tuple:  # noqa: E741
    sw13, sw2 = _moe_weights(1, H, I, dtype, dev)
    gate = (torch.randn(1, H, device=dev) * H**-0.5).to(dtype) if gated else None
    return sw13[0], sw2[0], gate


@pytest.mark.parametrize("kdev,T", cases([40, 5000], [37]), indirect=["kdev"])
def test_route_count_places_every_pair_once(kdev: str, T: int) -> None:
    """Counts are the per-expert pair counts and each expert's slots are 0..count-1 exactly
    once; weights and ids are ``moe_route``'s (upstream's tie order)."""
    E, k = (256, 8) if kdev == "cuda" else (32, 4)
    logits = torch.randn(T, E, device=kdev).to(torch.bfloat16)
    logits[: T // 2] = torch.randint(-2, 3, (T // 2, E), device=kdev).to(torch.bfloat16)  # ties
    w, ids, counts, slot = torch.ops.vo_kernels.moe_route_count(logits, k, True)
    w_ref, ids_ref = moe.route(logits, k, True)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) <= 1e-6
    assert torch.equal(counts.long(), torch.bincount(ids.flatten(), minlength=E))
    for e in range(E):
        got = slot[ids == e].sort().values
        assert torch.equal(got.long(), torch.arange(int(counts[e]), device=kdev)), e


@pytest.mark.parametrize("kdev,T", cases([1, 4099], [37]), indirect=["kdev"])
def test_permute_writes_each_row_to_its_pairs_places(kdev: str, T: int) -> None:
    """Every pair's row of ``xs`` is its token's row of x (x's rows strided), the rows of expert
    e are its group's (``ends`` = running counts), ``inverse`` is a permutation and ``ws`` holds
    each pair's weight at its row. T not a multiple of the tokens a block takes at a time."""
    E, k, H = (256, 8, 2048) if kdev == "cuda" else (32, 4, 64)
    x = torch.randn(T, H + 8, device=kdev).to(torch.bfloat16)[:, :H]
    logits = torch.randn(T, E, device=kdev).to(torch.bfloat16)
    w, ids, counts, slot = torch.ops.vo_kernels.moe_route_count(logits, k, True)
    xs, ws, inverse, ends = torch.ops.vo_kernels.moe_permute(x, w, ids, counts, slot)
    assert torch.equal(ends.long(), counts.long().cumsum(0))
    assert torch.equal(inverse.sort().values, torch.arange(T * k, device=kdev))
    assert torch.equal(xs[inverse], x.repeat_interleave(k, 0))
    assert torch.equal(ws[inverse], w.flatten())
    assert torch.equal(torch.searchsorted(ends.long(), inverse, right=True), ids.flatten())


@pytest.mark.parametrize("kdev,T", cases([1, 4099], [37]), indirect=["kdev"])
def test_order_maps_each_row_to_its_token_and_the_tiles_to_experts(kdev: str, T: int) -> None:
    """``moe_order`` places the pairs as ``moe_permute`` does, moves no row, names each row's
    token (``src``), and ``tile_starts`` counts each expert's 128-row tiles."""
    E, k = (256, 8) if kdev == "cuda" else (32, 4)
    x = torch.randn(T, 64, device=kdev).to(torch.bfloat16)
    logits = torch.randn(T, E, device=kdev).to(torch.bfloat16)
    logits[: T // 2 + 1, 3] = 30.0  # one expert with several tiles (T = 37: one)
    w, ids, counts, slot = torch.ops.vo_kernels.moe_route_count(logits, k, True)
    src, ws, inverse, ends, tiles = torch.ops.vo_kernels.moe_order(w, ids, counts, slot)
    _, ws_p, inverse_p, ends_p = torch.ops.vo_kernels.moe_permute(x, w, ids, counts, slot)
    assert torch.equal(inverse, inverse_p) and torch.equal(ws, ws_p) and torch.equal(ends, ends_p)
    tokens = torch.arange(T, device=kdev).repeat_interleave(k)
    assert torch.equal(src[inverse].long(), tokens)
    want = torch.cat([counts.new_zeros(1), ((counts + 127) // 128).cumsum(0)])
    assert torch.equal(tiles.long(), want.long())


def _grouped_case(kdev: str, T: int, dtype: torch.dtype, I: int = 128) -> tuple:  # noqa: E741
    """x, the weights and the expert order of a routing with an empty expert, one expert
    spanning several 128-row tiles and groups that are not multiples of a tile. The emulated
    shape keeps several column blocks in both GEMMs (down 3 of 128, gate/up 2 of 64)."""
    E, H, k = (256, 2048, 8) if kdev == "cuda" else (6, 384, 2)
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    logits = torch.randn(T, E, device=kdev)
    logits[:, 1] = -30.0  # empty
    logits[:, 0] = -30.0
    logits[: T - 20, 0] = 30.0  # several tiles, the last partial
    w, ids, counts, slot = torch.ops.vo_kernels.moe_route_count(logits.to(dtype), k, True)
    order = torch.ops.vo_kernels.moe_order(w, ids, counts, slot)
    assert int(counts[1]) == 0 and int(counts[0]) == T - 20 and (T - 20) % 128 != 0
    return x, w13, w2, order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("run", [0, 1, 2, 3])
@pytest.mark.parametrize("kdev,T", cases([1000, 5000], [150]), indirect=["kdev"])
def test_grouped_gemms_vs_float64(kdev: str, dtype: torch.dtype, T: int, run: int) -> None:
    """``moe_grouped_gemm``: gate/up with x's rows gathered and silu(gate) * up * weight in the
    epilogue, then down, each against float64 on the same inputs, row by row of its expert;
    with each block walking ``run`` column blocks (0: the kernel's choice), the last run of a
    tile partial where ``run`` does not divide them."""
    _check_grouped_gemms(kdev, dtype, run, *_grouped_case(kdev, T, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kdev,T", cases([1000], [150]), indirect=["kdev"])
def test_grouped_gemms_with_a_long_down_k(kdev: str, dtype: torch.dtype, T: int) -> None:
    """I = 256 (a TP2 rank's): down's K is past what keeps its A tile in shared memory, so it
    streams A through the stages like gate/up; the same float64 check."""
    _check_grouped_gemms(kdev, dtype, 0, *_grouped_case(kdev, T, dtype, I=256))


@pytest.mark.parametrize("kdev,T", cases([], [150]), indirect=["kdev"])
def test_grouped_gemms_where_a_block_gets_48_kb(kdev: str, T: int) -> None:
    """Down with its A tile resident asks for 66 KB of shared memory. On a device that grants a
    block 48 KB (the emulation refuses a launch past its limit, as a device does) down takes
    the streamed path instead of a refused launch; the same float64 check."""
    ops = torch.ops.vo_kernels
    ops.emu_set_smem_optin(48 * 1024)
    try:
        _check_grouped_gemms(kdev, torch.float16, 0, *_grouped_case(kdev, T, torch.float16))
    finally:
        ops.emu_set_smem_optin(227 * 1024)


@pytest.mark.parametrize("kdev,T", cases([1000], [150]), indirect=["kdev"])
def test_grouped_gemms_where_a_block_gets_32_kb(
    kdev: str, T: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The card states 32 KB a block: both GEMMs take the one-stage variant (20 KB) instead of
    the two stages' 40 KB, chosen from the reported limit (emulated: the launch limit itself;
    on a GPU VO_SMEM_LIMIT caps what the device reports); the same float64 check."""
    ops = torch.ops.vo_kernels
    x, w13, w2, order = _grouped_case(kdev, T, torch.float16)
    if kdev == "cuda":
        monkeypatch.setenv("VO_SMEM_LIMIT", str(32 * 1024))
    else:
        ops.emu_set_smem_optin(32 * 1024)
    try:
        for K, gather in ((w13.shape[2], True), (w2.shape[2], False)):
            assert ops.moe_grouped_gemm_plan(x, K, gather).startswith("one streamed stage, 20480")
        _check_grouped_gemms(kdev, torch.float16, 0, x, w13, w2, order)
    finally:
        if kdev != "cuda":
            ops.emu_set_smem_optin(227 * 1024)


@pytest.mark.parametrize("kdev,T", cases([1000], [150]), indirect=["kdev"])
def test_grouped_gemms_refused_below_20_kb_fall_back(
    kdev: str, T: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the one-stage variant's 20 KB the op refuses (no launch) and moe_prefill serves the
    call and every later one through the expert loop, with a warning naming the family."""
    x, w13, w2, _ = _grouped_case(kdev, T, torch.float16)
    monkeypatch.setenv("VO_SMEM_LIMIT", str(16 * 1024))
    monkeypatch.setattr(kernels, "_grouped_gemm_ok", True)
    logits = torch.randn(T, w13.shape[0], device=kdev).half()
    out = kernels.moe_prefill(x, logits, 2, True, w13, w2, method="wmma")
    assert kernels._grouped_gemm_ok is False
    topk_w, topk_ids = moe.route(logits, 2, True)
    want = _ref_by_expert(x, topk_w, topk_ids, w13, w2, None)
    assert rel_err(out, want) <= TOL[torch.float16]


def _check_grouped_gemms(kdev, dtype, run, x, w13, w2, order) -> None:  # noqa: ANN001
    src, ws, inverse, ends, tiles = order
    I = w2.shape[2]  # noqa: E741
    act = torch.ops.vo_kernels.moe_grouped_gemm(x, src, w13, ends, tiles, ws, run)
    y = torch.ops.vo_kernels.moe_grouped_gemm(act, None, w2, ends, tiles, None, run)
    expert = torch.searchsorted(ends.long(), torch.arange(src.numel(), device=kdev), right=True)
    xd, ad = x.double(), act.double()
    act_ref = torch.empty_like(ad)
    y_ref = torch.empty(y.shape, dtype=torch.float64, device=kdev)
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().squeeze(1)
        h = xd[src[rows].long()] @ w13[e].double().t()
        act_ref[rows] = h[:, :I] * torch.sigmoid(h[:, :I]) * h[:, I:] * ws[rows].double()[:, None]
        y_ref[rows] = ad[rows] @ w2[e].double().t()
    # One rounding of each output to the 16-bit type: rel. error ~2^-9 (fp16) / 2^-8 (bf16).
    assert rel_err(act, act_ref) <= TOL[dtype] / 2
    assert rel_err(y, y_ref) <= TOL[dtype] / 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kdev,T", cases([33, 1000], [37]), indirect=["kdev"])
def test_moe_prefill_vs_reference_and_torch(
    kdev: str, dtype: torch.dtype, shared: bool, T: int
) -> None:
    needs_cpu_half_gemm(kdev, dtype)
    # Qwen3.6-35B-A3B at TP4 on the GPU; a small MoE under emulation.
    E, H, I, k = (256, 2048, 128, 8) if kdev == "cuda" else (16, 128, 64, 4)  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    logits = torch.randn(T, E, device=kdev).to(dtype)
    logits[1] = logits[0]  # two tokens on the same experts
    sh = _shared(H, I, dtype, kdev) if shared else None
    methods = ["loop", "wmma"] + (["grouped"] if moe.grouped_mm_available(kdev, dtype) else [])
    for method in methods:
        kernels.FUSED_USED.discard("moe_grouped_gemm")
        r = _both(kernels.moe_prefill, x, logits, k, True, w13, w2, sh, method)
        assert ("moe_grouped_gemm" in kernels.FUSED_USED) == (method == "wmma")
        w, ids = mref.route_reference(logits.cpu(), k, True)
        ref = mref.moe_experts_reference(x.cpu(), w, ids, w13.cpu(), w2.cpu())
        if sh is not None:
            ref = ref + mref.shared_expert_reference(x.cpu(), *(t.cpu() for t in sh))
        _check(r["cuda"][0].cpu(), r["torch"][0].cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kdev", [pytest.param("cuda", marks=gpu)], indirect=True)
def test_moe_prefill_16k_tokens(kdev: str, dtype: torch.dtype) -> None:
    """The benchmark's size (16K tokens, TP4 shard) with the gated shared expert, both GEMM
    methods, against a float64 reference computed expert by expert."""
    E, H, I, k, T = 256, 2048, 128, 8, 16384  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x = torch.randn(T, H, device=kdev).to(dtype)
    logits = torch.randn(T, E, device=kdev).to(dtype)
    sh = _shared(H, I, dtype, kdev)
    w, ids = moe.route(logits, k, True)
    ref = _ref_by_expert(x, w, ids, w13, w2, sh)
    for method in ("grouped", "loop", "wmma"):
        if method == "grouped" and not moe.grouped_mm_available(kdev, dtype):
            continue
        r = _both(kernels.moe_prefill, x, logits, k, True, w13, w2, sh, method)
        _check(r["cuda"][0], r["torch"][0], ref, dtype)


ALL_KDEVS = [
    pytest.param("cuda", marks=gpu),
    pytest.param("emu64", marks=emu),
    pytest.param("emu32", marks=emu),
]


@pytest.mark.parametrize("kdev", ALL_KDEVS, indirect=True)
def test_moe_prefill_empty_experts_ties_and_no_renormalize(kdev: str) -> None:
    """Most experts get no token (routing confined to a few, with exact ties); the small test
    model's float32 sizes; the full-softmax weights (renormalize=False)."""
    E, H, I, k, T = 8, 128, 64, 2, 50  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, torch.float32, kdev)
    x = torch.randn(T, H, device=kdev)
    logits = torch.full((T, E), -30.0, device=kdev)
    logits[:, 5] = 1.0
    logits[:, 2] = 1.0  # tie with 5: expert 2 first
    logits[::3, 7] = 2.0
    out = kernels.moe_prefill(x, logits, k, False, w13, w2, None, "loop")
    w, ids = mref.route_reference(logits.cpu(), k, False)
    assert set(ids.unique().tolist()) == {2, 5, 7}
    ref = mref.moe_experts_reference(x.cpu(), w, ids, w13.cpu(), w2.cpu())
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]
    assert kernels.FUSED_USED >= {"moe_prefill"}


@pytest.mark.parametrize("kdev", ALL_KDEVS[:2], indirect=True)
def test_moe_prefill_falls_back_where_rows_are_not_vectors(kdev: str) -> None:
    """H not a whole number of 16-byte vectors: the PyTorch path serves, with the same result."""
    E, H, I, k, T = 4, 34, 16, 2, 9  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, torch.float32, kdev)
    x, logits = torch.randn(T, H, device=kdev), torch.randn(T, E, device=kdev)
    kernels.FUSED_USED.discard("moe_prefill")
    out = kernels.moe_prefill(x, logits, k, True, w13, w2, None, "loop")
    assert "moe_prefill" not in kernels.FUSED_USED
    w, ids = mref.route_reference(logits.cpu(), k, True)
    ref = mref.moe_experts_reference(x.cpu(), w, ids, w13.cpu(), w2.cpu())
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("kdev", [pytest.param("emu64", marks=emu)], indirect=True)
def test_grouped_gemm_failure_falls_back(kdev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grouped-GEMM launch the device refuses costs no request: this call and every later one
    take the library path (``loop`` / ``grouped``), with its result."""

    def refuse(*args: object) -> None:
        raise RuntimeError("CUDA error: too many resources requested for launch")

    monkeypatch.setattr(kernels, "_grouped_gemm_ok", True)
    monkeypatch.setattr(kernels, "_grouped_gemms", refuse)
    E, H, I, k, T = 8, 128, 64, 2, 40  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, torch.bfloat16, kdev)
    x = torch.randn(T, H, device=kdev).to(torch.bfloat16)
    logits = torch.randn(T, E, device=kdev)
    out = kernels.moe_prefill(x, logits, k, True, w13, w2, None, "wmma")
    assert kernels._grouped_gemm_ok is False
    library = "grouped" if moe.grouped_mm_available(kdev, torch.bfloat16) else "loop"
    assert torch.equal(out, kernels.moe_prefill(x, logits, k, True, w13, w2, None, library))
    assert torch.equal(out, kernels.moe_prefill(x, logits, k, True, w13, w2, None, "auto"))


def _check_auto_choice(kdev: str, dtype: torch.dtype, want: bool) -> None:
    """``moe_prefill`` with ``method="auto"`` on a small MoE: whether our grouped GEMMs served
    is ``want``, and the result matches the float64 reference either way."""
    E, H, I, k, T = 8, 128, 64, 2, 40  # noqa: E741
    w13, w2 = _moe_weights(E, H, I, dtype, kdev)
    x, logits = torch.randn(T, H, device=kdev).to(dtype), torch.randn(T, E, device=kdev)
    kernels.FUSED_USED.discard("moe_grouped_gemm")
    out = kernels.moe_prefill(x, logits, k, True, w13, w2)
    assert ("moe_grouped_gemm" in kernels.FUSED_USED) is want, dtype
    w, ids = mref.route_reference(logits, k, True)
    ref = mref.moe_experts_reference(x, w, ids, w13, w2)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("kdev", [pytest.param("emu64", marks=emu)], indirect=True)
def test_auto_takes_our_grouped_gemms_without_grouped_mm(
    kdev: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device without torch._grouped_mm (the target's torch 2.1) gets our grouped GEMMs, not
    the per-expert loop with its host sync; float32 (no 16-bit tensor-core operands) the loop."""
    monkeypatch.setattr(moe, "grouped_mm_available", lambda *a: False)
    monkeypatch.setattr(kernels, "_grouped_gemm_ok", True)
    for dtype, want in ((torch.bfloat16, True), (torch.float32, False)):
        _check_auto_choice(kdev, dtype, want)


@pytest.mark.parametrize("kdev", [pytest.param("emu64", marks=emu)], indirect=True)
def test_auto_takes_our_grouped_gemms_for_fp16(kdev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch._grouped_mm runs (this CPU build has it for both 16-bit types), fp16 still
    gets our grouped GEMMs -- torch runs fp16 as one GEMM a group, 4.3x slower a step on the
    H200 -- and bf16 the library's."""
    if not hasattr(torch, "_grouped_mm"):  # torch 2.1: the test above is that case
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    monkeypatch.setattr(kernels, "_grouped_gemm_ok", True)
    for dtype, want in ((torch.float16, True), (torch.bfloat16, False)):
        assert moe.grouped_mm_available(kdev, dtype)
        _check_auto_choice(kdev, dtype, want)
