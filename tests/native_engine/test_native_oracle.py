"""The engine on our native kernels against an independent oracle (one server start).

The tiny random Qwen3.5-MoE runs in float32 with every native switch on (GDN_NATIVE,
MOE_NATIVE, RMSNORM_NATIVE; upstream's CPU GDN kernel is bf16-only, so float32 needs the native
path), and its greedy continuations must be token-identical to Hugging Face transformers' own
Qwen3.5-MoE forward pass in float32 on the same weights: 64 tokens after prompts of 20, 500 and
2,000 tokens, a prompt that hits the prefix cache, and four concurrent requests. The oracle
runs in this process before the server starts (cached in build/ by the tiny model's build hash).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.native_engine.enginelib import (
    NATIVE_ON,
    engine_server,
    greedy,
    greedy_many,
)
from tests.native_engine.enginelib import (
    check_same_tokens as _check,
)
from tests.serverlib import REPO_DIR

pytestmark = pytest.mark.server
LOG = REPO_DIR / "build" / "native-engine-fp32.log"


@pytest.fixture(scope="module")
def url(oracle: dict[str, Any]) -> Iterator[str]:  # oracle first: no CPU contention
    with engine_server(LOG, NATIVE_ON, ["--dtype", "float32"]) as u:
        yield u


@pytest.mark.parametrize("name", ["len20", "len500", "len2000"])
def test_greedy_matches_hf(url: str, oracle: dict[str, Any], name: str) -> None:
    want = oracle[name]
    got = greedy(url, want["prompt"])
    _check(name, got, want)
    # Logprobs of the chosen tokens agree closely too (same math, float32, different kernels).
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst < 1e-3, f"{name}: max chosen-token logprob difference {worst:.3g}"


def test_prefix_cache_hit_matches_hf(url: str, oracle: dict[str, Any]) -> None:
    # Shares its first 1,000 tokens with len2000; vLLM's "align" mamba cache mode saves the
    # state at a block boundary, so the repeat is served from the cache (1,280 tokens here).
    want = oracle["prefix_hit"]
    first = greedy(url, want["prompt"])
    _check("prefix_hit (first)", first, want)
    got = greedy(url, want["prompt"])
    cached = (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached > 0, f"no prefix-cache hit: {got['usage']}"
    _check("prefix_hit (cached)", got, want)


def test_checkpoint_cache_hit_is_greedy_identical(url: str, oracle: dict[str, Any]) -> None:
    """Patch 0007: the next turn resumes from the GDN state the previous prompt's final chunk
    exported at its last full block (1,280 of 1,400 tokens at block 256, no chunk split), and
    its greedy output is token-identical to the same request served without any cache hit
    (a ``cache_salt`` of its own keeps that one cold)."""
    material = list(reversed(oracle["len2000"]["prompt"]))  # shares no prefix with the others
    first, turn2 = material[:1400], material[:1900]
    cold = greedy(url, turn2, cache_salt="cold-checkpoint-test")
    assert (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    greedy(url, first, max_tokens=4)
    warm = greedy(url, turn2)
    cached = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached == 1280, f"expected a hit at the checkpoint (1,280 tokens): {warm['usage']}"
    assert warm["tokens"] == cold["tokens"], (warm["tokens"], cold["tokens"])
    worst = max(abs(a - b) for a, b in zip(warm["logprobs"], cold["logprobs"], strict=True))
    assert worst < 1e-3, f"max chosen-token logprob difference {worst:.3g}"
    text = LOG.read_text(errors="replace")
    used = " ".join(ln for ln in text.splitlines() if "native paths in use" in ln)
    assert "gdn_prefill_checkpoint" in used, "the native prefill never exported a checkpoint"


def test_concurrent_batch_matches_hf(url: str, oracle: dict[str, Any]) -> None:
    names = [f"batch{i}" for i in range(4)]
    results = greedy_many(url, [oracle[n]["prompt"] for n in names])
    for name, got in zip(names, results, strict=True):
        _check(name, got, oracle[name])


def test_native_paths_were_used(url: str, oracle: dict[str, Any]) -> None:
    greedy(url, oracle["len20"]["prompt"], max_tokens=4)
    text = LOG.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "vllm_overrides native paths in use" in ln]
    assert lines, "the native engine never reported its paths"
    used = " ".join(lines)
    for key in ("gdn_core", "rms_norm_gated", "gemma_rms_norm", "moe_prefill_native"):
        assert key in used, f"{key} not reported as used: {lines}"
    assert "moe_decode_native" in used, lines
    assert "Traceback" not in text
