"""The engine's two ways through a native MoE block (``vllm_overrides.engines.v1_0_32.native_switch``) on a
stand-in block: the split form (router, shared expert and all-reduce traced; only the routed
experts in the opaque op) and the whole-block op that ``PROF_MOE_SUMMARY`` uses, which also
times each section. Both must equal the float64 reference of the whole block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from native_util import rel_err

from vllm_overrides.engines.v1_0_32 import native_switch as engine
from vllm_overrides.native import moe
from vllm_overrides.native import moe_reference as ref

FP32_TOL = 1e-5


def _block(E: int, H: int, I: int, Is: int, k: int) -> SimpleNamespace:  # noqa: E741
    """What the engine reads off ``Qwen3NextSparseMoeBlock`` (unquantised, TP 1)."""
    gate = torch.nn.Linear(H, E, bias=False)
    gate_up = torch.randn(2 * Is, H) * H**-0.5
    down = torch.randn(H, Is) * Is**-0.5
    sgate = torch.randn(1, H) * H**-0.5
    experts = SimpleNamespace(
        w13_weight=torch.randn(E, 2 * I, H) * H**-0.5, w2_weight=torch.randn(E, H, I) * I**-0.5
    )
    return SimpleNamespace(
        gate=gate, experts=experts, tp_size=1, _vo_top_k=k, _vo_renormalize=True,
        shared_expert=lambda x: moe.shared_expert(x, gate_up, down, sgate),
        _w=(gate.weight.detach(), gate_up, down, sgate),
    )  # fmt: skip


@pytest.mark.parametrize("T", [3, 40])  # decode (<= 32 tokens) and prefill buckets
def test_split_and_whole_block_paths_equal_reference(
    T: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    E, H, I, Is, k = 16, 64, 32, 48, 4  # noqa: E741
    block = _block(E, H, I, Is, k)
    monkeypatch.setitem(engine._MOE_BLOCKS, "layers.0.mlp", block)
    monkeypatch.setattr(engine, "MOE_NATIVE", True)
    monkeypatch.setattr(engine, "MOE_DECODE_NATIVE", False)
    x = torch.randn(T, H)
    with torch.no_grad():
        router, gate_up, down, sgate = block._w
        want = ref.sparse_moe_block_reference(
            x, router, block.experts.w13_weight, block.experts.w2_weight, k, True,
            gate_up, down, sgate, router_logits=block.gate(x),
        )  # fmt: skip
        block._vo_name, block._vo_split = "layers.0.mlp", True
        split = engine.moe_block_forward(block, x)
        block._vo_split = False
        whole = engine.moe_block_forward(block, x)
        monkeypatch.setattr(engine, "MOE_SUMMARY_EVERY", 1000)
        monkeypatch.setattr(engine, "_STATS", engine._MoeStats())
        timed = engine.moe_block_forward(block, x)
    assert rel_err(split, want) <= FP32_TOL
    assert torch.equal(whole, split) and torch.equal(timed, split)
    bucket = "decode" if T <= engine.MOE_DECODE_MAX_TOKENS else "prefill"
    stats = engine._STATS
    assert stats.calls[bucket] == 1 and stats.tokens[bucket] == T
    assert {s for (b, s) in stats.ms if b == bucket} == {"routed", "shared"}  # no all-reduce
    assert f"{bucket} [native" in stats.summary()
