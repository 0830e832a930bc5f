"""Chat basics: plain and streamed answers, usage, prefix-cache accounting."""

from __future__ import annotations

import pytest

from tests.admission.conftest import chat, ok, stream_events

pytestmark = pytest.mark.server


def test_non_streaming_answer_with_the_openai_client(server) -> None:
    resp = server.openai().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=16
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_ends_with_a_usage_chunk_and_done(server) -> None:
    events = stream_events(
        server,
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": [{"role": "user", "content": "Stream please"}],
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]


def test_prompt_tokens_details_reports_cached_tokens(server) -> None:
    body = ok(chat(server, max_tokens=1))
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_second_identical_prompt_is_served_from_the_prefix_cache(server) -> None:
    # ~311 prompt tokens, like the platform's check; unique text so that no earlier test cached it.
    # (vLLM 0.32's "align" mamba cache mode saves the state at the last block boundary on the
    # first request only when the prompt's tail past it is short; on this CPU build with 256-token
    # blocks a 328-token prompt hits on the second request, a 717-token one only on the third.)
    messages = [{"role": "user", "content": "Prefix cache check 7731:" + " hello" * 295}]
    first = ok(chat(server, messages, max_tokens=2))
    second = ok(chat(server, messages, max_tokens=2))
    assert 300 <= first["usage"]["prompt_tokens"] <= 330
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
