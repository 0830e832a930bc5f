"""Fixtures for the admission suite: the platform's functional checks, one test per behaviour.

``server`` (tests/conftest.py) is the main server. ``small_server`` is a second local server with
a 4,096-token context, ``--max-num-seqs 1`` and an API key, for the checks that need a full
context, a scheduler that holds one sequence, or authentication; against ``VLLM_BASE_URL`` it is
the main server (and the key checks need ``VLLM_API_KEY``), unless ``VLLM_SMALL_BASE_URL`` (and
``VLLM_SMALL_API_KEY``) name a small server of your own.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.serverlib import REPO_DIR, Server, start_local_server, stop_process_group, wait_healthy

SMALL_CONTEXT = 4096
SMALL_KEY = "admission-test-key"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="session")
def small_server(server: Server) -> Iterator[Server]:
    if small_url := os.environ.get("VLLM_SMALL_BASE_URL"):  # a small server of your own
        srv = Server(small_url.rstrip("/"), server.model, os.environ.get("VLLM_SMALL_API_KEY"))
        with srv.client() as c:
            models = c.get("/v1/models").json()["data"]
        srv.max_model_len = int(models[0]["max_model_len"])
        yield srv
        return
    if os.environ.get("VLLM_BASE_URL"):
        yield server
        return
    log_path = REPO_DIR / "build" / "test-small-server.log"
    proc, base_url = start_local_server(
        log_path,
        ["--max-num-seqs", "1", "--api-key", SMALL_KEY],
        launcher_args=["--max-model-len", str(SMALL_CONTEXT)],
    )
    try:
        wait_healthy(base_url, proc, log_path)
        yield Server(base_url, server.model, SMALL_KEY, log_path, SMALL_CONTEXT)
    finally:
        stop_process_group(proc)


def png_data_url(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(srv: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    with srv.client() as c:
        return c.post(path, json=body, **kw)


def chat(
    srv: Server, messages: list[dict[str, Any]] | None = None, **fields: Any
) -> httpx.Response:
    body = {"model": srv.model, "messages": messages or [{"role": "user", "content": "Hi!"}]}
    return post(srv, "/v1/chat/completions", {**body, **fields})


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def assert_openai_error(resp: httpx.Response, *statuses: int) -> dict[str, Any]:
    assert resp.status_code in (statuses or (400, 422)), (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    return err


def stream_events(srv: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """All data events of a streamed answer; asserts it ends with [DONE]."""
    with srv.client() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read().decode()[:300]
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def tokenize_len(srv: Server, text: str) -> int:
    r = post(srv, "/tokenize", {"model": srv.model, "prompt": text, "add_special_tokens": False})
    return int(ok(r)["count"])


def prompt_of(srv: Server, tokens: int) -> str:
    """Plain text of exactly ``tokens`` tokens (checked with the server's own tokenizer)."""
    text = " hello" * tokens
    assert tokenize_len(srv, text) == tokens
    return text


# ``ADMISSION_JUDGE_CONTENT=1``: the model under test is a real one (see content_criterion).
JUDGE_CONTENT = os.environ.get("ADMISSION_JUDGE_CONTENT") == "1"


def content_criterion(check: str, met: bool, detail: str) -> None:
    """The part of a platform check that judges what the model wrote (the answer names Alice,
    echoes a marker, closes its tool-call arguments, ends its story with a stop).

    A random-weight model cannot meet it by construction, so unless ``ADMISSION_JUDGE_CONTENT=1``
    a miss marks the test ``xfail`` with the check and the reason (visible in every report);
    with a real model a miss fails. Call it only after the check's protocol part (status, shape,
    finish_reason) has been asserted."""
    if met:
        return
    if JUDGE_CONTENT:
        pytest.fail(f"{check}: {detail}")
    pytest.xfail(f"{check} judges the answer's content; random weights cannot meet it: {detail}")


def default_max_tokens() -> int | None:
    """The server's default output budget when it is ours (set by tests/conftest.py)."""
    if os.environ.get("VLLM_BASE_URL"):
        return None
    return int(os.environ.get("VLLM_OVERRIDES_DEFAULT_MAX_TOKENS", "0")) or None


__all__ = ["Path"]
