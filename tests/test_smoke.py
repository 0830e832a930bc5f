"""The walking skeleton over HTTP: chat (plain and streamed), completions, models, our hook."""

from __future__ import annotations

import json

import pytest

from vllm_overrides import __version__

pytestmark = pytest.mark.server


def test_models_lists_llm(server) -> None:
    with server.client() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    ids = [m["id"] for m in r.json()["data"]]
    assert server.model in ids


def test_every_response_carries_the_overlay_version(server) -> None:
    """Patch 0001 installed our compat layer: visible on success, error and unknown routes."""
    with server.client() as c:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/nope")):
            r = c.request(method, path)
            assert r.headers.get("x-vllm-overrides-version") == __version__, (method, path)


def test_chat_non_streaming_with_openai_client(server) -> None:
    resp = server.openai().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
    )
    assert resp.object == "chat.completion"
    assert len(resp.choices) == 1
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0
    assert 0 < resp.usage.completion_tokens <= 8


def test_chat_streaming_ends_with_usage_and_done(server) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Count to three."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 8
    assert any(ch["choices"] and ch["choices"][0].get("finish_reason") for ch in chunks)


def test_completions(server) -> None:
    resp = server.openai().completions.create(model=server.model, prompt="Once upon", max_tokens=5)
    assert resp.object == "text_completion"
    assert resp.usage.completion_tokens == 5 or resp.choices[0].finish_reason == "stop"
    assert isinstance(resp.choices[0].text, str)
