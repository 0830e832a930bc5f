"""request_compat rules on hand-made bodies (no server)."""

from __future__ import annotations

import json

import pytest

from vllm_overrides.request_compat import (
    CompatError,
    ServerLimits,
    normalize_chat_request,
    normalize_completion_request,
)

LIMITS = ServerLimits(max_model_len=1000, default_max_tokens=64)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return normalize_chat_request({"messages": [dict(m) for m in USER], **fields}, LIMITS)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"thinking": {"type": "disabled"}}, False),
        ({"thinking": False}, False),
        ({"thinking": {"type": "enabled"}}, True),
        ({"enable_thinking": False}, False),
        ({"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}}, True),
    ],
)
def test_thinking_switches_reach_the_template(fields, expected) -> None:
    body = chat(**fields)
    assert body["chat_template_kwargs"]["enable_thinking"] is expected
    assert "thinking" not in body and "enable_thinking" not in body


def test_no_thinking_field_leaves_the_template_default() -> None:
    assert "chat_template_kwargs" not in chat()


@pytest.mark.parametrize("bad", [{"type": "sometimes"}, "off", 3])
def test_malformed_thinking_is_a_400(bad) -> None:
    with pytest.raises(CompatError) as err:
        chat(thinking=bad)
    assert err.value.status == 400 and err.value.param == "thinking"


def test_tool_call_history_shapes_are_normalised() -> None:
    calls = [
        {"index": 0, "id": "a", "type": "function",
         "function": {"name": "f", "arguments": {"city": "巴黎", "n": [1, 2]}}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{oops"}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
    ]  # fmt: skip
    body = normalize_chat_request(
        {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]}, LIMITS
    )
    out = body["messages"][1]["tool_calls"]
    assert "index" not in out[0]
    assert json.loads(out[0]["function"]["arguments"]) == {"city": "巴黎", "n": [1, 2]}
    assert "巴黎" in out[0]["function"]["arguments"]
    assert out[1]["function"]["arguments"] == "{oops"  # malformed strings pass verbatim
    assert out[2]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1001}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "12"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 10**12}, "max_completion_tokens"),
        ({"max_tokens": 10, "min_tokens": 11}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
    ],
)
def test_unservable_values_are_rejected_with_the_param(fields, param) -> None:
    with pytest.raises(CompatError) as err:
        chat(**fields)
    assert err.value.param == param
    assert err.value.body()["error"]["message"]


@pytest.mark.parametrize("value", [1, 64, 1000])
def test_budgets_up_to_the_context_length_pass_unchanged(value) -> None:
    assert chat(max_tokens=value)["max_tokens"] == value
    assert chat(max_completion_tokens=value)["max_completion_tokens"] == value


def test_missing_budget_gets_the_server_default_on_both_endpoints() -> None:
    assert chat()["max_completion_tokens"] == 64
    assert normalize_completion_request({"prompt": "x"}, LIMITS)["max_tokens"] == 64
    # min_tokens alone is coherent with that default
    assert normalize_completion_request({"prompt": "x", "min_tokens": 8}, LIMITS)["min_tokens"] == 8
    with pytest.raises(CompatError):
        normalize_completion_request({"prompt": "x", "min_tokens": 65}, LIMITS)


def test_non_dict_bodies_are_left_to_vllm() -> None:
    assert normalize_chat_request([1, 2], LIMITS) == [1, 2]
    assert normalize_completion_request(None, LIMITS) is None


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_choice_renders_without_thinking_unless_asked(choice) -> None:
    assert chat(tools=TOOLS, tool_choice=choice)["chat_template_kwargs"]["enable_thinking"] is False
    asked = chat(tools=TOOLS, tool_choice=choice, thinking={"type": "enabled"})
    assert asked["chat_template_kwargs"]["enable_thinking"] is True
    assert "chat_template_kwargs" not in chat(
        tools=TOOLS, tool_choice=choice, reasoning_effort="high"
    )


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_unforced_tool_choice_keeps_the_default(choice) -> None:
    assert "chat_template_kwargs" not in chat(tools=TOOLS, tool_choice=choice)


def test_unknown_role_is_rejected_known_roles_pass() -> None:
    with pytest.raises(CompatError, match="wizard"):
        normalize_chat_request({"messages": [{"role": "wizard", "content": "x"}]}, LIMITS)
    roles = ["system", "developer", "user", "assistant", "tool", "function"]
    body = {"messages": [{"role": r, "content": "x"} for r in roles]}
    assert normalize_chat_request(body, LIMITS)["messages"][0]["role"] == "system"


@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("name", ["thinking_token_budget", "seed", "n"])
def test_integers_beyond_64_bits_are_a_400_naming_the_field(name: str, value: int) -> None:
    """The fuzz suite found ``"thinking_token_budget": 2**64`` answered 500 on /v1/completions."""
    for normalize, body in ((normalize_completion_request, {"prompt": "0"}),
                            (normalize_chat_request, {"messages": [dict(m) for m in USER]})):
        with pytest.raises(CompatError) as err:
            normalize({**body, name: value}, LIMITS)
        assert err.value.param == name and err.value.status == 400
    # the range's own ends reach vLLM (which answers for them itself)
    assert normalize_completion_request({"prompt": "0", name: 2**63 - 1}, LIMITS)[name] == 2**63 - 1
