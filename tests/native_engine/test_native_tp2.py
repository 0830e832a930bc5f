"""Tensor parallelism on the native paths: the engine at ``-tp 2`` (two CPU workers, one
core each) with every native switch on, float32, against the same transformers oracle as the
TP1 checks -- so TP2 and TP1 agree token for token through it.

Per rank at TP2 the tiny model has 1 key head / 2 value heads per GDN layer and half of each
expert's intermediate size; the native MoE adds the shared expert and all-reduces once. The
check also proves the native MoE really runs at TP > 1 (vLLM's EP *group* spans the TP ranks,
which once made the native block fall back to upstream there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.native_engine.enginelib import (
    NATIVE_ON,
    check_same_tokens,
    engine_server,
    greedy,
    greedy_many,
)
from tests.serverlib import REPO_DIR

pytestmark = pytest.mark.server
LOG = REPO_DIR / "build" / "native-engine-fp32-tp2.log"


def _thread_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers on this machine's allowed cores
    (vLLM binds by NUMA node otherwise and refuses two workers on one node)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        pytest.fail(f"TP{ranks} needs {ranks} cores, this machine allows {len(cores)}")
    per = len(cores) // ranks
    parts = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(map(str, p)) for p in parts)


@pytest.fixture(scope="module")
def url(oracle: dict[str, Any]) -> Iterator[str]:
    env = {**NATIVE_ON, "VLLM_CPU_OMP_THREADS_BIND": _thread_binding(2)}
    with engine_server(LOG, env, ["--dtype", "float32"], ["--tp", "2"]) as u:
        yield u


@pytest.mark.parametrize("name", ["len500", "len2000"])
def test_tp2_greedy_matches_hf(url: str, oracle: dict[str, Any], name: str) -> None:
    want = oracle[name]
    got = greedy(url, want["prompt"])
    check_same_tokens(f"tp2 {name}", got, want)
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst < 1e-3, f"tp2 {name}: max chosen-token logprob difference {worst:.3g}"


def test_tp2_prefix_hit_and_batch_match_hf(url: str, oracle: dict[str, Any]) -> None:
    want = oracle["prefix_hit"]
    check_same_tokens("tp2 prefix_hit (first)", greedy(url, want["prompt"]), want)
    got = greedy(url, want["prompt"])
    assert (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"), got["usage"]
    check_same_tokens("tp2 prefix_hit (cached)", got, want)
    names = [f"batch{i}" for i in range(4)]
    for name, res in zip(
        names, greedy_many(url, [oracle[n]["prompt"] for n in names]), strict=True
    ):
        check_same_tokens(f"tp2 {name}", res, oracle[name])


def test_tp2_native_paths_on_both_ranks(url: str, oracle: dict[str, Any]) -> None:
    greedy(url, oracle["len20"]["prompt"], max_tokens=4)
    text = LOG.read_text(errors="replace")
    assert "upstream MoE kernels kept" not in text, "native MoE fell back to upstream at TP2"
    for rank in ("Worker_TP0", "Worker_TP1"):
        lines = [ln for ln in text.splitlines() if rank in ln and "native paths in use" in ln]
        used = " ".join(lines)
        for key in ("gdn_core", "moe_decode_native", "gemma_rms_norm"):
            assert key in used, f"{rank}: {key} not reported: {lines}"
    assert "Traceback" not in text
