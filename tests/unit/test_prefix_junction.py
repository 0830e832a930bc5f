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
