"""response_compat: reasoning_content mirrors reasoning, in whole answers and in streams."""

from __future__ import annotations

import json

from vllm_overrides.response_compat import SSEReasoningMirror, add_reasoning_content


def test_whole_answer_gets_reasoning_content() -> None:
    body = {"choices": [{"message": {"content": "4", "reasoning": "2+2"}}, {"message": {}}]}
    out = json.loads(add_reasoning_content(json.dumps(body).encode()))
    assert out["choices"][0]["message"]["reasoning_content"] == "2+2"
    assert out["choices"][0]["message"]["reasoning"] == "2+2"
    assert "reasoning_content" not in out["choices"][1]["message"]


def test_answers_without_reasoning_are_untouched() -> None:
    raw = b'{"choices": [{"message": {"content": "x"}}]}'
    assert add_reasoning_content(raw) == raw
    assert add_reasoning_content(b"not json") == b"not json"


def test_stream_split_anywhere_is_rewritten_event_by_event() -> None:
    events = [
        {"choices": [{"delta": {"reasoning": "th"}}]},
        {"choices": [{"delta": {"content": "ok"}}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    stream += b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        mirror = SSEReasoningMirror()
        out = mirror.feed(stream[:cut]) + mirror.feed(stream[cut:]) + mirror.flush()
        parts = [p for p in out.split(b"\n\n") if p]
        assert parts[-1] == b"data: [DONE]"
        decoded = [json.loads(p[len(b"data: ") :]) for p in parts[:-1]]
        assert decoded[0]["choices"][0]["delta"]["reasoning_content"] == "th"
        assert decoded[1:] == events[1:]
