"""The tiny Qwen3.5-MoE in float32 through vLLM 0.6.3's V0 engine against transformers.

``vllm.LLM`` on the stand-in runs the card's GPU worker and model runner on CPU tensors
(``scripts/standin_v0/vllm_standin``), our model class (``register()``), our paged attention
backend (``engines/v0/attention.py``) and the native ops. Greedy continuations must be
token-identical to Hugging Face transformers' forward pass on the same weights (the oracle JSON
that ``tests/native_engine/hf_oracle.py`` computes in the 0.32 venv, whose transformers knows
``qwen3_5_moe``; ``make`` produces it as ``build/hf_oracle.json`` before ``test-v0``).

Prefix caching is on, as the YAML asks (hits resume only where a GDN state checkpoint exists;
``test_v0_prefix_cache.py``), so ``prefix_hit`` may resume from ``len2000``'s blocks. Chunked prefill is on with a 256-token step budget, so the 500- and 2,000-token prompts cross
chunk boundaries (GDN states carried across chunks, attention over the cached context), and all
prompts run in one ``generate`` call, so prefill chunks and decodes share steps. ``n = 2``
greedy samples must both equal the oracle (the fork's GDN state is a copy of the prompt's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from v0_model_harness import ORACLE_JSON, TINY_MODEL

MAX_NUM_BATCHED_TOKENS = 256
MAX_NEW = 64
NAMES = ["len20", "len500", "len2000", "prefix_hit", "batch0", "batch1", "batch2", "batch3"]


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE_JSON.exists():
        pytest.fail(
            f"{ORACLE_JSON} is missing: compute it in the 0.32 venv with "
            "`.venv/bin/python tests/native_engine/hf_oracle.py build/hf_oracle.json`"
        )
    data = json.loads(ORACLE_JSON.read_text())
    missing = [n for n in NAMES if n not in data]
    assert not missing, f"{ORACLE_JSON} lacks prompts {missing}"
    return data


@pytest.fixture(scope="module")
def llm(oracle: dict[str, Any]) -> Iterator[Any]:
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: build it with `make model`")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from vllm_overrides.engines.v0 import register

    register()  # the vllm.general_plugins entry point does this in a deployed venv
    engine = LLM(
        model=str(TINY_MODEL),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=16,
        max_model_len=4096,
        seed=0,
        enable_prefix_caching=True,  # as the YAML asks
    )
    yield engine
    del engine


def _generate(llm: Any, prompts: list[list[int]], n: int = 1) -> list[Any]:
    from vllm import SamplingParams

    if n == 1:
        # logprobs=0: the chosen token's log-probability, compared with the oracle's.
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    else:
        # vLLM 0.6.3 refuses n > 1 with temperature 0; top_k = 1 samples the argmax all the same.
        params = SamplingParams(n=n, temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return list(outs)


def _diverge(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"first divergence at generated token {i}: engine {a} vs HF {b}"
    return f"lengths {len(got)} vs {len(want)}"


def test_engine_runs_the_card_path(llm: Any) -> None:
    """The stand-in ran the GPU model runner with chunked prefill, our model and backend, and
    KV only for the full-attention layers."""
    engine = llm.llm_engine
    assert engine.scheduler_config.chunked_prefill_enabled
    worker = engine.model_executor.driver_worker
    assert type(worker.model_runner).__name__ == "ModelRunner", type(worker.model_runner)
    model = worker.model_runner.model
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    n_attn = sum(1 for layer in model.model.layers if layer.layer_type == "full_attention")
    assert len(worker.cache_engine[0].gpu_cache) == n_attn
    # Prefix caching as the YAML asks, with GDN state checkpoints (test_v0_prefix_cache.py):
    # a hit resumes only where both the KV blocks and a GDN state exist.
    assert engine.cache_config.enable_prefix_caching
    assert engine.scheduler[0].block_manager.enable_caching


def test_greedy_matches_hf_with_chunked_prefill(llm: Any, oracle: dict[str, Any]) -> None:
    outs = _generate(llm, [oracle[n]["prompt"] for n in NAMES])
    bad = []
    for name, out in zip(NAMES, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want = oracle[name]["tokens"][:MAX_NEW]
        if got != want:
            bad.append(f"{name}: {_diverge(got, want)}")
            continue
        # Same math in float32 through different kernels: the chosen tokens' log-probabilities
        # agree closely too (much more sensitive than the tokens of a random tiny model).
        lps = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got, strict=True)]
        worst = max(abs(a - b) for a, b in zip(lps, oracle[name]["logprobs"], strict=False))
        if worst >= 1e-3:
            bad.append(f"{name}: chosen-token logprob differs by up to {worst:.3g}")
    assert not bad, "; ".join(bad)


def test_n2_greedy_samples_both_match_hf(llm: Any, oracle: dict[str, Any]) -> None:
    (out,) = _generate(llm, [oracle["len500"]["prompt"]], n=2)
    want = oracle["len500"]["tokens"][:MAX_NEW]
    assert len(out.outputs) == 2
    for i, o in enumerate(out.outputs):
        got = list(o.token_ids)
        assert got == want, f"sample {i}: {_diverge(got, want)}"


def test_gdn_slots_are_freed_with_their_requests(llm: Any) -> None:
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    # Finished requests are reported to the model with the next step: run one more request.
    _generate(llm, [[1, 2, 3]])
    _generate(llm, [[4, 5, 6]])
    assert model.states is not None
    assert model.states.slots_in_use() <= 1, model.states._slots


_TP2_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm_overrides.engines.v0 import register
register()  # inherited by the forked worker process
from vllm import LLM, SamplingParams
prompts, budget, max_new = json.loads(sys.argv[1])
llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=16,
          max_model_len=4096, seed=0, tensor_parallel_size=2,
          distributed_executor_backend="mp")
params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def test_tp2_greedy_matches_hf(oracle: dict[str, Any]) -> None:
    """Tensor parallel 2 on the stand-in (two CPU ranks over gloo, the card's multiprocessing
    executor): attention heads, GDN heads and expert/shared intermediate sizes split over the
    ranks must give the same tokens. A separate process: vLLM's parallel groups are per
    process, and this one may already hold TP 1's."""
    import subprocess
    import sys

    names = ["len20", "len500", "len2000", "batch0"]
    args = json.dumps([[oracle[n]["prompt"] for n in names], MAX_NUM_BATCHED_TOKENS, MAX_NEW])
    env = {**os.environ, "PYTHONPATH": str(TINY_MODEL.parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", _TP2_SCRIPT, args, str(TINY_MODEL)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"TP 2 run failed:\n{proc.stderr[-4000:]}"
    got_all = json.loads(lines[-1][len("RESULT ") :])
    bad = []
    for name, got in zip(names, got_all, strict=True):
        want = oracle[name]["tokens"][:MAX_NEW]
        if got != want:
            bad.append(f"{name}: {_diverge(got, want)}")
    assert not bad, "; ".join(bad)
