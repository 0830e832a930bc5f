"""Structured output, stop strings, and API keys."""

from __future__ import annotations

import json

import pytest

from tests.admission.conftest import chat, ok, post

pytestmark = pytest.mark.server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_json_object(server) -> None:
    """The JSON grammar holds. A random-weight model fills free-form strings without end, so a
    run that hits max_tokens is checked as the grammar's prefix; one that stops must parse."""
    body = ok(chat(server, response_format={"type": "json_object"}, max_tokens=200, seed=3,
                   temperature=0, **NO_THINK))  # fmt: skip
    choice = body["choices"][0]
    content = choice["message"]["content"]
    assert content.lstrip().startswith("{")  # 1 in 248,320 by chance without the grammar
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert body["usage"]["completion_tokens"] == 200


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}
# Every answer the schema allows, written compactly (keys in either order).
COMPACT_ANSWERS = [
    json.dumps(dict(pair), separators=(",", ":"))
    for ok_value in (True, False)
    for colour in ("red", "green")
    for pair in ([("ok", ok_value), ("colour", colour)], [("colour", colour), ("ok", ok_value)])
]


def _check_schema_answer(content: str) -> None:
    answer = json.loads(content)
    assert set(answer) == {"ok", "colour"}
    assert isinstance(answer["ok"], bool) and answer["colour"] in ("red", "green")


def test_json_schema(server) -> None:
    """``response_format: json_schema`` (the platform's form). The grammar allows whitespace
    between tokens, and a random-weight model may spend its whole budget on it: a run that hits
    max_tokens must then be, whitespace aside, the prefix of an answer the schema allows."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    body = ok(chat(server, response_format=fmt, max_tokens=64, temperature=0, **NO_THINK))
    choice = body["choices"][0]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        _check_schema_answer(content)
    else:
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 64
        compact = "".join(content.split())
        assert compact and any(a.startswith(compact) for a in COMPACT_ANSWERS), content


def test_stop_string_is_honoured(server) -> None:
    req = {"model": server.model, "prompt": "The list:", "max_tokens": 24, "temperature": 0}
    free = ok(post(server, "/v1/completions", req))["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {free!r}"
    cut = ok(post(server, "/v1/completions", {**req, "stop": [stop]}))["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert stop not in cut["text"] and free.startswith(cut["text"])


def _key_server(server, small_server):
    if small_server.api_key:
        return small_server
    pytest.skip("the server under test has no API key (VLLM_API_KEY unset)")


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(server, small_server, key) -> None:
    srv = _key_server(server, small_server)
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 401
    assert resp.json()["error"]


def test_right_api_key_is_served(server, small_server) -> None:
    srv = _key_server(server, small_server)
    assert ok(chat(srv, max_tokens=1))["usage"]["completion_tokens"] == 1


def test_platform_yaml_has_keys_off() -> None:
    from vllm_overrides.launcher import get_flag, load_run_config

    assert get_flag(load_run_config().command, "--api-key") is None
    assert "VLLM_API_KEY" not in load_run_config().env
