"""The fused GDN prefill front end (``csrc/gdn_conv.cu`` through ``kernels.gdn_conv_prep``:
causal conv1d over varlen sequences with conv states in their cache slots, then q/k L2 norm,
v and the gates) against the float64 references and the PyTorch path
(``gdn.causal_conv1d_prefill`` + ``gdn.post_conv_prep``).

GPU cases (``cuda-*``) run the TP4 per-rank shapes (4 key heads, 8 value heads, 128-dim heads,
conv width 4) and skip in CPU CI (``scripts/gpu_kernel_tests.sh`` runs them); emulated cases
run the same source on host threads with 64- and 32-lane warps. Every case mixes sequences
shorter than the conv window, empty ones, ones without an initial state and a padded slot,
on vLLM's transposed ("SD") conv-state layout. Tolerance as ``_check``: the fused result's
error against float64 at most twice the PyTorch path's, or within the dtype's ``TOL``.
"""

# ruff: noqa: F811 - the imported pytest fixture ``kdev`` is a parameter of every test

from __future__ import annotations

import pytest
import torch
from test_cuda_kernels import _check, cases, kdev  # noqa: F401

from vllm_overrides.native import gdn, kernels
from vllm_overrides.native import gdn_reference as gref

# name -> (H, HV, K, V, sequence lengths)
GPU_SIZES = {
    "tp4": (4, 8, 128, 128, [3000, 0, 1, 2, 3, 4, 64, 1500, 777]),
    # The full model's width (TP1, D = 8192): float32 rows no longer fit two to a block, so
    # the kernel takes one token a block there.
    "tp1": (16, 32, 128, 128, [5, 0, 1, 4, 2]),
}
EMU_SIZES = {
    "small": (1, 2, 32, 32, [9, 0, 1, 2, 3, 4, 12]),
    "gqa": (2, 4, 32, 64, [7, 5]),
    "tp1": GPU_SIZES["tp1"],
}
SIZES = {**GPU_SIZES, **EMU_SIZES}
W = 4


