"""The qwen3_coder format (vllm_overrides/qwen3_coder_format.py) and its 0.6.3 ToolParser."""

from __future__ import annotations

import json

import pytest

from vllm_overrides import qwen3_coder_format as fmt

SCHEMA = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "where": {"type": "object"},
            "ratio": {"type": "number"},
            "code": {"type": "string"},
        },
    }
}


def call(**params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"


def test_values_follow_the_schema() -> None:
    text = "Let me check.\n" + call(
        city="Paris", days="3", metric="true", where='{"lat": 1.5}', ratio="0.25", code="007"
    )
    parsed = fmt.parse(text, SCHEMA)
    assert parsed.content == "Let me check.\n"
    (only,) = parsed.calls
    assert only.complete and only.name == "get_weather"
    assert only.arguments == {
        "city": "Paris", "days": 3, "metric": True, "where": {"lat": 1.5}, "ratio": 0.25,
        "code": "007",
    }  # fmt: skip


def test_unknown_parameters_are_json_when_json_else_text() -> None:
    parsed = fmt.parse(call(n="[1, 2]", s="two words"), {})
    assert parsed.calls[0].arguments == {"n": [1, 2], "s": "two words"}


def test_multiline_string_values_keep_their_inner_newlines() -> None:
    parsed = fmt.parse(call(code="line 1\n\nline 3"), SCHEMA)
    assert parsed.calls[0].arguments == {"code": "line 1\n\nline 3"}


def test_several_calls_and_an_unfinished_one() -> None:
    text = (
        call(city="A")
        + "\n"
        + call(city="B")
        + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nC"
    )
    parsed = fmt.parse(text, SCHEMA)
    assert [(c.arguments, c.complete) for c in parsed.calls] == [
        ({"city": "A"}, True), ({"city": "B"}, True), ({}, False),
    ]  # fmt: skip


def test_missing_closing_parameter_tag_ends_at_the_next_parameter() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>"
    assert fmt.parse(text, SCHEMA).calls[0].arguments == {"city": "Rome", "days": 2}


def test_no_markup_is_all_content() -> None:
    parsed = fmt.parse("just text <tool", SCHEMA)
    assert parsed.calls == [] and not parsed.tools_started
    assert fmt.held_back("just text <tool") == len("<tool")
    assert fmt.held_back("a < b") == 0


@pytest.fixture(scope="module")
def parser_cls():
    pytest.importorskip("vllm.entrypoints.openai.tool_parsers")
    from vllm.entrypoints.openai.tool_parsers import ToolParserManager

    from vllm_overrides.engines.v0.tool_parser import Qwen3CoderToolParser

    assert ToolParserManager.get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    return Qwen3CoderToolParser


def request(tools=True):
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": SCHEMA["get_weather"]},
    }
    return ChatCompletionRequest(model="m", messages=[], tools=[tool] if tools else None)


def test_parser_extracts_calls_and_content(parser_cls) -> None:
    info = parser_cls(None).extract_tool_calls("Sure.\n" + call(city="Oslo", days="1"), request())
    assert info.tools_called and info.content == "Sure."
    assert json.loads(info.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 1}
    info = parser_cls(None).extract_tool_calls("no call here", request())
    assert not info.tools_called and info.content == "no call here"


@pytest.mark.parametrize("step", [1, 3, 7])
def test_parser_streams_content_name_then_arguments(parser_cls, step) -> None:
    text = "Hi <b>.\n" + call(city="Oslo") + "\n" + call(city="Rome", days="2")
    parser = parser_cls(None)
    content, names, args = "", [], {}
    previous = ""
    for end in range(step, len(text) + step, step):
        current = text[:end]
        delta = parser.extract_tool_calls_streaming(
            previous, current, current[len(previous) :], [], [], [], request()
        )
        assert delta is not None  # never None: 0.6.3 would drop the finish chunk
        content += delta.content or ""
        for d in delta.tool_calls:
            fn = d.function if isinstance(d.function, dict) else d.function.model_dump()
            if fn.get("name"):
                names.append(fn["name"])
            args[d.index] = args.get(d.index, "") + (fn.get("arguments") or "")
        previous = current
    assert content == "Hi <b>.\n"
    assert names == ["get_weather", "get_weather"]
    assert [json.loads(args[i]) for i in (0, 1)] == [{"city": "Oslo"}, {"city": "Rome", "days": 2}]
    assert [c["name"] for c in parser.prev_tool_call_arr] == ["get_weather", "get_weather"]
    assert parser.streamed_args_for_tool == [args[0], args[1]]
