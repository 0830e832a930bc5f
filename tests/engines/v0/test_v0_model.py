"""Our V0 Qwen3.5/3.6 model class, driven step by step on the stand-in, against transformers.

The tiny model in float32 must give Hugging Face transformers' greedy tokens (the oracle JSON
of ``tests/native_engine/hf_oracle.py``, computed in the 0.32 venv, whose transformers knows
``qwen3_5_moe``) however V0 would schedule it: one-shot prefill, a prompt cut into chunks that
do not line up with the GDN chunk grid (64) while another request decodes in the same steps,
several requests batched, a prompt recomputed from position 0 after a preemption, a request
whose slot another request used before, and ``n = 2`` forks whose states must be their own.
Attention here is a plain per-sequence test attention (see ``v0_model_harness``); the paged
backend and the engine's worker are covered by ``test_v0_oracle.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from v0_model_harness import ORACLE_JSON, TINY_MODEL, Driver, Seq, load_model

from vllm_overrides.engines.v0.gdn_state import GDNStateCache

DECODE = 24  # generated tokens compared per prompt (of the oracle's 64): keeps CI fast


# --------------------------------------------------------------------------------------------
# Config (no model)
# --------------------------------------------------------------------------------------------


def _need_tiny_model() -> None:
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: build it with `make model` (tests/tiny_model.py)")


def test_config_loads_on_transformers_451_and_sizes_the_engine() -> None:
    _need_tiny_model()
    from transformers import AutoConfig
    from vllm.config import ModelConfig, ParallelConfig

    from vllm_overrides.engines.v0 import register

    register()
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    text = json.loads((TINY_MODEL / "config.json").read_text())["text_config"]
    assert type(cfg).__name__ == "Qwen3_5MoeConfig"
    want_types = [
        "attention" if t == "full_attention" else "linear_attention" for t in text["layer_types"]
    ]
    assert cfg.layers_block_type == want_types
    mc = ModelConfig(
        str(TINY_MODEL),
        str(TINY_MODEL),
        "auto",
        False,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    pc = ParallelConfig(1, 1, False)
    assert mc.max_model_len == text["max_position_embeddings"] == 262_144
    assert mc.get_head_size() == text["head_dim"]
    assert mc.get_num_attention_heads(pc) == text["num_attention_heads"]
    assert mc.get_num_kv_heads(pc) == text["num_key_value_heads"]
    assert mc.get_num_layers(pc) == text["num_hidden_layers"]
    # KV only for the full-attention layers.
    assert mc.get_num_attention_layers(pc) == text["layer_types"].count("full_attention")
    assert mc.has_inner_state
    assert mc.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# GDN state slots (no model)
# --------------------------------------------------------------------------------------------


def _cache(max_seqs: int = 2) -> GDNStateCache:
    return GDNStateCache(2, (3, 2), (1, 2, 2), torch.float32, torch.float32, "cpu", max_seqs)


def test_state_slots_fork_copy_and_free() -> None:
    c = _cache()
    s = c.prepare({"a": [0]}, [])
    assert s.tolist() == [1]  # slot 0 is the ops' padding slot, never handed out
    for conv, ssm in (c.layer(0), c.layer(1)):
        conv[1].fill_(7.0)
        ssm[1].fill_(3.0)
    # The fork of "a" (seq 5) starts from a copy of seq 0's state; "b" gets its own slot.
    s = c.prepare({"b": [1], "a": [0, 5]}, [])
    b_slot, a_slot, fork_slot = s.tolist()
    assert a_slot == 1 and len({b_slot, a_slot, fork_slot}) == 3
    assert torch.equal(c.conv[0][fork_slot], c.conv[0][1])
    assert torch.equal(c.ssm[1][fork_slot], c.ssm[1][1])
    c.conv[0][fork_slot].fill_(-1.0)  # a copy, not a view
    assert c.conv[0][1].eq(7.0).all()
    assert c.num_slots >= 3 and c.slots_in_use() == 3
    # Finishing "a" frees both of its slots; the next request reuses them.
    s = c.prepare({"b": [1], "c": [2]}, ["a"])
    assert c.slots_in_use() == 2
    assert s.tolist()[0] == b_slot and s.tolist()[1] in (a_slot, fork_slot)


def test_state_slots_of_a_request_finished_in_its_own_step_are_freed_next_step() -> None:
    # The profile run reports its dummy requests finished in the step that runs them.
    c = _cache(max_seqs=4)
    s = c.prepare({"d0": [0], "d1": [1]}, ["d0", "d1"])
    assert len(set(s.tolist())) == 2 and c.slots_in_use() == 2
    c.prepare({}, [])
    assert c.slots_in_use() == 0


# --------------------------------------------------------------------------------------------
# The model against the oracle
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE_JSON.exists():
        pytest.fail(
            f"{ORACLE_JSON} is missing: compute it in the 0.32 venv with "
            "`.venv/bin/python tests/native_engine/hf_oracle.py build/hf_oracle.json`"
        )
    return json.loads(ORACLE_JSON.read_text())


@pytest.fixture(scope="module")
def driver() -> Driver:
    _need_tiny_model()
    return Driver(load_model(torch.float32))


def _decode_all(d: Driver, seqs: list[Seq], first: list[int], steps: int) -> list[list[int]]:
    """Append each sequence's first token, then decode all of them together ``steps - 1``
    more times; returns each sequence's generated tokens."""
    out = [[t] for t in first]
    for seq, t in zip(seqs, first, strict=True):
        seq.tokens.append(t)
    for _ in range(steps - 1):
        toks = d.step([], seqs)
        for seq, o, t in zip(seqs, out, toks, strict=True):
            o.append(t)
            seq.tokens.append(t)
    return out


