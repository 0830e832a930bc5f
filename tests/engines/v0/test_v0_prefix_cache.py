"""Hybrid prefix caching on the V0 engine: GDN state checkpoints at KV block boundaries.

The tiny Qwen3.5-MoE in float32 through vLLM 0.6.3's engine on the stand-in (the card's GPU
worker and model runner on CPU tensors), prefix caching on as the YAML asks, chunked prefill
with a 256-token budget, a small checkpoint pool (``VO_GDN_CHECKPOINTS=6``) and a small KV
cache (400 blocks of 16), so evictions of both happen inside the module.

What must hold: greedy output with a prefix hit is token-identical to the same request without
one (the HF oracle where it has the prompt, else the same engine with every checkpoint
forgotten, i.e. no hit); the reported ``cached_tokens`` (patches 0012-0014) is the block
boundary that was actually resumed; exhausted pools and evicted KV blocks shrink or remove the
hit and never break an answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from v0_model_harness import ORACLE_JSON, TINY_MODEL

BUDGET = 256
BLOCK = 16
POOL = 6
KV_BLOCKS = 400
MAX_NEW = 64
TP2_NEW = 16  # decode steps cost most at TP 2 (an all-reduce per layer over gloo)
IM_END = 248046  # the tiny model's tokenizer: <|im_end|>


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE_JSON.exists():
        pytest.fail(f"{ORACLE_JSON} is missing: `make test-v0` builds it")
    return json.loads(ORACLE_JSON.read_text())


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: build it with `make model`")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    saved = os.environ.get("VO_GDN_CHECKPOINTS")
    os.environ["VO_GDN_CHECKPOINTS"] = str(POOL)
    from vllm import LLM

    from vllm_overrides.engines.v0 import register

    register()
    try:
        engine = LLM(
            model=str(TINY_MODEL),
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=16,
            max_model_len=4096,
            seed=0,
            enable_prefix_caching=True,
            block_size=BLOCK,
            num_gpu_blocks_override=KV_BLOCKS,
        )
    finally:
        if saved is None:
            os.environ.pop("VO_GDN_CHECKPOINTS", None)
        else:
            os.environ["VO_GDN_CHECKPOINTS"] = saved
    yield engine
    del engine


def _registry(llm: Any) -> Any:
    from vllm_overrides.engines.v0.prefix_cache import registry_of

    reg = registry_of(llm.llm_engine.cache_config)
    assert reg is not None, "prefix caching was turned off for the hybrid model"
    return reg


def _gen(llm: Any, prompts: list[list[int]], max_new: int = MAX_NEW, n: int = 1) -> list[Any]:
    from vllm import SamplingParams

    if n == 1:
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    else:  # 0.6.3 refuses n > 1 at temperature 0; top_k = 1 samples the argmax all the same
        params = SamplingParams(n=n, temperature=1.0, top_k=1, max_tokens=max_new, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def _tokens(out: Any, i: int = 0) -> list[int]:
    return list(out.outputs[i].token_ids)


def _cold(llm: Any, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """The engine's answer without any prefix hit (every checkpoint forgotten first; the
    checkpoints this run saves are forgotten again)."""
    reg = _registry(llm)
    reg.clear()
    (out,) = _gen(llm, [prompt], max_new)
    assert out.num_cached_tokens == 0
    reg.clear()
    return _tokens(out)


def _random_prompt(seed: int, n: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100_000, (n,), generator=g).tolist()


def _assert_oracle(out: Any, want: dict[str, Any]) -> None:
    got = _tokens(out)
    assert got == want["tokens"][:MAX_NEW]
    lps = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got, strict=True)]
    worst = max(abs(a - b) for a, b in zip(lps, want["logprobs"], strict=False))
    assert worst < 1e-3, f"chosen-token logprob differs by up to {worst:.3g}"


def test_prefix_caching_stays_on_with_a_checkpoint_pool(llm: Any) -> None:
    engine = llm.llm_engine
    assert engine.cache_config.enable_prefix_caching
    assert engine.scheduler[0].block_manager.enable_caching
    model = engine.model_executor.driver_worker.model_runner.model
    _gen(llm, [[5, 6, 7]], 1)
    assert model.states is not None and len(model.states.ck_conv) == len(model._gdn_layers)
    assert model.states.ck_ssm[0].shape[0] == POOL


def test_repeated_prompt_resumes_at_its_last_full_block(llm: Any, oracle: dict[str, Any]) -> None:
    """The evaluator's cache check: the same prompt twice, the second reports cached tokens."""
    reg = _registry(llm)
    reg.clear()
    first, second = (_gen(llm, [oracle["len500"]["prompt"]])[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 500 // BLOCK * BLOCK
    _assert_oracle(first, oracle["len500"])
    _assert_oracle(second, oracle["len500"])


def test_shared_first_blocks_hit_inside_the_chunking(llm: Any, oracle: dict[str, Any]) -> None:
    """``prefix_hit`` shares ``len2000``'s first 1,000 tokens. An earlier prompt of exactly
    those tokens saved a state at 992 (inside its last 256-token chunk: a segmented save); the
    hit resumes there and the rest (308 tokens) runs in chunks of 256 from 992."""
    reg = _registry(llm)
    reg.clear()
    _gen(llm, [oracle["len2000"]["prompt"][:1000]], 1)
    (out,) = _gen(llm, [oracle["prefix_hit"]["prompt"]])
    assert out.num_cached_tokens == 992
    _assert_oracle(out, oracle["prefix_hit"])


def test_next_turn_extends_prompt_and_completion(llm: Any, oracle: dict[str, Any]) -> None:
    turn1 = oracle["len500"]["prompt"]
    turn2 = turn1 + oracle["len500"]["tokens"][:MAX_NEW] + oracle["batch2"]["prompt"]
    want = _cold(llm, turn2, 24)
    (first,) = _gen(llm, [turn1])
    _assert_oracle(first, oracle["len500"])
    (out,) = _gen(llm, [turn2], 24)
    assert out.num_cached_tokens == 496
    assert _tokens(out) == want


def test_n2_with_a_cached_prefix(llm: Any, oracle: dict[str, Any]) -> None:
    reg = _registry(llm)
    reg.clear()
    _gen(llm, [oracle["len500"]["prompt"]], 1)
    (out,) = _gen(llm, [oracle["len500"]["prompt"]], n=2)
    assert out.num_cached_tokens == 496
    for i in range(2):
        assert _tokens(out, i) == oracle["len500"]["tokens"][:MAX_NEW], f"sample {i}"


def test_system_block_junction_serves_a_new_session(llm: Any) -> None:
    """Two sessions share a 301-token first message (ending in <|im_end|>) and nothing after
    it: the first saves a state at the message's last full block (288), the second resumes
    there although the first prompt's end is elsewhere."""
    system = [*_random_prompt(1, 300), IM_END]
    a = system + _random_prompt(2, 200)
    b = system + _random_prompt(3, 150)
    want = _cold(llm, b, 16)
    _gen(llm, [a], 1)
    (out,) = _gen(llm, [b], 16)
    assert out.num_cached_tokens == 288
    assert _tokens(out) == want


def test_block_aligned_prompt_repeated(llm: Any) -> None:
    """A 512-token prompt: its state at 512 serves a next turn, the one at 496 a repeat."""
    p = _random_prompt(4, 512)
    want = _cold(llm, p, 16)
    first, second = (_gen(llm, [p], 16)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 496)
    assert _tokens(first) == want and _tokens(second) == want


def test_exhausted_pool_shrinks_hits_never_answers(llm: Any) -> None:
    """Eight prompts saving one checkpoint each into a pool of six, then all again, newest
    first: the six still pooled hit, the two evicted run without a hit (and save again,
    evicting others); every answer equals its no-hit answer."""
    prompts = [_random_prompt(10 + i, 300) for i in range(8)]
    want = [_cold(llm, p, 8) for p in prompts]
    reg = _registry(llm)
    for p in prompts:
        _gen(llm, [p], 1)
    assert len(reg.by_hash) == POOL
    cached = []
    for p, w in reversed(list(zip(prompts, want, strict=True))):
        (out,) = _gen(llm, [p], 8)
        assert _tokens(out) == w
        cached.append(out.num_cached_tokens)
    assert cached == [288] * 6 + [0, 0]


def test_evicted_kv_blocks_drop_the_hit(llm: Any) -> None:
    """A prompt's checkpoint stays in the pool while its KV blocks are evicted by a flood of
    other prompts (more than the 400 KV blocks): the next run of it finds no KV, takes no hit
    and answers as without one; the stale checkpoint is reused first."""
    p = _random_prompt(30, 300)
    want = _cold(llm, p, 8)
    reg = _registry(llm)
    _gen(llm, [p], 1)
    assert len(reg.by_hash) == 1
    _gen(llm, [_random_prompt(40 + i, 2000) for i in range(4)], 2)
    (out,) = _gen(llm, [p], 8)
    assert out.num_cached_tokens == 0
    assert _tokens(out) == want


_TP2_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm_overrides.engines.v0 import register
register()  # inherited by the forked worker process
from vllm import LLM, SamplingParams
prompts, budget, max_new = json.loads(sys.argv[1])
llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=16,
          max_model_len=2048, seed=0, tensor_parallel_size=2,
          distributed_executor_backend="mp", enable_prefix_caching=True,
          swap_space=0.05, num_gpu_blocks_override=512)
params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
res = []
for p in prompts:
    (o,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    res.append([list(o.outputs[0].token_ids), o.num_cached_tokens])
    print("DONE", len(p), o.num_cached_tokens, flush=True)
print("RESULT " + json.dumps(res), flush=True)
"""


def test_tp2_ranks_load_and_save_the_same_checkpoints(oracle: dict[str, Any]) -> None:
    """Tensor parallel 2 (the card's multiprocessing executor, CPU ranks over gloo): rank 1
    gets the checkpoint plan only through the broadcast attention metadata. A repeated prompt
    and a shared-prefix prompt resume with hits and still equal the oracle."""
    import subprocess
    import sys

    prompts = [
        oracle["len500"]["prompt"],
        oracle["len500"]["prompt"],
        oracle["len2000"]["prompt"][:1000],
        oracle["prefix_hit"]["prompt"],
    ]
    args = json.dumps([prompts, BUDGET, TP2_NEW])
    env = {**os.environ, "PYTHONPATH": str(TINY_MODEL.parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", _TP2_SCRIPT, args, str(TINY_MODEL)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"TP 2 run failed:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])
    assert [c for _, c in res] == [0, 496, 0, 992]
    assert res[1][0] == oracle["len500"]["tokens"][:TP2_NEW]
    assert res[3][0] == oracle["prefix_hit"]["tokens"][:TP2_NEW]
