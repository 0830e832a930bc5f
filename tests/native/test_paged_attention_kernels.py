"""The paged attention kernels (``csrc/paged_attention.cu`` through ``kernels.paged_*``) against
the float64 references (:mod:`vllm_overrides.native.paged_attention_reference`) and the
PyTorch path.

GPU cases (``cuda-*``) run Qwen3.6's TP4 shape (4 query heads on 1 kv head, head_dim 256,
block size 16) up to 70K-token contexts, and 256K against the float64 PyTorch path; they skip
in CPU CI and run through ``scripts/gpu_kernel_tests.sh``. Emulated cases (``emu64-*`` /
``emu32-*``) run the same kernel source on host threads at small sizes: the split + combine and
the one-partition decode, varlen prefill with and without context, empty and one-token
sequences, pad slots, GQA groups, and the device refusing a launch (a shared-memory limit
below the kernel's) -- which must leave that family on the PyTorch path, logged, and the
others on their kernels. Every case asserts the kernel was the path that ran.
"""

# ruff: noqa: F811 - the imported pytest fixture ``kdev`` is a parameter of every test

from __future__ import annotations

import math

import pytest
import torch
from native_util import rel_err
from test_cuda_kernels import cases, emu, gpu, kdev, needs_cpu_half_gemm  # noqa: F401

from vllm_overrides.native import kernels
from vllm_overrides.native import paged_attention as pa
from vllm_overrides.native import paged_attention_reference as ref

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DT_IDS = ["fp16", "bf16", "fp32"]

# name -> (H, KV, D, block_size, per-sequence lengths). Decode: context lengths; prefill:
# (new tokens, cached tokens) pairs.
DECODE_GPU = {
    "tp4-mixed": (4, 1, 256, 16, [1, 1000, 5000, 17]),
    "tp4-70k": (4, 1, 256, 16, [70001]),
    "tp1-gqa8": (16, 2, 256, 16, [3000, 40]),
}
DECODE_EMU = {
    "split": (4, 1, 64, 16, [1, 37, 200]),  # partitions of 64 (forced): split + combine
    "one-part": (4, 2, 64, 8, [5, 64, 30]),  # one partition covers every context
    "hd256": (4, 1, 256, 16, [90]),
}
PREFILL_GPU = {
    "tp4-chunk": (4, 1, 256, 16, [(2048, 0), (1000, 3000), (1, 5000), (0, 7), (333, 1)]),
    "tp4-8k-over-20k": (4, 1, 256, 16, [(8192, 20000)]),
    "tp1-gqa8": (16, 2, 128, 16, [(700, 900)]),
}
PREFILL_EMU = {
    "varlen": (4, 1, 64, 16, [(5, 0), (70, 33), (1, 20), (0, 10)]),
    "gqa2": (4, 2, 64, 8, [(40, 17)]),
    "hd256": (4, 1, 256, 16, [(17, 16)]),
}


