"""Patch 0008: a new request's system block end becomes its shared-prefix junction, so vLLM's
align-mode scheduler stops a chunk there and keeps the GDN state for the next session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_overrides import prefix_junction as pj

END = 7  # stands for <|im_end|>


def _sched(block: int = 16, align: bool = True) -> SimpleNamespace:
    s = SimpleNamespace(
        need_mamba_block_aligned_split=align, cache_config=SimpleNamespace(block_size=block)
    )
    s._vo_im_end_id = END  # what _end_token_id caches after the tokenizer lookup
    return s


def _req(prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt, num_prompt_tokens=len(prompt))


PROMPT = [1] * 99 + [END] + [2] * 100  # system block ends after token 100


def test_system_block_end_becomes_the_junction() -> None:
    assert pj.system_junction(_sched(), _req(PROMPT), 0, 0) == 100


@pytest.mark.parametrize(
    ("cached", "found", "prompt", "block", "align", "want"),
    [
        (0, 64, PROMPT, 16, True, 64),  # vLLM's own junction wins
        (96, 0, PROMPT, 16, True, 0),  # the cache already covers the block-floored end (96)
        (80, 0, PROMPT, 16, True, 100),  # ... not yet: 96 > 80
        (0, 0, [1] * 200, 16, True, 0),  # no message end at all
        (0, 0, [1] * 99 + [END] + [2] * 10, 16, True, 0),  # end within a block of the prompt's
        (0, 0, PROMPT, 128, True, 0),  # less than one block in: nothing cacheable
        (0, 0, PROMPT, 16, False, 0),  # no mamba align mode: nothing to do
    ],
)
def test_when_it_stays_out(
    cached: int, found: int, prompt: list[int], block: int, align: bool, want: int
) -> None:
    assert pj.system_junction(_sched(block, align), _req(prompt), cached, found) == want


def test_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pj, "ENABLED", False)
    assert pj.system_junction(_sched(), _req(PROMPT), 0, 0) == 0


def test_end_token_of_the_real_tokenizer() -> None:
    """The tiny model ships the real Qwen3.5 tokenizer: <|im_end|> resolves to its id."""
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "build" / "tiny-model"
    if not (model / "tokenizer_config.json").exists():
        pytest.skip("tiny model not built (make model)")
    sched = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(
                tokenizer=str(model), tokenizer_revision=None, trust_remote_code=False
            )
        )
    )
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("<|im_end|>")
    assert pj._end_token_id(sched) == want > 0
    assert sched._vo_im_end_id == want


def test_split_aligns_to_the_kv_block_size_not_a_stale_config() -> None:
    """Patch 0009: in the multiprocess engine the scheduler's cache_config.block_size still holds
    the platform default (128 on CPU) while the KV groups use 256; chunk ends must follow the
    KV block size or the GDN states written there are never cached."""
    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=128), block_size=256)
    assert pj.split_block_size(sched) == 256
    sched.cache_config.block_size = 256
    assert pj.split_block_size(sched) == 256


@pytest.mark.slow
def test_vllm_scheduler_splits_at_kv_blocks_and_keeps_the_system_state() -> None:
    """vLLM's own scheduler (patched), a stale cache_config.block_size of 128 and KV groups of
    256 as in the server's engine core: the first request's chunks end on 256-token blocks and
    stop at the system block's end, and the second request (same system block) is served from
    the state kept there."""
    import sys
    from pathlib import Path

    import numpy as np

    repo = Path(__file__).resolve().parents[2]
    if not (repo / "build" / "tiny-model" / "config.json").exists():
        pytest.skip("tiny model not built (make model)")
    sys.path.insert(0, str(repo / "worklogs"))
    import cache_sim

    sim = cache_sim.SimConfig(8192, 1.0, None, True, 0, 1, 2, "tiny-cpu")
    scheduler, info = cache_sim.build_scheduler(sim, 1)
    scheduler.cache_config.block_size = 128  # what the engine core process holds
    rng = np.random.default_rng(0)
    end = 248046  # <|im_end|> of the real tokenizer (test_end_token_of_the_real_tokenizer)
    scheduler._vo_im_end_id = end
    system = [int(x) for x in rng.integers(1000, 100000, 3000)] + [end]
    reqs = [
        {"id": f"r{i}", "meta": {"session_id": f"s{i}"},
         "ids": np.array(system + [int(x) for x in rng.integers(1000, 100000, 2000)])}
        for i in range(2)
    ]  # fmt: skip
    out = cache_sim.simulate(sim, reqs, [0, 3001], built=(scheduler, info))
    cached = [r["cached_tokens"] for r in out["records"]]
    # 3,001 tokens of system block -> the state at 2,816 (11 blocks of 256) serves request 2.
    assert cached == [0, 2816], out["records"]
