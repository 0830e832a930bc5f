"""The shared think split (vllm_overrides/reasoning.py): whole answers and streamed deltas."""

from __future__ import annotations

import pytest

from vllm_overrides.reasoning import ThinkSplitter, prompt_opens_reasoning, split_reasoning

OPEN, CLOSE = 10, 11


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([1, OPEN], True),
        ([1, OPEN, 2, CLOSE, 3], False),
        ([OPEN, CLOSE, 5, OPEN, 6], True),
        ([1, 2], False),
    ],
)
def test_prompt_opens_reasoning_reads_the_last_marker(ids, expected) -> None:
    assert prompt_opens_reasoning(ids, OPEN, CLOSE) is expected


@pytest.mark.parametrize(
    ("text", "in_reasoning", "expected"),
    [
        ("why</think>\n\nanswer", True, ("why", "answer")),
        ("still thinking", True, ("still thinking", None)),
        ("plain answer", False, (None, "plain answer")),
        ("<think>hm</think>ok", False, ("hm", "ok")),
        ("  <think>hm</think>\n\nok", False, ("hm", "ok")),
        ("a <think> in the text", False, (None, "a <think> in the text")),
        ("</think>\n\nonly content", True, (None, "only content")),
    ],
)
def test_split_whole_answers(text, in_reasoning, expected) -> None:
    assert split_reasoning(text, in_reasoning) == expected


@pytest.mark.parametrize("cut", range(1, 30))
def test_streamed_deltas_give_the_whole_answer_split(cut) -> None:
    text = "<think>step one</think>\n\nThe answer </th is this."
    splitter = ThinkSplitter(False)
    reasoning = content = ""
    for piece in (text[:cut], text[cut:]):
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r, content + c) == ("step one", "The answer </th is this.")


def test_a_partial_close_marker_is_held_until_decided() -> None:
    splitter = ThinkSplitter(True)
    assert splitter.feed("abc</thi") == ("abc", "")
    assert splitter.feed("nk>rest") == ("", "rest")
    splitter = ThinkSplitter(True)
    assert splitter.feed("abc</thi") == ("abc", "")
    assert splitter.flush() == ("</thi", "")  # the stream ended: it was reasoning after all