@pytest.fixture(autouse=True)
def _fresh_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own path records and every family enabled."""
    monkeypatch.setattr(kernels, "_paged_ok", dict.fromkeys(kernels._paged_ok, True))
    for op in kernels._paged_ok:
        kernels.PATHS.pop(op, None)
        kernels.FUSED_USED.discard(op)
        kernels.TORCH_USED.discard(op)


def _fused_path(op: str) -> None:
    assert kernels.PATHS.get(op) in ({"fused"}, {"emulated"}), (op, kernels.PATHS.get(op))


def _cache(blocks: int, bs: int, KV: int, D: int, dtype: torch.dtype, dev: str):  # noqa: ANN202
    kv = torch.randn(pa.kv_cache_shape(blocks, bs, KV, D), device=dev).to(dtype)
    return pa.split_kv_cache(kv)


def _tables(lens: list[int], bs: int, dev: str) -> tuple[torch.Tensor, int]:
    """Disjoint random physical blocks per sequence (padded with 0, as vLLM pads)."""
    need = [max(1, math.ceil(n / bs)) for n in lens]
    total = sum(need) + 1
    perm = torch.randperm(total)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n]
        at += n
    return tables.to(dev), total


def _ref_decode_f64(q, kc, vc, tables, lens, scale) -> torch.Tensor:  # noqa: ANN001
    """float64 of the same inputs: the reference where it is fast enough, else the PyTorch
    path run in float64 (long contexts; it matches the reference at 1e-12 on the short ones)."""
    if max(lens) <= 80_000:
        return ref.decode_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), lens,
                                              scale)  # fmt: skip
    lens_t = torch.tensor(lens, device=q.device)
    return pa.decode_attention(q.double(), kc.double(), vc.double(), tables, lens_t, scale).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kdev,size", cases(list(DECODE_GPU), list(DECODE_EMU)), indirect=["kdev"])
def test_decode_vs_reference_and_torch(
    kdev: str, size: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_cpu_half_gemm(kdev, dtype)  # the PyTorch path's comparison
    H, KV, D, bs, lens = {**DECODE_GPU, **DECODE_EMU}[size]
    if size == "split":
        monkeypatch.setattr(kernels, "PAGED_DECODE_PARTITION", 64)
    tables, blocks = _tables(lens, bs, kdev)
    kc, vc = _cache(blocks, bs, KV, D, dtype, kdev)
    q = torch.randn(len(lens), H, D, device=kdev).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=kdev)
    scale = D**-0.5
    out = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, max(lens))
    _fused_path("paged_decode")
    want = _ref_decode_f64(q, kc, vc, tables, lens, scale)
    torch_out = pa.decode_attention(q, kc, vc, tables, seq_lens, scale, max(lens))
    e_f, e_t = rel_err(out.cpu(), want), rel_err(torch_out.cpu(), want)
    assert e_f <= max(TOL[dtype], 2 * e_t), (e_f, e_t)


@gpu
@pytest.mark.parametrize("kdev", ["cuda"], indirect=True)
def test_decode_256k_context(kdev: str) -> None:
    """Qwen3.6's longest context, fp16: the split over 512 partitions and the combine."""
    H, KV, D, bs, n = 4, 1, 256, 16, 262_144
    tables, blocks = _tables([n], bs, kdev)
    kc, vc = _cache(blocks, bs, KV, D, torch.float16, kdev)
    q = torch.randn(1, H, D, device=kdev).half()
    lens = torch.tensor([n], dtype=torch.int32, device=kdev)
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, n)
    _fused_path("paged_decode")
    want = _ref_decode_f64(q, kc, vc, tables, [n], D**-0.5)
    assert rel_err(out.cpu(), want) <= TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kdev,size", cases(list(PREFILL_GPU), list(PREFILL_EMU)),
                         indirect=["kdev"])  # fmt: skip
def test_prefill_vs_reference_and_torch(kdev: str, size: str, dtype: torch.dtype) -> None:
    needs_cpu_half_gemm(kdev, dtype)
    H, KV, D, bs, seqs = {**PREFILL_GPU, **PREFILL_EMU}[size]
    qlens, clens = [s[0] for s in seqs], [s[1] for s in seqs]
    T = sum(qlens)
    tables, blocks = _tables(clens, bs, kdev)
    kc, vc = _cache(blocks, bs, KV, D, dtype, kdev)
    q = torch.randn(T, H, D, device=kdev).to(dtype)
    # Keys / values as the model hands them: views into one projection row [q | k | v].
    kv = torch.randn(T, 2 * KV * D + 8, device=kdev).to(dtype)
    k = kv[:, : KV * D].view(T, KV, D)
    v = kv[:, KV * D : 2 * KV * D].view(T, KV, D)
    scale = D**-0.5
    out = kernels.paged_prefill_attention(q, k, v, kc, vc, tables, qlens, clens, scale)
    _fused_path("paged_prefill")
    if T <= 600:
        want = ref.prefill_attention_reference(q.cpu(), k.cpu(), v.cpu(), kc.cpu(), vc.cpu(),
                                               tables.cpu(), qlens, clens, scale)  # fmt: skip
    else:  # long chunks: the PyTorch path in float64 (the reference loops per token; the
        # PyTorch path matches it to float64 rounding: test_paged_attention.py)
        want = pa.prefill_attention(q.double(), k.double(), v.double(), kc.double(),
                                    vc.double(), tables, qlens, clens, scale).cpu()  # fmt: skip
    torch_out = pa.prefill_attention(q, k, v, kc, vc, tables, qlens, clens, scale)
    e_f, e_t = rel_err(out.cpu(), want), rel_err(torch_out.cpu(), want)
    assert e_f <= max(TOL[dtype], 2 * e_t), (e_f, e_t)


