"""Bodies that break parsing or a model validator are OpenAI-style 400s; handler bugs stay 500s.

A real FastAPI app with a pydantic "before" validator written like vLLM's
(``check_structured_outputs_count`` calls ``.get`` on whatever the client sent), behind our
``CompatMiddleware`` and starlette's error middleware, as in the server.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, model_validator

from vllm_overrides.engines.v1_0_32.api_compat import CompatMiddleware


class Request(BaseModel):
    prompt: str
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def count(cls, data: Any) -> Any:
        so = data.get("structured_outputs")
        if so is not None:
            sum(so.get(k) is not None for k in ("json", "regex"))  # AttributeError on a str
        return data


def _client() -> TestClient:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        if request.prompt == "handler bug":
            raise AttributeError("a bug in the server, not in the request")
        return {"ok": request.prompt}

    app.add_middleware(CompatMiddleware)
    return TestClient(app, raise_server_exceptions=False)


def test_validator_crash_on_a_malformed_body_is_a_400() -> None:
    r = _client().post("/v1/completions", json={"prompt": "x", "structured_outputs": "oops"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"].startswith("invalid request body (AttributeError: ")
    assert r.headers["x-vllm-overrides-version"]


def test_valid_body_passes() -> None:
    r = _client().post("/v1/completions", json={"prompt": "x", "structured_outputs": {"json": 1}})
    assert r.status_code == 200 and r.json() == {"ok": "x"}


def test_a_handler_bug_stays_a_server_error() -> None:
    r = _client().post("/v1/completions", json={"prompt": "handler bug"})
    assert r.status_code == 500


@pytest.mark.parametrize(
    "raw, why",
    [
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
        (b'{"prompt": "x",', "Expecting property name"),
    ],
    ids=["deep-nesting", "huge-integer", "truncated"],
)
def test_bodies_that_are_not_json_are_openai_400s(raw: bytes, why: str) -> None:
    r = _client().post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("request body is not valid JSON (") and why in message, message