def _first_divergence(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"first divergence at generated token {i}: ours {a} vs HF {b}"
    return "equal"


def _check(name: str, got: list[int], oracle: dict[str, Any]) -> None:
    want = oracle[name]["tokens"][: len(got)]
    assert got == want, f"{name}: {_first_divergence(got, want)}"


@pytest.mark.parametrize("name", ["len20", "len500"])
def test_one_shot_prefill_then_decode_matches_hf(
    driver: Driver, oracle: dict[str, Any], name: str
) -> None:
    seq = Seq(name, 0, list(oracle[name]["prompt"]))
    first = driver.step([(seq, len(seq.tokens))], [])
    got = _decode_all(driver, [seq], first, DECODE)[0]
    driver.finish(name)
    _check(name, got, oracle)


def test_mrope_positions_of_text_tokens_match_hf(driver: Driver, oracle: dict[str, Any]) -> None:
    """The interleaved-MRoPE path (``[3, T]`` positions, as the runner passes them once the
    vision path declares MRoPE) reduces to plain RoPE for text tokens."""
    seq = Seq("mrope", 0, list(oracle["len20"]["prompt"]))
    got = driver.step([(seq, len(seq.tokens))], [], mrope=True)
    for _ in range(7):
        seq.tokens.append(got[-1])
        got += driver.step([], [seq], mrope=True)
    driver.finish("mrope")
    _check("len20", got, oracle)


def test_chunked_prefill_beside_a_decoding_request_matches_hf(
    driver: Driver, oracle: dict[str, Any]
) -> None:
    """len2000 in chunks of 300 (not a multiple of the GDN chunk of 64, nor of the attention
    block of 16) while len20 decodes in the same steps, as V0's chunked-prefill scheduler
    runs them; then both decode together."""
    long = Seq("long", 0, list(oracle["len2000"]["prompt"]))
    short = Seq("short", 0, list(oracle["len20"]["prompt"]))
    short_out = driver.step([(short, len(short.tokens))], [])
    short.tokens.append(short_out[0])
    n = len(long.tokens)
    long_first = -1
    while long.computed < n:
        chunk = min(300, n - long.computed)
        toks = driver.step([(long, chunk)], [short])
        long_first = toks[0]
        short_out.append(toks[1])
        short.tokens.append(toks[1])
    assert long.computed == n and long_first >= 0
    # Both now decode together: the long prompt's generated tokens from its first.
    long.tokens.append(long_first)
    long_out = [long_first]
    for _ in range(DECODE - 1):
        a, b = driver.step([], [long, short])
        long_out.append(a)
        long.tokens.append(a)
        short_out.append(b)
        short.tokens.append(b)
    driver.finish("long")
    driver.finish("short")
    _check("len2000", long_out, oracle)
    _check("len20", short_out, oracle)


def test_batched_prompts_match_hf(driver: Driver, oracle: dict[str, Any]) -> None:
    names = [f"batch{i}" for i in range(4)]
    seqs = [Seq(n, 0, list(oracle[n]["prompt"])) for n in names]
    first = driver.step([(s, len(s.tokens)) for s in seqs], [])
    outs = _decode_all(driver, seqs, first, DECODE)
    for n, got in zip(names, outs, strict=True):
        driver.finish(n)
        _check(n, got, oracle)


def test_recompute_after_preemption_restarts_the_state(
    driver: Driver, oracle: dict[str, Any]
) -> None:
    """V0's recompute preemption prefills prompt + generated tokens again from position 0 for
    a sequence that still holds its slot: the stale state must not leak in."""
    seq = Seq("pre", 0, list(oracle["len500"]["prompt"]))
    first = driver.step([(seq, len(seq.tokens))], [])
    got = _decode_all(driver, [seq], first, 5)[0]
    seq.computed = 0  # preempted: prompt + generated tokens are prefilled again from 0
    for layer in driver._attn_layers():
        layer.kv.pop(("pre", 0), None)
    t = driver.step([(seq, len(seq.tokens))], [])[0]
    got.append(t)
    seq.tokens.append(t)
    for _ in range(DECODE - 6):
        t = driver.step([], [seq])[0]
        got.append(t)
        seq.tokens.append(t)
    driver.finish("pre")
    _check("len500", got, oracle)


def test_n2_forks_carry_their_own_states(driver: Driver, oracle: dict[str, Any]) -> None:
    """After the prompt's step samples two tokens, the parent continues greedily (the oracle's
    tokens) and the fork, which took another token, continues exactly as a fresh request
    whose prompt ends with that token."""
    prompt = list(oracle["len20"]["prompt"])
    parent = Seq("n2", 0, list(prompt))
    t0 = driver.step([(parent, len(prompt))], [])[0]
    alt = oracle["len500"]["tokens"][0]  # any other token
    assert alt != t0
    parent.tokens.append(t0)
    child = driver.fork(parent, 1, alt)
    p_out, c_out = [t0], [alt]
    for _ in range(DECODE - 1):
        a, b = driver.step([], [parent, child])
        p_out.append(a)
        parent.tokens.append(a)
        c_out.append(b)
        child.tokens.append(b)
    driver.finish("n2")
    _check("len20", p_out, oracle)
    ref = Seq("ref", 0, prompt + [alt])
    r_first = driver.step([(ref, len(ref.tokens))], [])
    ref_out = [alt] + _decode_all(driver, [ref], r_first, DECODE - 1)[0]
    driver.finish("ref")
    assert c_out == ref_out, _first_divergence(c_out, ref_out)


def test_prefix_caching_keeps_a_checkpoint_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model keeps prefix caching and puts the GDN checkpoint registry on the engine's
    config (engines/v0/prefix_cache.py); without a checkpoint pool (``VO_GDN_CHECKPOINTS=0``)
    a hit would resume attention with no GDN state, so it turns prefix caching off."""
    _need_tiny_model()
    from transformers import AutoConfig
    from vllm.config import CacheConfig

    from vllm_overrides.engines.v0 import prefix_cache, register
    from vllm_overrides.engines.v0.qwen3_5 import Qwen3_5MoeForConditionalGeneration

    register()
    from v0_model_harness import init_dist

    init_dist()
    config = AutoConfig.from_pretrained(TINY_MODEL)
    cc = CacheConfig(16, 0.9, 0, "auto", enable_prefix_caching=True)
    Qwen3_5MoeForConditionalGeneration(config, cc)
    assert cc.enable_prefix_caching is True
    reg = prefix_cache.registry_of(cc)
    assert reg is not None and reg.slots == prefix_cache.pool_size() and reg.block_size == 16
    assert reg.media_token_ids == (config.image_token_id, config.video_token_id)

    monkeypatch.setenv(prefix_cache.ENV_POOL, "0")
    cc = CacheConfig(16, 0.9, 0, "auto", enable_prefix_caching=True)
    Qwen3_5MoeForConditionalGeneration(config, cc)
    assert cc.enable_prefix_caching is False
    assert prefix_cache.registry_of(cc) is None


def test_chunked_prefill_leaves_the_one_shot_states(driver: Driver, oracle: dict[str, Any]) -> None:
    """The GDN conv and recurrent states after a prompt prefilled in uneven chunks (1 token,
    a GDN chunk of 64, sizes off every grid) equal those of the one-shot prefill. The random
    tiny model forgets fast, so its greedy tokens alone barely see a lost state (dropping the
    carried states left len2000's tokens and logprobs unchanged); the states do."""
    prompt = list(oracle["len500"]["prompt"])
    one = Seq("one", 0, list(prompt))
    driver.step([(one, len(prompt))], [])
    chunked = Seq("chunked", 0, list(prompt))
    # Ends with a 1-token chunk: the random tiny model's GDN layers forget within tens of
    # tokens, so only a short last chunk makes the final state depend on the carried one.
    for n in (37, 1, 64, 100, 297, 1):
        driver.step([(chunked, n)], [])
    assert chunked.computed == len(prompt)
    states = driver.model.states
    a, b = states._slots["one"][0], states._slots["chunked"][0]
    assert a != b
    for i in range(states.num_layers):
        conv, ssm = states.layer(i)
        # Layer 0's conv inputs are embeddings (bit-identical); later layers' inputs went
        # through GEMMs of other shapes, so float32 rounding differs a little.
        for what, t in (("conv", conv), ("recurrent", ssm)):
            err = (t[a] - t[b]).abs().max().item()
            scale = t[a].abs().max().item()
            assert scale > 0, f"GDN layer {i}: empty {what} state"
            assert err <= 1e-5 * max(scale, 1.0), f"GDN layer {i}: {what} states differ by {err}"
    driver.finish("one")
    driver.finish("chunked")