@pytest.mark.parametrize("kdev,size", cases(["tp4"], ["small"]), indirect=["kdev"])
def test_prefill_without_cache(kdev: str, size: str) -> None:
    """The profile run: no cache at all, every sequence its own keys only."""
    H, KV, D = (4, 1, 256) if size == "tp4" else (4, 1, 64)
    qlens = [300, 1, 64] if size == "tp4" else [9, 1]
    T = sum(qlens)
    q = torch.randn(T, H, D, device=kdev).half()
    k, v = torch.randn(T, KV, D, device=kdev).half(), torch.randn(T, KV, D, device=kdev).half()
    out = kernels.paged_prefill_attention(q, k, v, None, None, None, qlens, [0] * len(qlens),
                                          D**-0.5)  # fmt: skip
    _fused_path("paged_prefill")
    want = ref.prefill_attention_reference(q.cpu(), k.cpu(), v.cpu(), None, None, None, qlens,
                                           [0] * len(qlens), D**-0.5)  # fmt: skip
    assert rel_err(out.cpu(), want) <= TOL[torch.float16]


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("kdev,size", cases(["tp4"], ["small"]), indirect=["kdev"])
def test_write_kv_skips_pad_slots(kdev: str, size: str, slot_dtype: torch.dtype) -> None:
    KV, D, bs = (1, 256, 16) if size == "tp4" else (2, 64, 8)
    kc, vc = _cache(6, bs, KV, D, torch.float16, kdev)
    slots = torch.tensor([5, -1, 17, 6 * bs - 1, 40, -1, 0], dtype=slot_dtype, device=kdev)
    proj = torch.randn(7, 3 * KV * D, device=kdev).half()  # strided views, as the model's
    key, value = proj[:, : KV * D].view(7, KV, D), proj[:, KV * D : 2 * KV * D].view(7, KV, D)
    want_k, want_v = ref.write_kv_reference(key.cpu(), value.cpu(), kc.cpu(), vc.cpu(),
                                            slots.cpu())  # fmt: skip
    kernels.paged_write_kv(key, value, kc, vc, slots)
    _fused_path("paged_write_kv")
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("kdev", [pytest.param("emu64", marks=emu)], indirect=True)
def test_small_shared_memory_leaves_the_other_kernels_in_use(
    kdev: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A device whose blocks get less shared memory than the decode kernel asks for (8 KB here;
    the card states 32 KB) refuses that launch: decode takes the PyTorch path for the rest of
    the process, with a log line naming the family, while the prefill and KV-write kernels,
    which fit, stay in use."""
    H, KV, D, bs, lens = 4, 1, 256, 16, [90]  # bf16: torch 2.1 has no fp16 GEMM on the CPU
    tables, blocks = _tables(lens, bs, kdev)
    kc, vc = _cache(blocks, bs, KV, D, torch.bfloat16, kdev)
    q = torch.randn(1, H, D).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ops = torch.ops.vo_kernels
    try:
        ops.emu_set_smem_optin(8 * 1024)
        with caplog.at_level("WARNING", logger=kernels.logger.name):
            out = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, D**-0.5, 90)
        assert kernels._paged_ok["paged_decode"] is False
        assert kernels.PATHS.get("paged_decode") == {"torch"}
        assert any("paged attention decode kernel failed" in r.message for r in caplog.records)
        want = pa.decode_attention(q.float(), kc.float(), vc.float(), tables, seq_lens,
                                   D**-0.5, 90)  # fmt: skip
        assert rel_err(out, want) <= TOL[torch.bfloat16]  # the PyTorch path's own rounding
        ops.emu_set_smem_optin(28 * 1024)  # the prefill kernel's 27 KB fit
        slots = torch.tensor([3], dtype=torch.int64)
        kernels.paged_write_kv(q[:, :1], q[:, 1:2], kc, vc, slots)
        _fused_path("paged_write_kv")
        kq = torch.randn(5, H, D).bfloat16()
        kk, kv_ = torch.randn(5, KV, D).bfloat16(), torch.randn(5, KV, D).bfloat16()
        kernels.paged_prefill_attention(kq, kk, kv_, kc, vc, tables, [5], [90], D**-0.5)
        _fused_path("paged_prefill")
    finally:
        ops.emu_set_smem_optin(227 * 1024)
