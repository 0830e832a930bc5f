"""Tools: auto / required / named tool choice, and every history shape agents send back."""

from __future__ import annotations

import json

import pytest

from tests.admission.conftest import WEATHER_TOOL, chat, content_criterion, ok

pytestmark = pytest.mark.server

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(arguments, **extra):
    return {
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": arguments}, **extra,
    }  # fmt: skip


def history(*calls, results=("Sunny, 21 C",)):
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": list(calls)}]
    return msgs + [{"role": "tool", "tool_call_id": "call_1", "content": r} for r in results]


def test_tool_choice_auto_is_served(server) -> None:
    body = ok(chat(server, ASK, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=16))
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)  # fmt: skip
def test_forced_tool_choice_returns_a_parsed_call(server, choice) -> None:
    """A forced choice is served as a call of get_weather whose arguments follow the schema's
    grammar from the first token (protocol). That they are complete JSON needs the model to
    close them within the budget: the random-weight model may write one string until the budget
    runs out (then finish "length"), which the platform's d03 / t5 would fail as content."""
    body = ok(chat(server, ASK, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=128, seed=7))
    choice0 = body["choices"][0]
    calls = choice0["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    arguments = calls[0]["function"]["arguments"]
    assert arguments.lstrip().startswith("{")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if choice0["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == 128
    else:  # it stopped: the grammar was complete, so the arguments parse
        assert choice0["finish_reason"] in ("tool_calls", "stop")
        assert isinstance(parsed, dict), arguments
    content_criterion("d03/t5 (forced)", isinstance(parsed, dict),
                      "the arguments were still open when the budget ran out")  # fmt: skip


@pytest.mark.parametrize(
    "messages",
    [
        history(call('{"city": "Paris"}')),
        history(call({"city": "Paris"})),
        history(call("{city: Paris")),
        history(call('{"city": "Paris"}', index=0)),
        history(call('{"city": "Paris"}'), results=("Sunny", "Also: 21 C")),
        [{"role": "system", "content": "You call tools."},
         {"role": "tool", "tool_call_id": "call_0", "content": "previous result"}, *ASK],
        [*ASK, {"role": "assistant", "content": "Let me check.", "reasoning_content": "User wants weather."},
         {"role": "user", "content": "Go on."}],
    ],
    ids=["args-string", "args-object", "args-malformed", "stray-index", "consecutive-results",
         "tool-after-system", "reasoning_content-history"],
)  # fmt: skip
def test_history_shapes_are_served(server, messages) -> None:
    body = ok(chat(server, messages, tools=[WEATHER_TOOL], max_tokens=4))
    assert body["usage"]["prompt_tokens"] > 0


def test_preflight_assistant_with_null_content_and_tool_calls(server) -> None:
    """The replay's preflight: assistant content null + tool_calls, nothing after it."""
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]}]
    ok(chat(server, msgs, tools=[WEATHER_TOOL], max_tokens=4))


def test_reasoning_content_in_history_reaches_the_template(server) -> None:
    """reasoning_content on the current agent turn renders like upstream's `reasoning` field."""

    def prompt_tokens(field: str | None) -> int:
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [call('{"city": "Paris"}')],
        }
        if field:
            assistant[field] = "The user wants the weather in Paris. " * 10
        msgs = [*ASK, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
        body = ok(chat(server, msgs, tools=[WEATHER_TOOL], max_tokens=1))
        return body["usage"]["prompt_tokens"]

    without = prompt_tokens(None)
    assert prompt_tokens("reasoning_content") == prompt_tokens("reasoning") > without + 50
