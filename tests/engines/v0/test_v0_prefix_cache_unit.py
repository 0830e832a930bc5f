"""Hybrid prefix caching's parts without an engine (fast): the GDN states saved inside a prefill
chunk equal those of a chunk that stopped there, the save boundaries, the image cap, the
bounded pool's eviction order and the per-checkpoint size."""

from __future__ import annotations

import torch

from vllm_overrides.engines.v0 import prefix_cache as pc
from vllm_overrides.engines.v0.gdn_state import chunk_rule_with_cuts, conv_window
from vllm_overrides.native import kernels

H, K, HV, V, W = 2, 8, 4, 8, 4
D = 2 * H * K + HV * V


def _inputs(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(T, D, generator=g),
        "a": torch.randn(T, HV, generator=g),
        "b": torch.randn(T, HV, generator=g),
        "w": torch.randn(D, W, generator=g) * 0.5,
        "A_log": torch.randn(HV, generator=g) * 0.1,
        "dt_bias": torch.randn(HV, generator=g) * 0.1,
    }


def _run(
    inp: dict[str, torch.Tensor],
    lo: int,
    hi: int,
    conv0: torch.Tensor,
    h0: torch.Tensor,
    has_init: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row ``[lo, hi)`` as its own chunk from the given states: (o, conv after, ssm after)."""
    conv = conv0.clone().unsqueeze(0)  # slot 0
    qsl = torch.tensor([0, hi - lo])
    q, k, v, g, beta = kernels.gdn_conv_prep(
        inp["x"][lo:hi], inp["w"], None, conv, qsl, torch.tensor([0]),
        torch.tensor([has_init]), "silu", inp["a"][lo:hi], inp["b"][lo:hi], inp["A_log"],
        inp["dt_bias"], H, K, V,
    )  # fmt: skip
    init = h0.unsqueeze(0) if has_init else torch.zeros_like(h0).unsqueeze(0)
    o, fin = kernels.chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        initial_state=init, output_final_state=True, cu_seqlens=qsl,
        use_qk_l2norm_in_kernel=False,
    )  # fmt: skip
    return o[0], conv[0], fin[0]


def test_states_at_cuts_equal_chunks_that_stop_there() -> None:
    """Two packed rows (one continuing a sequence, one starting it) with cuts inside the conv
    window, mid-row and at the row's end."""
    lens = [40, 30]
    inp = _inputs(sum(lens))
    g = torch.Generator().manual_seed(1)
    conv0 = torch.randn(2, D, W - 1, generator=g)
    ssm0 = torch.randn(2, HV, V, K, generator=g) * 0.1
    has_init = torch.tensor([True, False])
    cuts = [[2, 33], [30]]
    qsl = [0, 40, 70]

    conv = conv0.clone()
    init_conv = torch.where(has_init.view(-1, 1, 1), conv, torch.zeros_like(conv))
    q, k, v, gg, beta = kernels.gdn_conv_prep(
        inp["x"], inp["w"], None, conv, torch.tensor(qsl), torch.tensor([0, 1]), has_init,
        "silu", inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], H, K, V,
    )  # fmt: skip
    h0 = torch.where(has_init.view(-1, 1, 1, 1), ssm0, torch.zeros_like(ssm0))
    o, final, at_cut = chunk_rule_with_cuts(
        kernels.chunk_gated_delta_rule, q, k, v, gg, beta, h0, qsl, cuts
    )
    o_one, fin_one = kernels.chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), gg.unsqueeze(0), beta.unsqueeze(0),
        initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(qsl),
        use_qk_l2norm_in_kernel=False,
    )  # fmt: skip
    torch.testing.assert_close(o, o_one, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, fin_one, rtol=1e-4, atol=1e-5)

    for r, row_cuts in enumerate(cuts):
        for cut in row_cuts:
            lo = qsl[r]
            _, conv_ref, ssm_ref = _run(inp, lo, lo + cut, conv0[r], ssm0[r], bool(has_init[r]))
            torch.testing.assert_close(at_cut[(r, cut)], ssm_ref, rtol=1e-4, atol=1e-5)
            got_conv = conv_window(inp["x"], init_conv[r], lo, cut)
            torch.testing.assert_close(got_conv, conv_ref, rtol=0, atol=0)


def test_save_boundaries() -> None:
    end = 9
    # last full block, then the first message's last full block
    assert pc.save_boundaries([1] * 40 + [end] + [2] * 60, 16, end) == [96, 32]
    # no junction: a block-aligned prompt also saves one block before its end
    assert pc.save_boundaries([1] * 64, 16, end) == [64, 48]
    # the junction inside the first block is no boundary
    assert pc.save_boundaries([end] + [1] * 40, 16, end) == [32]
    assert pc.save_boundaries([1] * 10, 16, end) == []


def test_first_media() -> None:
    assert pc.first_media([1, 2, 7, 3, 8], (7, 8)) == 2
    assert pc.first_media([1, 2, 3], (7, 8)) == 3


def test_pool_evicts_stale_then_least_recently_used() -> None:
    reg = pc.CheckpointRegistry(slots=3, block_size=16)
    live = {101, 102, 104}
    cached = live.__contains__
    s1, s2, s3 = (reg.register(h, cached) for h in (101, 102, 103))
    assert sorted([s1, s2, s3]) == [0, 1, 2]
    reg.end_step()
    reg.touch(101)
    # 103's KV block is gone: its slot goes first although 102 is older
    assert reg.register(104, cached) == s3 and reg.lookup(103) is None
    reg.end_step()
    # then the least recently used: 102
    assert reg.register(105, cached) == s2 and reg.lookup(102) is None
    # slots used in this step are never handed out twice in it
    reg.pinned.update({s1, s3})
    assert reg.register(106, cached) is None
    reg.clear()
    assert reg.lookup(101) is None and len(reg.free) == 3


def test_checkpoint_bytes_qwen36_tp4() -> None:
    # 30 GDN layers; per rank at TP 4: 4 key heads, 8 value heads, head dim 128, kernel 4, fp16
    conv_dim = 2 * 4 * 128 + 8 * 128
    assert pc.checkpoint_bytes(30, conv_dim, 4, 8, 128, 128, 2) == 30 * (
        conv_dim * 3 * 2 + 8 * 128 * 128 * 4
    )
    assert pc.checkpoint_pool_bytes(1000, 7) == 7000
