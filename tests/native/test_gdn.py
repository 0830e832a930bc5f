"""Native Gated DeltaNet vs the float64 loop references (CPU).

Tolerances: float32 paths <= 1e-5 relative L2 (the math is exact up to rounding), bf16 inputs
<= 1e-2. Sizes: TP4 per-rank head shapes (4 key heads, 8 value heads, 128-dim heads) where the
float64 reference stays cheap, small heads elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from native_util import rel_err

from vllm_overrides.native import gdn
from vllm_overrides.native import gdn_reference as ref

FP32_TOL = 1e-5
BF16_TOL = 1e-2


def _cu(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _gates(T: int, HV: int, decay: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, HV]: 'weak' keeps the state alive across many chunks; 'qwen' uses the
    layer's own gate formula with Qwen-like parameter ranges (fast forgetting on some heads)."""
    if decay == "weak":
        g = -torch.rand(T, HV) * 0.05
        beta = torch.sigmoid(torch.randn(T, HV))
    else:
        A_log = torch.log(torch.empty(HV).uniform_(0.05, 16.0))
        dt_bias = torch.randn(HV)
        g, beta = gdn.gdn_gating(A_log, torch.randn(T, HV), dt_bias, torch.randn(T, HV))
    return g, beta


def _random_lens(n_seq: int, max_len: int) -> list[int]:
    fixed = [0, 1, 63, 64, 65]
    rand = torch.randint(2, max_len, (n_seq,)).tolist()
    lens = fixed + rand
    perm = torch.randperm(len(lens)).tolist()
    return [lens[i] for i in perm]


def test_gating_matches_reference() -> None:
    HV = 8
    A_log = torch.randn(HV)
    dt_bias = torch.randn(HV)
    a = torch.randn(37, HV) * 12  # crosses the softplus threshold (20) both ways
    b = torch.randn(37, HV) * 4
    g, beta = gdn.gdn_gating(A_log, a, dt_bias, b)
    rg, rb = ref.gdn_gating_reference(A_log, a, dt_bias, b)
    assert rel_err(g, rg) <= 1e-6
    assert rel_err(beta, rb) <= 1e-6


@pytest.mark.parametrize("decay", ["weak", "qwen"])
def test_chunk_prefill_varlen_initial_states_fp32(decay: str) -> None:
    H, HV, K, V = 2, 4, 32, 16
    lens = _random_lens(3, 200)
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g, beta = _gates(T, HV, decay)
    h0 = torch.randn(N, HV, V, K) * 0.5
    h0[torch.rand(N) < 0.3] = 0.0
    o, fin = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g[None],
        beta[None],
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    ro, rfin = ref.gated_delta_rule_reference(q[0], k[0], v[0], g, beta, cu, initial_state=h0)
    assert o.shape == (1, T, HV, V) and fin.shape == (N, HV, V, K)
    assert rel_err(o[0], ro) <= FP32_TOL
    assert rel_err(fin, rfin) <= FP32_TOL


