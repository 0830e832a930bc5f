"""The platform line's request mapping (engines/v0/request_rules.py): bodies the 0.32.0 line
serves must validate against vLLM 0.6.3's own request models after the shared rules and ours."""

from __future__ import annotations

import json

import pytest

from vllm_overrides.engines.v0 import request_rules as rules
from vllm_overrides.request_compat import CompatError, ServerLimits, normalize_chat_request

protocol = pytest.importorskip("vllm.entrypoints.openai.protocol")

LIMITS = ServerLimits(max_model_len=8192, default_max_tokens=4096)
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
USER = [{"role": "user", "content": "hi"}]


def fields() -> frozenset[str]:
    from vllm_overrides.engines.v0.api import _known_fields

    return _known_fields(protocol.ChatCompletionRequest)


def adapt(body: dict) -> tuple[object, str | None]:
    body = normalize_chat_request({"model": "llm", **body}, LIMITS)
    marker = rules.adapt_chat_body(body, fields())
    return protocol.ChatCompletionRequest(**body), marker


def test_stock_0_6_3_refuses_what_agents_send() -> None:
    # What the rules are for: without them each of these is a validation error on 0.6.3.
    for extra in (
        {"max_completion_tokens": 5},
        {"reasoning_effort": "low"},
        {"tool_choice": "required", "tools": [TOOL]},
    ):
        with pytest.raises(ValueError):
            protocol.ChatCompletionRequest(model="llm", messages=USER, **extra)


def test_max_completion_tokens_is_the_budget() -> None:
    request, _ = adapt({"messages": USER, "max_completion_tokens": 77, "max_tokens": 5})
    assert request.max_tokens == 77


def test_no_budget_gets_the_server_default() -> None:
    request, _ = adapt({"messages": USER})
    assert request.max_tokens == 4096


@pytest.mark.parametrize(
    ("extra", "thinking"),
    [
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "high"}, None),
        ({"thinking": {"type": "disabled"}}, False),
        ({"enable_thinking": False}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ],
)
def test_thinking_switches(extra, thinking) -> None:
    request, _ = adapt({"messages": USER, **extra})
    assert (request.chat_template_kwargs or {}).get("enable_thinking") is thinking


@pytest.mark.parametrize("choice", ["none", "required"])
def test_tool_choice_none_and_required_travel_as_a_marker(choice) -> None:
    request, marker = adapt({"messages": USER, "tools": [TOOL], "tool_choice": choice})
    assert marker == choice
    assert request.tool_choice == "auto"  # 0.6.3's default; the serving layer applies the marker
    if choice == "required":
        assert request.chat_template_kwargs == {"enable_thinking": False}


def test_json_schema_becomes_guided_json_with_thinking_off() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request, _ = adapt(
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
    )
    assert request.guided_json == schema and request.response_format is None
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_structured_output_with_thinking_asked_is_a_400() -> None:
    with pytest.raises(CompatError) as err:
        adapt({"messages": USER, "response_format": {"type": "json_object"}, "thinking": True})
    assert err.value.param == "response_format"


def test_include_usage_alone_means_the_last_chunk_only() -> None:
    request, _ = adapt(
        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (
        request.stream_options.include_usage and not request.stream_options.continuous_usage_stats
    )


def test_history_shapes_validate_and_keep_the_reasoning() -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "reasoning_content": "thought", "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": [{"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip
    request, _ = adapt({"messages": messages, "tools": [TOOL], "store": True, "metadata": {}})
    assistant = request.messages[1]
    assert assistant["content"].startswith("<think>\nthought\n</think>")
    args = [c["function"]["arguments"] for c in assistant["tool_calls"]]
    assert args == ['{"city": "Paris"}', "{}"]


def test_json_object_becomes_the_object_regex_with_thinking_off() -> None:
    request, _ = adapt({"messages": USER, "response_format": {"type": "json_object"}})
    assert request.response_format is None and request.guided_json is None
    assert request.guided_regex == rules.JSON_OBJECT_REGEX
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_json_object_with_a_guided_field_is_a_400() -> None:
    with pytest.raises(CompatError):
        adapt({"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"})


@pytest.mark.parametrize(
    "text",
    ['{}', '{"name": "Alice", "age": 30}', '{\n  "a": [1, -2.5e3, true, null, "x"],\n  "b": {}}',
     '{"s": "q\\"uote \\u00e9 \\n", "o": {"k": false}, "n": [] }', '{ "e" : [ ] }'],
)  # fmt: skip
def test_the_object_regex_accepts_json_objects(text: str) -> None:
    import re

    assert isinstance(json.loads(text), dict)
    assert re.fullmatch(rules.JSON_OBJECT_REGEX, text)


@pytest.mark.parametrize(
    "text",
    ['[]', '"x"', '3', '{"a": 1,}', "{'a': 1}", '{"a": 01}', '{"a": [1, 2', '{"a": "\n"}',
     '{"a": {"b": {"c": 1}}}', '{"a": {"b": []}}', '{"a": tru}', '{"a": 1} {}'],
)  # fmt: skip
def test_the_object_regex_refuses_the_rest(text: str) -> None:
    """Not JSON objects, or nested deeper than the bound (the two ``{"a": {"b": ...}}``)."""
    import re

    assert not re.fullmatch(rules.JSON_OBJECT_REGEX, text)
