"""The stand-in runs the card's V0 code paths on CPU, and they produce Hugging Face's tokens.

vLLM 0.6.3 on the card runs ``GPUExecutor`` -> ``vllm.worker.worker.Worker`` -> ``ModelRunner``
with chunked prefill (forced above 32K context) and prefix caching (block manager v2). Upstream's
CPU executor turns both off and runs another runner, so the stand-in routes device "cpu" to
``vllm_standin`` (``scripts/standin_v0/``): the card's executor, worker and runner on CPU
tensors. These tests prove that routing and that, through it, vLLM's engine with our attention
backend (``vllm_overrides/engines/v0/attention.py``) computes what ``transformers`` computes:

- a tiny random-weight Qwen2 (float32, head_dim 256, GQA; ``standin_tiny_qwen2.py``) generates
  greedy tokens identical to ``transformers``' own ``generate`` for prompts longer than one
  chunk, for a batch that mixes chunked prefills with decodes, and for a prompt whose prefix is
  served from the prefix cache (checked: the runner computed only the uncached tokens);
- the seqlen-agnostic kwargs that models with inner state (our GDN layers) depend on arrive:
  the model is Qwen2 declared ``has_inner_state`` and records ``request_ids_to_seq_ids`` and
  ``finished_requests_ids`` on every forward.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from tests.engines.v0 import standin_tiny_qwen2 as tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MODEL_DIR = ROOT / "build" / "standin-tiny-qwen2"
PROBE_ARCH = "StandinInnerStateQwen2"
BLOCK = 16
CHUNK = 32  # max_num_batched_tokens: every prompt here but one is longer
NEW_TOKENS = 12


def _probe_class() -> type:
    """Qwen2ForCausalLM (vLLM's) declared as a model with inner state, recording its kwargs."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    class StandinInnerStateQwen2(Qwen2ForCausalLM):
        has_inner_state: ClassVar[bool] = True
        # per forward: (request_ids_to_seq_ids, finished_requests_ids, prefill tokens,
        # decode tokens)
        calls: ClassVar[list[tuple[dict[str, list[int]], list[str], int, int]]] = []

        def __init__(self, *args: Any, scheduler_config: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

        def forward(
            self,
            input_ids,
            positions,
            kv_caches,
            attn_metadata,  # type: ignore[override]
            intermediate_tensors=None,
            **kwargs: Any,
        ):
            type(self).calls.append(
                (
                    dict(kwargs["request_ids_to_seq_ids"]),
                    list(kwargs["finished_requests_ids"]),
                    attn_metadata.num_prefill_tokens,
                    attn_metadata.num_decode_tokens,
                )
            )
            return super().forward(
                input_ids, positions, kv_caches, attn_metadata, intermediate_tensors
            )

    return StandinInnerStateQwen2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The tiny checkpoint, and a twin whose config names the probe architecture."""
    tiny.build(MODEL_DIR)
    probe = MODEL_DIR.with_name(MODEL_DIR.name + "-probe")
    if probe.exists():
        shutil.rmtree(probe)
    shutil.copytree(MODEL_DIR, probe)
    config = json.loads((probe / "config.json").read_text())
    config["architectures"] = [PROBE_ARCH]
    (probe / "config.json").write_text(json.dumps(config))
    return probe


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, tiny.VOCAB) for _ in range(n)]

    long = ids(100)  # four chunks
    return {
        "long": long,
        # shares 5 full blocks (80 tokens) with "long": a prefix-cache hit once "long" ran
        "shared": long[: 5 * BLOCK] + ids(23),
        "short": ids(9),  # one chunk, decodes while the others prefill
        "mid": ids(57),
    }


def _hf_greedy(
    model_dir: Path, prompts: dict[str, list[int]], new_tokens: int = NEW_TOKENS
) -> dict[str, list[int]]:
    from transformers import GenerationConfig, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    # No end-of-sequence token: both sides generate exactly NEW_TOKENS (generate() would fill
    # an unset eos_token_id in from the model's own generation config).
    model.generation_config = GenerationConfig()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    out = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            seq = model.generate(torch.tensor([ids]), generation_config=config)
            out[name] = seq[0, len(ids) :].tolist()
            assert len(out[name]) == new_tokens
    return out


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Hugging Face's greedy tokens for every prompt (the oracle of both tests)."""
    tiny.build(MODEL_DIR)
    return _hf_greedy(MODEL_DIR, _prompts())


def test_card_paths_match_transformers(
    model_dir: Path, expected: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.utils import Device
    from vllm.worker.model_runner import ModelRunner
    from vllm_standin.executor import StandinExecutor
    from vllm_standin.worker import StandinWorker

    probe = _probe_class()
    ModelRegistry.register_model(PROBE_ARCH, probe)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = _prompts()

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        enable_prefix_caching=True,
        block_size=BLOCK,
        max_model_len=512,
        swap_space=0.05,
    )
    engine = llm.llm_engine
    worker = engine.model_executor.driver_worker
    # The card's executor, worker and runner, with both features still on (upstream's CPU
    # executor would have turned them off and run CPUModelRunner).
    assert type(engine.model_executor) is StandinExecutor
    assert isinstance(worker, StandinWorker)
    assert type(worker.model_runner) is ModelRunner
    assert engine.scheduler_config.chunked_prefill_enabled
    assert engine.cache_config.enable_prefix_caching
    assert worker.model_runner.attn_backend.get_name() == "VO_PAGED"
    assert worker.model_runner.has_inner_state

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(names: list[str]) -> dict[str, list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False
        )
        return {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs, strict=True)}

    probe.calls.clear()
    got = run(["long"])
    first = list(probe.calls)
    # 100 prompt tokens in chunks of at most CHUNK: at least four prefill steps.
    prefill_steps = [p for _, _, p, _ in first if p]
    assert max(prefill_steps) <= CHUNK and len(prefill_steps) >= 4, prefill_steps
    assert sum(prefill_steps) == len(prompts["long"])

    probe.calls.clear()
    got.update(run(["shared"]))
    second = list(probe.calls)
    # The prefix cache served "shared"'s first 5 blocks: the runner computed only the rest,
    # plus at most one token per step (a chunk that is all cache hit still computes its last
    # token: ModelInputForGPUBuilder._compute_for_prefix_cache_hit).
    computed = [p for _, _, p, _ in second if p]
    uncached = len(prompts["shared"]) - 5 * BLOCK
    assert uncached <= sum(computed) <= uncached + len(computed), (computed, uncached)
    assert engine.scheduler[0].get_prefix_cache_hit_rate(Device.GPU) > 0

    probe.calls.clear()
    got.update(run(["short", "mid"]))
    third = list(probe.calls)
    # "short" decodes while "mid" is still prefilling in chunks: mixed batches, the card's
    # chunked-prefill path.
    assert any(p and d for _, _, p, d in third), [(p, d) for _, _, p, d in third]
    assert got == expected

    # The seqlen-agnostic kwargs: each step maps the running requests to their one sequence;
    # a finished request is reported exactly once, in a step after its last one ("long" and
    # "shared" in the first step of the next call; "short" while "mid" still runs or later).
    steps = first + second + third
    ids_by_call = [{rid for ids, _, _, _ in call for rid in ids} for call in (first, second, third)]
    assert [len(ids) for ids in ids_by_call] == [1, 1, 2]
    assert all(len(seqs) == 1 for ids, _, _, _ in steps for seqs in ids.values())
    assert second[0][1] == sorted(ids_by_call[0]) and third[0][1] == sorted(ids_by_call[1])
    finished = [rid for _, fin, _, _ in steps for rid in fin]
    assert len(finished) == len(set(finished)) >= 2
    for i, (_, fin, _, _) in enumerate(steps):
        for rid in fin:
            assert any(rid in ids for ids, _, _, _ in steps[:i])
            assert all(rid not in ids for ids, _, _, _ in steps[i:])
    # Free the 1 GiB KV cache now, not whenever the engine's reference cycles are collected:
    # other engine tests run in this process after this one.
    llm = engine = worker = None  # type: ignore[assignment]
    gc.collect()


def test_tensor_parallel_2_matches_transformers(expected: dict[str, list[int]]) -> None:
    """TP 2 on the stand-in: the card's multiprocessing executor with two CPU ranks (gloo)
    shards the tiny Qwen2 (one kv head per rank) and still gives Hugging Face's tokens."""
    prompts = _prompts()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("standin_tp2_run.py")),
            str(MODEL_DIR),
            json.dumps(prompts),
            str(CHUNK),
            str(NEW_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1])
    assert result["executor"] == "StandinMPExecutor" and result["tp"] == 2
    assert result["one_by_one"] == expected
    assert result["batched"] == expected


def test_swap_preemption_matches_transformers() -> None:
    """Too few KV blocks for four requests: the scheduler swaps sequences out to the CPU cache
    and back in (the worker's cache operations, our backend's ``swap_blocks``), as on the card
    under memory pressure, and every request still gets Hugging Face's tokens."""
    from vllm import LLM, SamplingParams

    tiny.build(MODEL_DIR)
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(2, tiny.VOCAB) for _ in range(60)] for i in range(4)}
    new_tokens = 40  # 100 tokens = 7 blocks a request; 16 blocks hold two of them
    expected = _hf_greedy(MODEL_DIR, prompts, new_tokens)
    llm = LLM(
        model=str(MODEL_DIR),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        enable_prefix_caching=True,
        block_size=BLOCK,
        max_model_len=160,
        swap_space=0.05,
        num_gpu_blocks_override=16,
        preemption_mode="swap",
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False
    )
    assert llm.llm_engine.scheduler[0].num_cumulative_preemption > 0
    got = {n: list(o.outputs[0].token_ids) for n, o in zip(prompts, outs, strict=True)}
    assert got == expected