@pytest.mark.parametrize("group", [1, 3, 4, 40])
def test_chunk_prefill_scan_groups(group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any scan group length (one chunk per group, groups crossing sequence boundaries, a
    padded last group, one group holding everything) gives the same result."""
    monkeypatch.setattr(gdn, "_scan_shape", lambda n: (-(-n // group) * group, group))
    H, HV, K, V = 1, 2, 16, 8
    lens = [700, 0, 1, 300, 64, 129, 65]
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    layout = gdn.prepare_chunk_layout(cu, T)
    assert layout.group == group and layout.n_pad % group == 0
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g, beta = _gates(T, HV, "weak")
    h0 = torch.randn(N, HV, V, K)
    o, fin = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g[None],
        beta[None],
        initial_state=h0,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
        layout=layout,
    )
    ro, rfin = ref.gated_delta_rule_reference(q[0], k[0], v[0], g, beta, cu, initial_state=h0)
    assert rel_err(o[0], ro) <= FP32_TOL
    assert rel_err(fin, rfin) <= FP32_TOL


def test_chunk_prefill_equal_length_batch_and_metadata() -> None:
    """[B, T] input without cu_seqlens == the packed form; vLLM's precomputed chunk metadata
    gives the same result as deriving it."""
    B, T, H, HV, K, V = 3, 100, 2, 4, 16, 16
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g, beta = _gates(B * T, HV, "weak")
    g, beta = g.view(B, T, HV), beta.view(B, T, HV)
    h0 = torch.randn(B, HV, V, K)
    o_b, f_b = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True
    )
    cu = _cu([T] * B)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    chunk_indices = torch.tensor([[s, c] for s in range(B) for c in range(2)], dtype=torch.int32)
    chunk_offsets = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    o_p, f_p = gdn.chunk_gated_delta_rule(
        *flat,
        initial_state=h0,
        cu_seqlens=cu,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
        use_qk_l2norm_in_kernel=True,
    )
    assert torch.equal(o_b.reshape(1, B * T, HV, V), o_p)
    assert torch.equal(f_b, f_p)
    ro, rfin = ref.gated_delta_rule_reference(*(x[0] for x in flat), cu, initial_state=h0)
    assert rel_err(o_p[0], ro) <= FP32_TOL and rel_err(f_p, rfin) <= FP32_TOL


def test_chunk_prefill_tp4_shapes_bf16() -> None:
    """TP4 per-rank shapes (H=4, HV=8, K=V=128), bf16 activations, fp32 states."""
    H, HV, K, V = 4, 8, 128, 128
    lens = [150, 70]
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    q = torch.randn(1, T, H, K, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, dtype=torch.bfloat16)
    g, beta = _gates(T, HV, "qwen")
    h0 = torch.randn(N, HV, V, K) * 0.1
    o, fin = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g[None],
        beta[None],
        initial_state=h0,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    assert o.dtype == torch.bfloat16 and fin.dtype == torch.float32
    ro, rfin = ref.gated_delta_rule_reference(q[0], k[0], v[0], g, beta, cu, initial_state=h0)
    assert rel_err(o[0], ro) <= BF16_TOL
    assert rel_err(fin, rfin) <= BF16_TOL


def test_prefill_prefix_then_decode_equals_full_prefill() -> None:
    """State carry: prefill a prefix, then decode token by token (slots in a shared cache)
    == one prefill of the whole sequences, for outputs and final states."""
    H, HV, K, V = 2, 4, 32, 32
    prefix = [70, 1, 129]
    steps = 5
    N = len(prefix)
    full = [p + steps for p in prefix]
    cu_full = _cu(full)
    T = int(cu_full[-1])
    q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    v = torch.randn(T, HV, V)
    g, beta = _gates(T, HV, "weak")
    h0 = torch.randn(N, HV, V, K) * 0.5

    o_full, f_full = gdn.chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=h0,
        cu_seqlens=cu_full,
        use_qk_l2norm_in_kernel=True,
    )
    pre_idx = torch.cat(
        [torch.arange(int(cu_full[s]), int(cu_full[s]) + prefix[s]) for s in range(N)]
    )
    o_pre, f_pre = gdn.chunk_gated_delta_rule(
        q[pre_idx][None],
        k[pre_idx][None],
        v[pre_idx][None],
        g[pre_idx][None],
        beta[pre_idx][None],
        initial_state=h0,
        cu_seqlens=_cu(prefix),
        use_qk_l2norm_in_kernel=True,
    )
    slots = torch.tensor([5, 2, 7])
    cache = torch.randn(9, HV, V, K)
    cache[slots] = f_pre
    untouched = cache[[0, 1, 3, 4, 6, 8]].clone()
    outs = []
    for s in range(steps):
        t = cu_full[:-1].long() + torch.tensor(prefix) + s
        outs.append(gdn.gated_delta_rule_decode(q[t], k[t], v[t], g[t], beta[t], cache, slots))
    assert rel_err(o_pre[0], o_full[0][pre_idx]) <= FP32_TOL
    dec_idx = torch.stack([cu_full[:-1].long() + torch.tensor(prefix) + s for s in range(steps)])
    assert rel_err(torch.stack(outs), o_full[0][dec_idx].float()) <= FP32_TOL
    assert rel_err(cache[slots], f_full) <= FP32_TOL
    assert torch.equal(cache[[0, 1, 3, 4, 6, 8]], untouched)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_null_pad_slots_and_gather_modes(state_dtype: torch.dtype) -> None:
    B, H, HV, K, V = 6, 4, 8, 128, 128
    cache = (torch.randn(10, HV, V, K) * 0.2).to(state_dtype)
    idx = torch.tensor([3, 0, 7, -1, 9, 1])
    q, k = torch.randn(B, H, K), torch.randn(B, H, K)
    v = torch.randn(B, HV, V)
    g, beta = _gates(B, HV, "qwen")
    results = {}
    for mode in ("index_select", "embedding_bag"):
        c = cache.clone()
        if mode == "embedding_bag" and state_dtype != torch.float32:
            continue
        o = gdn.gated_delta_rule_decode(q, k, v, g, beta, c, idx, gather=mode)
        results[mode] = (o, c)
    o, c = results["index_select"]
    if "embedding_bag" in results:
        assert rel_err(results["embedding_bag"][0], o) <= 1e-6
        assert rel_err(results["embedding_bag"][1], c) <= 1e-6
    live = [0, 2, 4, 5]
    ro, rfin = ref.gated_delta_rule_reference(
        q[live],
        k[live],
        v[live],
        g[live],
        beta[live],
        list(range(len(live) + 1)),
        initial_state=cache[idx[live]].float(),
    )
    tol = FP32_TOL if state_dtype == torch.float32 else BF16_TOL
    assert rel_err(o[live], ro) <= tol
    assert rel_err(c[idx[live]], rfin) <= tol
    assert torch.count_nonzero(o[[1, 3]]) == 0
    assert torch.equal(c[[0, 2, 4, 5, 6, 8]], cache[[0, 2, 4, 5, 6, 8]])


def test_packed_decode_api() -> None:
    """vLLM's packed-decode contract: mixed_qkv + raw a/b gates in, out[B,1,HV,V] written."""
    B, H, HV, K, V = 4, 4, 8, 128, 128
    mixed = torch.randn(B, 2 * H * K + HV * V, dtype=torch.bfloat16)
    a = torch.randn(B, HV, dtype=torch.bfloat16)
    b = torch.randn(B, HV, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    cache = torch.randn(6, HV, V, K) * 0.2
    idx = torch.tensor([1, 4, 0, 2], dtype=torch.int32)
    out = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
    start = cache.clone()
    gdn.fused_recurrent_gated_delta_rule_packed_decode(
        mixed, a, b, A_log, dt_bias, K**-0.5, cache, out, idx, use_qk_l2norm_in_kernel=True
    )
    q, k, v = gdn.split_mixed_qkv(mixed, H, K, V)
    g, beta = ref.gdn_gating_reference(A_log, a, dt_bias, b)
    live = [0, 1, 3]
    ro, rfin = ref.gated_delta_rule_reference(
        q[live],
        k[live],
        v[live],
        g[live],
        beta[live],
        [0, 1, 2, 3],
        initial_state=start[idx[live].long()],
    )
    assert not torch.isnan(out).any()
    assert rel_err(out[live, 0], ro) <= BF16_TOL
    assert rel_err(cache[idx[live].long()], rfin) <= FP32_TOL * 10
    assert torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("sd_layout", [False, True])
def test_conv_prefill_varlen_with_states(sd_layout: bool) -> None:
    D, W = 48, 4
    lens = _random_lens(2, 40) + [2]
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    x = torch.randn(T, D)
    w, bias = torch.randn(D, W), torch.randn(D)
    n_slots = N + 3
    # vLLM's default "SD" cache is [slots, W-1, D]; the kernels see its transpose.
    store = torch.randn(n_slots, W - 1, D) if sd_layout else torch.randn(n_slots, D, W - 1)
    conv_states = store.transpose(1, 2) if sd_layout else store
    slots = torch.randperm(n_slots - 1)[:N] + 1
    his = torch.rand(N) < 0.6
    init = conv_states[slots].clone()
    init[~his] = 0.0
    before = conv_states.clone()
    out = gdn.causal_conv1d_prefill(x, w, bias, conv_states, cu, slots, his)
    ro, rstates = ref.conv1d_reference(x, w, bias, cu, init)
    assert rel_err(out, ro) <= FP32_TOL
    assert rel_err(conv_states[slots], rstates) <= FP32_TOL
    others = [i for i in range(n_slots) if i not in slots.tolist()]
    assert torch.equal(conv_states[others], before[others])


def test_conv_prefill_pad_slot_untouched() -> None:
    D, W = 16, 4
    cu = _cu([5, 7])
    x = torch.randn(12, D)
    w = torch.randn(D, W)
    cs = torch.randn(4, D, W - 1)
    before = cs.clone()
    out = gdn.causal_conv1d_prefill(
        x, w, None, cs, cu, torch.tensor([2, -1]), torch.tensor([True, True])
    )
    ro, rst = ref.conv1d_reference(x[:5], w, None, [0, 5], before[2:3])
    assert rel_err(out[:5], ro) <= FP32_TOL
    assert rel_err(cs[2:3], rst) <= FP32_TOL
    assert torch.equal(cs[[0, 1, 3]], before[[0, 1, 3]])


def test_conv_prefix_then_decode_equals_full() -> None:
    D, W = 40, 4
    prefix, steps = [1, 6, 2], 4
    N = len(prefix)
    full = [p + steps for p in prefix]
    cu_full = _cu(full)
    x = torch.randn(int(cu_full[-1]), D, dtype=torch.bfloat16)
    w, bias = torch.randn(D, W), torch.randn(D)
    st_full = torch.randn(N + 2, D, W - 1, dtype=torch.bfloat16)
    st_inc = st_full.clone()
    slots = torch.tensor([3, 1, 4])
    his = torch.tensor([True, False, True])
    out_full = gdn.causal_conv1d_prefill(x, w, bias, st_full, cu_full, slots, his)
    pre_idx = torch.cat(
        [torch.arange(int(cu_full[s]), int(cu_full[s]) + prefix[s]) for s in range(N)]
    )
    out_pre = gdn.causal_conv1d_prefill(x[pre_idx], w, bias, st_inc, _cu(prefix), slots, his)
    assert torch.equal(out_pre, out_full[pre_idx])
    for s in range(steps):
        t = cu_full[:-1].long() + torch.tensor(prefix) + s
        o = gdn.causal_conv1d_decode(x[t], st_inc, w, bias, "silu", slots)
        assert rel_err(o, out_full[t]) <= BF16_TOL
    assert torch.equal(st_inc[slots], st_full[slots])


def test_conv_decode_null_slot() -> None:
    D, W = 8, 4
    cs = torch.randn(3, D, W - 1)
    before = cs.clone()
    x = torch.randn(2, D)
    w = torch.randn(D, W)
    out = gdn.causal_conv1d_decode(x, cs, w, None, "silu", torch.tensor([0, 2]))
    assert torch.count_nonzero(out[0]) == 0
    assert torch.equal(cs[0], before[0]) and torch.equal(cs[1], before[1])
    assert torch.equal(cs[2, :, -1], x[1]) and torch.equal(cs[2, :, :-1], before[2, :, 1:])


def test_rms_norm_gated_vs_reference() -> None:
    x = torch.randn(5, 8, 128, dtype=torch.bfloat16)
    z = torch.randn(5, 8, 128, dtype=torch.bfloat16)
    w = torch.randn(128)
    out = gdn.rms_norm_gated(x, z, w, 1e-6)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.rms_norm_gated_reference(x, z, w, 1e-6)) <= BF16_TOL
    x32, z32 = x.float(), z.float()
    assert (
        rel_err(
            gdn.rms_norm_gated(x32, z32, w, 1e-6), ref.rms_norm_gated_reference(x32, z32, w, 1e-6)
        )
        <= FP32_TOL
    )


def _decode_layer_step(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    idx: torch.Tensor,
    conv_w: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_w: torch.Tensor,
) -> torch.Tensor:
    """One GDN decode step (conv -> recurrent rule -> gated norm), as the engine would run it."""
    HV, V, K = ssm_state.shape[1:]
    x = gdn.causal_conv1d_decode(mixed, conv_state, conv_w, None, "silu", idx)
    out = torch.empty(mixed.shape[0], 1, HV, V, dtype=mixed.dtype)
    gdn.fused_recurrent_gated_delta_rule_packed_decode(
        x, a, b, A_log, dt_bias, K**-0.5, ssm_state, out, idx, use_qk_l2norm_in_kernel=True
    )
    return gdn.rms_norm_gated(out[:, 0], z, norm_w, 1e-6)


def test_decode_step_compiles_fullgraph() -> None:
    """Capture-safety proxy: the whole decode step traces as one graph (no graph breaks, no
    host syncs, no data-dependent shapes). backend="eager" keeps it quick on CPU."""
    B, H, HV, K, V, W = 3, 4, 8, 128, 128, 4
    D = 2 * H * K + HV * V
    mixed = torch.randn(B, D, dtype=torch.bfloat16)
    a, b = torch.randn(B, HV, dtype=torch.bfloat16), torch.randn(B, HV, dtype=torch.bfloat16)
    z = torch.randn(B, HV, V, dtype=torch.bfloat16)
    conv_w, A_log, dt_bias = torch.randn(D, W), torch.randn(HV), torch.randn(HV)
    norm_w = torch.randn(V)
    conv_state = torch.randn(5, D, W - 1, dtype=torch.bfloat16)
    ssm_state = torch.randn(5, HV, V, K) * 0.1
    idx = torch.tensor([4, 0, 2])
    params = (conv_w, A_log, dt_bias, norm_w)
    cs_e, ss_e = conv_state.clone(), ssm_state.clone()
    eager = _decode_layer_step(mixed, a, b, z, cs_e, ss_e, idx, *params)
    torch._dynamo.reset()
    compiled = torch.compile(_decode_layer_step, fullgraph=True, backend="eager")
    cs_c, ss_c = conv_state.clone(), ssm_state.clone()
    got = compiled(mixed, a, b, z, cs_c, ss_c, idx, *params)
    assert torch.equal(got, eager)
    assert torch.equal(cs_c, cs_e) and torch.equal(ss_c, ss_e)


def test_scan_shape_rules() -> None:
    for n in (1, 2, 16, 17, 33, 256, 257, 1024, 1025, 4097):
        n_pad, group = gdn._scan_shape(n)
        assert n_pad >= n and n_pad % group == 0
        assert n_pad - n < group  # only the last group is padded
    for n in (256, 1024):  # T = 16K, 64K: a few dozen sequential steps, little padding
        n_pad, group = gdn._scan_shape(n)
        assert 3 * group + n_pad // group <= 4 * math.isqrt(3 * n) and n_pad - n <= n // 64


def test_fast_reference_matches_loop_reference() -> None:
    """The heads-vectorised float64 reference (used by the GPU benchmark) == the plain one."""
    H, HV, K, V = 2, 4, 16, 8
    cu = _cu([5, 0, 9])
    T = int(cu[-1])
    q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, HV, V)
    g, beta = _gates(T, HV, "qwen")
    h0 = torch.randn(3, HV, V, K)
    a = ref.gated_delta_rule_reference(q, k, v, g, beta, cu, initial_state=h0)
    b = ref.gated_delta_rule_reference_fast(q, k, v, g, beta, cu, initial_state=h0)
    assert rel_err(b[0], a[0]) <= 1e-12 and rel_err(b[1], a[1]) <= 1e-12


