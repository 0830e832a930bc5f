"""A prompt the engine can never schedule is a 400 with an OpenAI error body, on both endpoints,
streamed or not; a prompt that fits is still served.

vLLM 0.6.3's scheduler marks such a prompt ``FINISHED_IGNORED`` (its block manager answers
``NEVER``: more blocks than the pool less the 1 % watermark) and the engine returns it finished
with no token, which 0.6.3's server turned into a 200 with an empty completion. The scripted
engine here returns exactly that output (finish ``length``, no token).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.openai.serving_chat")

from tests.engines.v0.api_fakes import FakeEngine, make_chat, make_tokenizer  # noqa: E402
from tests.engines.v0.test_api_serving import RawRequest  # noqa: E402

IGNORED = [[(0, "", 0, "length")]]
SERVED = [[(0, "Hello there", 2, "stop")]]
USER = [{"role": "user", "content": "hi"}]


def make_completion(engine: FakeEngine) -> Any:
    from vllm.entrypoints.openai.serving_engine import BaseModelPath

    from vllm_overrides.engines.v0.serving import V0ServingCompletion

    model_config = SimpleNamespace(max_model_len=4096, multimodal_config=None,
                                   hf_config=SimpleNamespace(model_type="qwen3_5_moe"))  # fmt: skip
    return V0ServingCompletion(engine, model_config, [BaseModelPath(name="llm", model_path="llm")],
                               lora_modules=None, prompt_adapters=None, request_logger=None)  # fmt: skip


def call(kind: str, script: list, stream: bool) -> Any:
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    engine = FakeEngine(make_tokenizer(), script)
    if kind == "chat":
        serving = make_chat(engine)
        request = ChatCompletionRequest(model="llm", messages=USER, stream=stream)
        coro = serving.create_chat_completion(request, RawRequest())
    else:
        serving = make_completion(engine)
        request = CompletionRequest(model="llm", prompt="hi", stream=stream, max_tokens=8)
        coro = serving.create_completion(request, RawRequest())

    async def go() -> Any:
        result = await coro
        if hasattr(result, "__aiter__"):
            return [event async for event in result]
        return result

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_never_schedulable_prompt_is_a_400(kind: str, stream: bool) -> None:
    from vllm.entrypoints.openai.protocol import ErrorResponse

    result = call(kind, IGNORED, stream)
    assert isinstance(result, ErrorResponse), result
    assert result.code == 400 and result.type == "BadRequestError"
    assert "can never be scheduled" in result.message and "KV-cache blocks" in result.message


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_fits_is_served(kind: str, stream: bool) -> None:
    result = call(kind, SERVED, stream)
    if stream:
        assert isinstance(result, list) and result[-1] == "data: [DONE]\n\n"
        assert any("Hello there" in e or "Hello" in e for e in result), result
        assert not any('"error"' in e for e in result)
    else:
        choice = result.model_dump()["choices"][0]
        message = choice.get("message") or {}
        # (chat: the template opens a think block, so the text is the reasoning)
        served = choice.get("text") or message.get("content") or message.get("reasoning_content")
        assert served == "Hello there" and choice["finish_reason"] == "stop"


def test_detection_needs_every_choice_empty_and_length() -> None:
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sequence import RequestMetrics

    from vllm_overrides.engines.v0.serving import never_scheduled

    def metrics(scheduled: float | None) -> RequestMetrics:
        return RequestMetrics(arrival_time=1.0, last_token_time=1.0, first_scheduled_time=scheduled,
                              first_token_time=scheduled, time_in_queue=None)  # fmt: skip

    def res(outputs: list[tuple[list[int], str | None]], finished: bool = True,
            m: RequestMetrics | None = None) -> Any:  # fmt: skip
        outs = [CompletionOutput(i, "", ids, 0.0, None, fin) for i, (ids, fin) in
                enumerate(outputs)]  # fmt: skip
        return RequestOutput("r", None, [1, 2], None, outs, finished, metrics=m)

    # Without metrics (scripted engines): the outputs decide.
    assert never_scheduled(res([([], "length")]))
    assert never_scheduled(res([([], "length"), ([], "length")]))
    assert not never_scheduled(res([([], "length")], finished=False))
    assert not never_scheduled(res([([7], "length")]))  # max_tokens 1 served
    assert not never_scheduled(res([([], "length"), ([7], "stop")]))
    assert not never_scheduled(res([([], "stop")]))
    # With the engine's metrics: never scheduled decides, whatever ids a delta output carries
    # (0.6.3's delta slice of zero new tokens is the whole prompt).
    assert never_scheduled(res([([1, 2], "length")], m=metrics(None)))
    assert not never_scheduled(res([([], "length")], m=metrics(2.0)))
