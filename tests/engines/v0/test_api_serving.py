"""vLLM 0.6.3's chat serving with our subclass (patch 0010), driven by a scripted engine.

The engine stub yields the outputs each test scripts; what is checked is what the serving layer
makes of them: reasoning split off, tool calls parsed, usage counted, budgets fitted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.openai.serving_chat")

from tests.engines.v0.api_fakes import FakeEngine, make_chat, make_tokenizer  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}}},
    },
}  # fmt: skip
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")  # fmt: skip


class RawRequest:
    """What the serving layer reads of the HTTP request: headers and disconnects."""

    def __init__(self, marker: str | None = None) -> None:
        from starlette.datastructures import Headers

        self.headers = Headers({"x-vllm-overrides-tool-choice": marker} if marker else {})
        self.state = type("State", (), {})()

    async def is_disconnected(self) -> bool:
        return False


def run(engine: FakeEngine, body: dict[str, Any], marker: str | None = None,
        max_model_len: int = 4096) -> Any:  # fmt: skip
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    serving = make_chat(engine, max_model_len)
    request = ChatCompletionRequest(model="llm", **body)

    async def go() -> Any:
        result = await serving.create_chat_completion(request, RawRequest(marker))
        if hasattr(result, "__aiter__"):
            return [event async for event in result]
        return result

    return asyncio.run(go())


def events(stream: list[str]) -> list[dict[str, Any]]:
    assert stream[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: ") :]) for e in stream[:-1]]


USER = [{"role": "user", "content": "hi"}]


def test_reasoning_is_split_from_the_answer_when_the_prompt_opens_it() -> None:
    tok = make_tokenizer()
    engine = FakeEngine(tok, [[(0, "step one</think>\n\nThe answer.", 9, "stop")]])
    answer = run(engine, {"messages": USER}).model_dump()
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "step one"
    assert message["content"] == "The answer."
    # The template opened the think block: its last marker in the prompt is <think>.
    assert engine.prompts[0][-1] == tok.convert_tokens_to_ids("<think>")


def test_thinking_off_leaves_the_text_as_content() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "plain words", 2, "length")]])
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    message = run(engine, body).model_dump()["choices"][0]["message"]
    assert message["content"] == "plain words"
    assert "reasoning_content" not in message


def test_unclosed_reasoning_is_all_reasoning() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "still thinking", 16, "length")]])
    message = run(engine, {"messages": USER}).model_dump()["choices"][0]["message"]
    assert message["reasoning_content"] == "still thinking"
    assert message["content"] is None


def test_auto_tool_call_after_reasoning_is_parsed() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "let me look</think>\n\n" + CALL, 30, "stop")]])
    answer = run(engine, {"messages": USER, "tools": [WEATHER]}).model_dump()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["message"]["reasoning_content"] == "let me look"


def test_tool_choice_none_parses_no_call() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "x</think>" + CALL, 30, "stop")]])
    answer = run(engine, {"messages": USER, "tools": [WEATHER]}, marker="none").model_dump()
    assert answer["choices"][0]["message"]["tool_calls"] == []
    assert "<tool_call>" in answer["choices"][0]["message"]["content"]


def test_required_with_several_tools_returns_the_listed_calls() -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    engine = FakeEngine(make_tokenizer(), [[(0, text, 20, "stop")]])
    body = {"messages": USER, "tools": [WEATHER, other],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    answer = run(engine, body, marker="required").model_dump()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
    assert names == ["get_time", "get_weather"]
    # the engine was given the list-of-calls grammar
    guided = engine.params[0].guided_decoding
    assert guided is not None and guided.json["type"] == "array"


def test_required_with_one_tool_is_that_tool_named() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, '{"city": "Rome"}', 6, "stop")]])
    body = {
        "messages": USER,
        "tools": [WEATHER],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    answer = run(engine, body, marker="required").model_dump()
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_budget_above_what_the_prompt_leaves_is_fitted() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "a", 1, "length")]])
    run(engine, {"messages": USER, "max_tokens": 64}, max_model_len=64)
    prompt_len = len(engine.prompts[0])
    assert engine.params[0].max_tokens == 64 - prompt_len


def test_cached_tokens_are_reported_when_the_engine_gives_them() -> None:
    engine = FakeEngine(make_tokenizer(), [[(0, "a</think>b", 3, "stop")]], num_cached_tokens=16)
    usage = run(engine, {"messages": USER}).model_dump()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}


def test_stream_reasoning_tool_call_and_usage_of_two_choices() -> None:
    script = [
        [(0, "think", 1, None), (1, "other", 1, None)],
        [(0, "ing</think>\n\n<tool_call>\n<function=get_weather>\n", 5, None),
         (1, "</think>\n\nHello", 3, None)],
        [(0, "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", 9, None),
         (1, " there", 1, "stop")],
        [(0, "", 1, "stop")],
    ]  # fmt: skip
    engine = FakeEngine(make_tokenizer(), script)
    body = {"messages": USER, "tools": [WEATHER], "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}  # fmt: skip
    chunks = events(run(engine, body))
    per: dict[int, dict[str, Any]] = {0: {"r": "", "c": "", "calls": [], "fin": None},
                                      1: {"r": "", "c": "", "calls": [], "fin": None}}  # fmt: skip
    for chunk in chunks:
        for choice in chunk["choices"]:
            acc, delta = per[choice["index"]], choice["delta"]
            if "reasoning_content" in delta:
                assert delta["reasoning_content"] == delta["reasoning"]
                acc["r"] += delta["reasoning_content"]
            acc["c"] += delta.get("content") or ""
            acc["calls"] += delta.get("tool_calls") or []
            acc["fin"] = choice.get("finish_reason") or acc["fin"]
    assert per[0]["r"] == "thinking" and per[1]["r"] == "other"
    assert per[1]["c"] == "Hello there" and per[1]["fin"] == "stop"
    assert per[0]["fin"] == "tool_calls"
    names = [c["function"].get("name") for c in per[0]["calls"] if c["function"].get("name")]
    args = "".join(c["function"].get("arguments") or "" for c in per[0]["calls"])
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
    assert per[1]["calls"] == []
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 16 + 5  # both choices, not the last one's only
    assert usage["total_tokens"] == usage["prompt_tokens"] + 21


def test_stream_named_tool_call_sends_its_name_once() -> None:
    script = [[(0, '{"city": ', 3, None)], [(0, '"Rome"}', 3, "stop")]]
    engine = FakeEngine(make_tokenizer(), script)
    body = {"messages": USER, "tools": [WEATHER], "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    calls = [c for e in events(run(engine, body)) for ch in e["choices"]
             for c in ch["delta"].get("tool_calls") or []]  # fmt: skip
    assert [c["function"].get("name") for c in calls] == ["get_weather", None]
    assert "id" in calls[0]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Rome"}