def test_chunk_prefill_tri_solve_variants_agree() -> None:
    """Block-doubling inverse (portable default) == torch.linalg.solve_triangular path."""
    H, HV, K, V = 2, 4, 32, 16
    lens = _random_lens(2, 150)
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g, beta = _gates(T, HV, "qwen")
    h0 = torch.randn(N, HV, V, K)
    outs = [
        gdn.chunk_gated_delta_rule(
            q,
            k,
            v,
            g[None],
            beta[None],
            initial_state=h0,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            tri_solve=ts,
        )
        for ts in ("matmul", "torch")
    ]
    ro, rfin = ref.gated_delta_rule_reference(q[0], k[0], v[0], g, beta, cu, initial_state=h0)
    for o, fin in outs:
        assert rel_err(o[0], ro) <= FP32_TOL and rel_err(fin, rfin) <= FP32_TOL


def test_chunk_prefill_only_empty_sequences() -> None:
    H, HV, K, V = 1, 2, 8, 8
    h0 = torch.randn(2, HV, V, K)
    empty = torch.zeros(1, 0, H, K)
    o, fin = gdn.chunk_gated_delta_rule(
        empty,
        empty,
        torch.zeros(1, 0, HV, V),
        torch.zeros(1, 0, HV),
        torch.zeros(1, 0, HV),
        initial_state=h0,
        cu_seqlens=_cu([0, 0]),
    )
    assert o.shape == (1, 0, HV, V) and torch.equal(fin, h0)


