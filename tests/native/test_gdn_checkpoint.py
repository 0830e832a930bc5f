"""GDN prefill checkpoints (patch 0007): the native prefill writes, at ``md.checkpoint``, the
states a chunk that *stopped* there would have left -- what upstream's scheduler produces by
splitting the final chunk -- and its outputs and final states are unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from native_util import rel_err

from vllm_overrides.engines.v1_0_32 import native_switch as engine
from vllm_overrides.native import gdn, gdn_checkpoint

FP32_TOL = 1e-5


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor([0, *lens]), 0).to(torch.int32)


def _inputs(lens: list[int], H: int = 2, HV: int = 4, K: int = 16, V: int = 8, D: int = 24):
    torch.manual_seed(0)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1)
    v = torch.randn(T, HV, V)
    g = -torch.rand(T, HV) * 0.05
    beta = torch.sigmoid(torch.randn(T, HV))
    raw_x = torch.randn(T, D)
    return q, k, v, g, beta, raw_x


def _rule(q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN202 - test shorthand
    return gdn.chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
    )  # fmt: skip


def test_chained_checkpoint_matches_a_chunk_that_stopped_there() -> None:
    lens, offsets = [200, 70, 37, 130], [144, 0, 16, 129]  # row 1: none; row 3: 1 token left
    slots_ck = torch.tensor([5, 0, 6, 7])  # row 1's slot is the null block (offset 0)
    N, W1, D = len(lens), 3, 24
    q, k, v, g, beta, raw_x = _inputs(lens)
    cu = _cu(lens)
    h0 = torch.randn(N, 4, 8, 16) * 0.5
    ssm = torch.zeros(8, 4, 8, 16)
    conv = torch.zeros(8, W1, D).transpose(1, 2)  # the SD cache seen as [slots, D, W-1]

    o_ref, fin_ref = _rule(q, k, v, g, beta, h0, cu)
    o, fin = gdn_checkpoint.chunk_rule_with_checkpoints(
        gdn.chunk_gated_delta_rule, q, k, v, g, beta, h0, cu, offsets, slots_ck, raw_x, conv, ssm
    )
    # Outputs and final states: the same math chained at the checkpoint.
    assert rel_err(o, o_ref) <= FP32_TOL and rel_err(fin, fin_ref) <= FP32_TOL

    # The checkpoint rows' states equal the final states of the rows cut at the checkpoint,
    # i.e. what a prefill chunk ending there writes (the split upstream's scheduler makes).
    cut_lens = [off if off else n for n, off in zip(lens, offsets, strict=True)]
    keep = torch.cat(
        [torch.arange(s, s + c) for s, c in zip(cu[:-1].tolist(), cut_lens, strict=True)]
    )
    _, fin_cut = _rule(q[keep], k[keep], v[keep], g[keep], beta[keep], h0, _cu(cut_lens))
    conv_cut = torch.zeros(N, D, W1)
    gdn.causal_conv1d_prefill(
        raw_x[keep], torch.randn(D, W1 + 1), None, conv_cut, _cu(cut_lens),
        torch.arange(N), torch.zeros(N, dtype=torch.bool), None,
    )  # fmt: skip
    for row, slot in ((0, 5), (2, 6), (3, 7)):
        assert rel_err(ssm[slot], fin_cut[row]) <= FP32_TOL, row
        assert torch.equal(conv[slot], conv_cut[row]), row
    # Nothing else was written: the no-checkpoint row's (null) slot and the spare slots.
    for slot in (0, 1, 2, 3, 4):
        assert not ssm[slot].any() and not conv[slot].any(), slot


def test_no_checkpoint_rows_leave_the_plain_path() -> None:
    md = SimpleNamespace(checkpoint=None)
    assert gdn_checkpoint.prefill_checkpoints(md, 0, 2) is None
    ck = SimpleNamespace(offsets=[0, 0, 48, 0], state_indices=torch.tensor([0, 0, 9, 0]))
    # Decode rows come first in md.checkpoint; a checkpoint only on a decode row is ignored.
    assert gdn_checkpoint.prefill_checkpoints(SimpleNamespace(checkpoint=ck), 3, 1) is None
    offs, slots = gdn_checkpoint.prefill_checkpoints(SimpleNamespace(checkpoint=ck), 1, 3)
    assert offs == [0, 48, 0] and slots.tolist() == [0, 9, 0]


@pytest.mark.parametrize(
    ("native", "mode", "spec", "env", "want"),
    [
        (True, "align", None, None, 1),
        (True, "align", None, "0", 0),
        (True, "none", None, None, 0),
        (True, "align", object(), None, 0),  # spec decode: upstream kernels, no exporter
        (False, "align", None, None, 0),
    ],
)
def test_spec_declares_a_checkpoint_block_only_when_the_native_path_writes_it(
    native: bool, mode: str, spec: object, env: str | None, want: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Upstream's spec class: installed in CI, absent on the kernel machine (skip, with reason).
    MambaSpec = pytest.importorskip("vllm.v1.kv_cache_interface").MambaSpec

    monkeypatch.setattr(engine, "GDN_NATIVE", native)
    if env is None:
        monkeypatch.delenv("GDN_PREFILL_CHECKPOINT", raising=False)
    else:
        monkeypatch.setenv("GDN_PREFILL_CHECKPOINT", env)
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode=mode), speculative_config=spec
    )
    base = MambaSpec(
        block_size=256, shapes=((3, 24), (4, 8, 16)), dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
    )  # fmt: skip
    out = gdn_checkpoint.spec_with_checkpoint(cfg, base)
    assert out.num_prefill_checkpoint_blocks == want
    assert out.prefill_checkpoint_alignment == (1 if want else None)
    assert out.page_size_bytes == base.page_size_bytes
