"""Reasoning: on by default and separated from the content; every "off" switch turns it off."""

from __future__ import annotations

import pytest

from tests.admission.conftest import assert_openai_error, chat, ok, stream_events

pytestmark = pytest.mark.server


def test_thinking_is_on_by_default_and_returned_as_reasoning_content(server) -> None:
    message = ok(chat(server, max_tokens=16))["choices"][0]["message"]
    # The tiny random model never closes </think>, so all 16 tokens are reasoning.
    assert message["reasoning_content"]
    assert message["reasoning_content"] == message["reasoning"]


def test_streamed_reasoning_carries_reasoning_content(server) -> None:
    events = stream_events(
        server,
        "/v1/chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "Why?"}],
         "max_tokens": 8, "stream": True},
    )  # fmt: skip
    deltas = [c["delta"] for e in events for c in e["choices"] if c.get("delta")]
    pieces = [d["reasoning_content"] for d in deltas if "reasoning" in d]
    assert pieces and all(
        d["reasoning_content"] == d["reasoning"] for d in deltas if "reasoning" in d
    )


@pytest.mark.parametrize(
    "switch",
    [
        {"thinking": {"type": "disabled"}},
        {"thinking": False},
        {"enable_thinking": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ],
    ids=[
        "thinking-disabled",
        "thinking-false",
        "enable_thinking",
        "chat_template_kwargs",
        "effort-none",
    ],
)
def test_thinking_off_gives_content_only(server, switch) -> None:
    body = ok(chat(server, max_tokens=16, **switch))
    message = body["choices"][0]["message"]
    assert not message.get("reasoning") and not message.get("reasoning_content")
    assert message["content"]
    assert body["usage"]["completion_tokens"] == 16


def test_thinking_on_explicitly(server) -> None:
    message = ok(chat(server, max_tokens=8, thinking={"type": "enabled"}))["choices"][0]["message"]
    assert message["reasoning_content"]


def test_malformed_thinking_is_a_clear_400(server) -> None:
    err = assert_openai_error(chat(server, thinking="maybe"), 400)
    assert "thinking" in err["message"]