def test_cuda_tf32_scope_restores_the_process_setting() -> None:
    """``tf32`` only scopes CUDA's TF32 switch around the prefill: the process-wide setting
    (vLLM's VLLM_FLOAT32_MATMUL_PRECISION) is back afterwards, also when the body raises; CPU
    results do not depend on it."""
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for start in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = start
            with gdn._cuda_tf32(True):
                assert torch.backends.cuda.matmul.allow_tf32 is True
            assert torch.backends.cuda.matmul.allow_tf32 is start
            with pytest.raises(RuntimeError), gdn._cuda_tf32(True):
                raise RuntimeError("boom")
            assert torch.backends.cuda.matmul.allow_tf32 is start
            with gdn._cuda_tf32(False):
                assert torch.backends.cuda.matmul.allow_tf32 is start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    H, HV, K, V = 2, 4, 32, 16
    cu = _cu([70, 5])
    T = int(cu[-1])
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, HV, V)
    g, beta = _gates(T, HV, "qwen")
    o1, f1 = gdn.chunk_gated_delta_rule(q, k, v, g[None], beta[None], cu_seqlens=cu, tf32=True)
    o2, f2 = gdn.chunk_gated_delta_rule(q, k, v, g[None], beta[None], cu_seqlens=cu, tf32=False)
    assert torch.equal(o1, o2) and torch.equal(f1, f2)