def _inputs(name: str, dtype: torch.dtype, dev: str) -> dict:
    H, HV, K, V, lens = SIZES[name]
    D = 2 * H * K + HV * V
    T, N = sum(lens), len(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    n_slots = N + 3
    # Rows of a wider projection output (mixed_qkv is a column slice of qkvz upstream).
    x = torch.randn(T, D + 64, device=dev).to(dtype)[:, :D]
    slots = torch.randperm(n_slots - 1, device=dev)[:N] + 1
    slots[-1] = gdn.PAD_SLOT_ID  # a padded sequence: computed, its state left alone
    has_init = torch.rand(N, device=dev) < 0.6
    has_init[0] = True
    return {
        "H": H, "HV": HV, "K": K, "V": V, "lens": lens, "x": x,
        "w": (torch.randn(D, W, device=dev) * 0.5).to(dtype),
        "bias": (torch.randn(D, device=dev) * 0.1).to(dtype),
        # vLLM's default conv cache is [slots, W-1, D]; the ops see its transpose.
        "store": torch.randn(n_slots, W - 1, D, device=dev).to(dtype),
        "cu": torch.tensor(cu, dtype=torch.int32, device=dev),
        "slots": slots,
        "has_init": has_init,
        "a": torch.randn(T, HV, device=dev).to(dtype) - 1.0,
        "b": torch.randn(T, HV, device=dev).to(dtype),
        "A_log": torch.log(torch.empty(HV, device=dev).uniform_(0.05, 16.0)),
        "dt_bias": torch.randn(HV, device=dev),
    }  # fmt: skip


def _run(x: dict, backend: str, activation: str | None, l2: bool) -> tuple:
    kernels.set_backend(backend)
    kernels.FUSED_USED.discard("gdn_conv_prep")
    store = x["store"].clone()
    try:
        out = kernels.gdn_conv_prep(
            x["x"], x["w"], x["bias"], store.transpose(1, 2), x["cu"], x["slots"],
            x["has_init"], activation, x["a"], x["b"], x["A_log"], x["dt_bias"], x["H"],
            x["K"], x["V"], apply_l2norm=l2,
        )  # fmt: skip
    finally:
        kernels.set_backend("cuda")
    return out, store


def _reference(x: dict, activation: str | None, l2: bool) -> tuple:
    """float64: conv per sequence (history from the slot, or zeros), rounded to the input
    dtype as upstream's conv output is, then the L2 norms and the gates."""
    dtype = x["x"].dtype
    slots_c = x["slots"].clamp(min=0).cpu()
    init = x["store"].transpose(1, 2).cpu()[slots_c].double()
    init[~x["has_init"].cpu()] = 0.0
    out, finals = gref.conv1d_reference(
        x["x"].cpu(), x["w"].cpu(), x["bias"].cpu(), x["cu"].tolist(), init, activation
    )
    out = out.to(dtype).double()
    q, k, v = gdn.split_mixed_qkv(out, x["H"], x["K"], x["V"])
    if l2:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g, beta = gref.gdn_gating_reference(
        x["A_log"].cpu(), x["a"].cpu(), x["dt_bias"].cpu(), x["b"].cpu()
    )
    return (q, k, v, g.view_as(x["a"]), beta.view_as(x["a"])), finals


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kdev,size", cases(list(GPU_SIZES), list(EMU_SIZES)), indirect=["kdev"])
def test_conv_prep_vs_reference_and_torch(
    kdev: str, size: str, dtype: torch.dtype, activation: str | None, l2: bool
) -> None:
    x = _inputs(size, dtype, kdev)
    fused, st_f = _run(x, "cuda", activation, l2)
    assert "gdn_conv_prep" in kernels.FUSED_USED  # the fused op served, not the fallback
    torch_path, st_t = _run(x, "torch", activation, l2)
    ref, ref_states = _reference(x, activation, l2)
    for name, f, t, r in zip(("q", "k", "v", "g", "beta"), fused, torch_path, ref, strict=True):
        assert f.shape == t.shape and f.dtype == t.dtype, name
        _check(f.cpu(), t.cpu(), r, dtype)
    # States: the last W-1 inputs (copies, no arithmetic): identical to the PyTorch path's.
    assert torch.equal(st_f, st_t)
    live = x["slots"] >= 0
    got = st_f.transpose(1, 2)[x["slots"][live]].cpu().double()
    assert torch.equal(got, ref_states[live.cpu()])
    untouched = sorted(set(range(st_f.shape[0])) - set(x["slots"][live].tolist()))
    assert torch.equal(st_f[untouched], x["store"][untouched])


@pytest.mark.parametrize("kdev,size", cases(["tp4"], ["small"]), indirect=["kdev"])
def test_conv_prep_state_carry(kdev: str, size: str) -> None:
    """A prompt prefilled in two pieces (the second resuming from the first's conv state)
    gives the outputs of one whole prefill."""
    x = _inputs(size, torch.bfloat16, kdev)
    whole, whole_store = _run(x, "cuda", "silu", True)
    cut = [n // 2 for n in x["lens"]]
    starts = x["cu"][:-1].tolist()
    first = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, cut, strict=True)]).to(kdev)
    second = torch.cat(
        [torch.arange(s + c, s + n) for s, c, n in zip(starts, cut, x["lens"], strict=True)]
    ).to(kdev)

    def piece(rows: torch.Tensor, lens: list[int], has_init: torch.Tensor) -> tuple:
        y = dict(x, x=x["x"][rows], a=x["a"][rows], b=x["b"][rows], has_init=has_init)
        y["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        y["cu"] = y["cu"].to(kdev)
        return y

    p1 = piece(first, cut, x["has_init"])
    out1, store1 = _run(p1, "cuda", "silu", True)
    p2 = piece(
        second, [n - c for n, c in zip(x["lens"], cut, strict=True)], torch.ones_like(x["has_init"])
    )
    p2["store"] = store1
    out2, store2 = _run(p2, "cuda", "silu", True)
    for name, w, o1, o2 in zip(("q", "k", "v", "g", "beta"), whole, out1, out2, strict=True):
        joined = torch.empty_like(w)
        joined[first], joined[second] = o1, o2
        # Rows of the padded sequence read slot 0 as history in both pieces: not a carry.
        pad = torch.zeros(w.shape[0], dtype=torch.bool)
        s, e = x["cu"][-2].item(), x["cu"][-1].item()
        pad[s:e] = True
        assert torch.equal(joined[~pad.to(kdev)], w[~pad.to(kdev)]), name
    assert torch.equal(store2, whole_store)


@pytest.mark.parametrize("kdev,size", cases(["tp4"], ["small"]), indirect=["kdev"])
def test_conv_prep_unsupported_takes_the_torch_path(kdev: str, size: str) -> None:
    """A float32 conv cache under bf16 activations is outside the kernel's contract: the
    PyTorch path serves it (same results as calling it directly)."""
    x = _inputs(size, torch.bfloat16, kdev)
    x["store"] = x["store"].float()
    out, store = _run(x, "cuda", "silu", True)
    assert "gdn_conv_prep" not in kernels.FUSED_USED
    ref, ref_store = _run(x, "torch", "silu", True)
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)
    assert torch.equal(store, ref_store)
