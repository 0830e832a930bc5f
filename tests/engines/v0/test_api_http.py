"""The whole V0 API layer over HTTP: vLLM 0.6.3's ``api_server`` with patch 0010 applied (to a
copy, loaded as its own module), our middleware and serving classes, a scripted engine stub."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.openai.api_server")

from tests.engines.v0.api_fakes import (  # noqa: E402
    TEMPLATE,
    FakeEngine,
    make_tokenizer,
    patched_module,
)


@pytest.fixture(scope="module")
def api_server() -> Any:
    return patched_module("0010-api-server-install-v0-api.patch", "vo_patched_api_server")


def serve(
    api_server: Any, engine: FakeEngine, max_model_len: int = 4096, extra: tuple[str, ...] = ()
) -> Any:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", "llm", "--served-model-name", "llm", "--chat-template", str(TEMPLATE),
         "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", *extra]
    )  # fmt: skip
    app = api_server.build_app(args)
    model_config = SimpleNamespace(
        max_model_len=max_model_len, multimodal_config=None, embedding_mode=False,
        hf_config=SimpleNamespace(model_type="qwen3_5_moe"),
    )  # fmt: skip
    api_server.init_app_state(engine, model_config, app.state, args)
    return app


def post(app: Any, path: str, body: Any) -> Any:
    import httpx

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if isinstance(body, (bytes, str)):
                return await client.post(path, content=body)
            return await client.post(path, json=body)

    return asyncio.run(go())


USER = [{"role": "user", "content": "hi"}]


def test_agent_body_is_served_with_reasoning_and_the_version_header(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "hm</think>\n\nok", 4, "stop")]])
    app = serve(api_server, engine)
    body = {"model": "llm", "messages": USER, "max_completion_tokens": 32,
            "reasoning_effort": "medium", "store": False}  # fmt: skip
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers["x-vllm-overrides-version"]
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hm", "ok")
    assert engine.params[0].max_tokens == 32


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 4097}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1.1}, "top_p"),
        ({"thinking": "maybe"}, "thinking"),
    ],
)
def test_bad_input_is_an_openai_400_before_the_engine(api_server, body, param) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x", 1, "stop")]])
    response = post(serve(api_server, engine), "/v1/chat/completions",
                     {"model": "llm", "messages": USER, **body})  # fmt: skip
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert engine.prompts == []


@pytest.mark.parametrize("raw", [b"[]", b"{not json", b'"text"'])
def test_non_object_bodies_are_400(api_server, raw) -> None:
    engine = FakeEngine(make_tokenizer(), [])
    response = post(serve(api_server, engine), "/v1/chat/completions", raw)
    assert response.status_code == 400 and "error" in response.json()


def test_stream_with_usage_and_done(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "a", 1, None)], [(0, "b", 1, "length")]])
    body = {"model": "llm", "messages": USER, "stream": True, "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False},
            "stream_options": {"include_usage": True}}  # fmt: skip
    response = post(serve(api_server, engine), "/v1/chat/completions", body)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c.get("usage") for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]) == "ab"


def test_budget_equal_to_the_context_is_fitted_not_refused(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "a", 1, "length")]])
    response = post(serve(api_server, engine, max_model_len=256), "/v1/chat/completions",
                    {"model": "llm", "messages": USER, "max_tokens": 256})  # fmt: skip
    assert response.status_code == 200, response.text
    assert engine.params[0].max_tokens == 256 - len(engine.prompts[0])


def test_an_image_for_a_text_only_model_is_a_400_not_an_engine_death(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x", 1, "stop")]])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    app = serve(api_server, engine)
    for path, body in (("/v1/chat/completions", {"model": "llm", "messages": messages}),
                       ("/tokenize", {"model": "llm", "messages": messages})):  # fmt: skip
        response = post(app, path, body)
        assert response.status_code == 400, response.text
        assert "messages[0].content[1]" in response.text
    assert engine.prompts == []


def test_tokenize_refuses_a_remote_image_unfetched(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [])
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    body = {"model": "llm", "messages": [{"role": "user", "content": [image]}]}
    response = post(serve(api_server, engine), "/tokenize", body)
    assert response.status_code == 400 and "error" in response.json()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "other", "messages": USER}, 404),  # vLLM's own unknown-model answer
        ({"model": "llm", "messages": USER, "temperature": "hot"}, 400),  # its validation
        ({"model": "llm", "messages": USER, "top_p": 0}, 400),  # its SamplingParams check
    ],
)
def test_vllms_own_errors_get_openais_error_body(api_server, body, status) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x", 1, "stop")]])
    response = post(serve(api_server, engine), "/v1/chat/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["code"] == status
    assert int(response.headers["content-length"]) == len(response.content)


def test_more_choices_than_the_scheduler_runs_are_served_one_by_one(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x", 1, "length")]])
    app = serve(api_server, engine, extra=("--max-num-seqs", "1"))
    body = {"model": "llm", "messages": USER, "n": 2, "seed": 5, "max_tokens": 1}
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
    # two one-sequence requests (0.6.3 never admits a two-sequence group on one slot)
    assert [(p.n, p.seed) for p in engine.params] == [(1, 5), (1, 6)]
    assert response.json()["usage"]["completion_tokens"] == 2
    stream = post(app, "/v1/chat/completions", {**body, "stream": True})
    indices = {c["index"] for e in stream.text.split("\n\n") if e.startswith("data: {")
               for c in json.loads(e[6:])["choices"]}  # fmt: skip
    assert indices == {0, 1}


def test_best_of_wider_than_the_scheduler_is_a_400(api_server) -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x", 1, "stop")]])
    app = serve(api_server, engine, extra=("--max-num-seqs", "1"))
    body = {"model": "llm", "prompt": "hi", "best_of": 2, "max_tokens": 1}
    response = post(app, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
    assert engine.prompts == []
