"""request_compat rules on hand-made bodies (no server)."""

from __future__ import annotations

import json

import pytest

from vllm_overrides.request_compat import (
    MEDIA_ALLOWED_HOSTS_ENV,
    CompatError,
    ServerLimits,
    check_media_urls,
    media_allowed_hosts,
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


# --- t16b: a message without content ------------------------------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("absent", [True, False], ids=["key-absent", "null"])
def test_message_without_content_is_a_400(role: str, absent: bool) -> None:
    """The platform's check t16b sends ``{"role": "user"}`` and expects a 4xx."""
    message = {"role": role} if absent else {"role": role, "content": None}
    if role == "tool":
        message["tool_call_id"] = "c1"
    with pytest.raises(CompatError) as err:
        normalize_chat_request({"messages": [*USER, message]}, LIMITS)
    assert err.value.status == 400 and err.value.param == "messages[1].content"
    assert "no 'content'" in err.value.body()["error"]["message"]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "assistant", "content": ""},
        {"role": "assistant"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "function", "name": "f", "content": None},
        {"role": ["user"]},
        {"role": {"a": 1}, "content": None},
    ],
    ids=["tool-calls-null-content", "tool-calls-no-content", "function-call", "empty-assistant",
         "assistant-no-content", "assistant-null-no-calls", "empty-user", "user-parts",
         "function-role-null", "role-a-list", "role-an-object"],
)  # fmt: skip
def test_messages_that_need_no_more_content_pass(message: dict) -> None:
    body = normalize_chat_request({"messages": [*USER, message]}, LIMITS)
    assert body["messages"][1]["role"] == message["role"]


# --- d08: media URLs that would make the server fetch ---------------------------------------

# The URL the platform's check d08 sends.
EVALUATOR_URL = "https://upload.wikimedia.org/wikipedia/commons/thumb/3/3a/Cat03.jpg/200px-Cat03.jpg"
DATA_URL = "data:image/png;base64,iVBORw0KGgo="


def image_chat(url, key: str = "image_url", short: bool = False) -> dict:
    part = {"type": key, key: url if short else {"url": url}}
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, part]}]}


@pytest.mark.parametrize(
    "url",
    [EVALUATOR_URL, "http://127.0.0.1:8000/x.png", "HTTPS://Example.COM/x.png", "http://[::1]/x",
     "http://169.254.169.254/latest/meta-data/", "gopher://example.com/x", "ftp://example.com/x",
     "httpx://example.com/x", "http:no-host.png", "//example.com/x.png", "http://[broken/x"],
)  # fmt: skip
def test_remote_media_urls_are_a_400_by_default(monkeypatch, url: str) -> None:
    monkeypatch.delenv(MEDIA_ALLOWED_HOSTS_ENV, raising=False)
    with pytest.raises(CompatError) as err:
        normalize_chat_request(image_chat(url), LIMITS)
    assert err.value.status == 400 and err.value.param == "messages[0].content[1].image_url"
    assert "data: URL" in err.value.message  # says what to send instead


@pytest.mark.parametrize("key", ["image_url", "video_url", "audio_url"])
@pytest.mark.parametrize("short", [False, True], ids=["url-object", "url-string"])
def test_every_media_part_shape_is_checked(key: str, short: bool) -> None:
    with pytest.raises(CompatError, match="remote host"):
        check_media_urls(image_chat(EVALUATOR_URL, key, short), frozenset())


@pytest.mark.parametrize(
    "url", [DATA_URL, "DATA:image/png;base64,AAAA", " data:image/png;base64,AAAA", "file:///x.png"]
)
def test_inline_and_local_urls_are_left_to_the_engine(url: str) -> None:
    """data: is inline; file: is refused by the engine unless its operator named a local path."""
    assert normalize_chat_request(image_chat(url), LIMITS)["messages"][0]["content"][1] == {
        "type": "image_url", "image_url": {"url": url}
    }  # fmt: skip


def test_the_allow_list_admits_only_the_hosts_it_names(monkeypatch) -> None:
    monkeypatch.setenv(MEDIA_ALLOWED_HOSTS_ENV, " Upload.Wikimedia.org , 10.0.0.5,[::1],")
    assert media_allowed_hosts() == frozenset({"upload.wikimedia.org", "10.0.0.5", "::1"})
    for url in (EVALUATOR_URL, "http://10.0.0.5:9000/a.png", "http://[::1]/a", "https://UPLOAD.wikimedia.org./a"):
        normalize_chat_request(image_chat(url), LIMITS)  # passes unchanged
    for url in ("https://wikimedia.org/a", "https://evil.upload.wikimedia.org.evil.com/a",
                "http://10.0.0.50/a", "https://upload.wikimedia.org.evil.com/a"):
        with pytest.raises(CompatError, match="remote host"):
            normalize_chat_request(image_chat(url), LIMITS)
    # the first offending part is named, wherever it sits
    body = image_chat(DATA_URL)
    body["messages"].append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.org/a"}}]})
    with pytest.raises(CompatError) as err:
        normalize_chat_request(body, LIMITS)
    assert err.value.param == "messages[1].content[0].image_url"


@pytest.mark.parametrize(
    "url",
    ["https://evil.com\\@upload.wikimedia.org/a", "https://user@upload.wikimedia.org/a",
     "https://upload.wikimedia.org/a b", "https://upload.wiki\tmedia.org/a", " https://upload.wikimedia.org/a"],
)  # fmt: skip
def test_an_allowed_host_must_be_named_unambiguously(url: str) -> None:
    """Parsers disagree on backslashes, userinfo and whitespace; such URLs are never admitted."""
    allowed = frozenset({"upload.wikimedia.org"})
    with pytest.raises(CompatError, match="unambiguously|remote host"):
        check_media_urls(image_chat(url), allowed)


@pytest.mark.parametrize("bad", ["https://a.com", "a.com/x", "me@a.com", "a b"])
def test_a_malformed_allow_list_is_refused(monkeypatch, bad: str) -> None:
    monkeypatch.setenv(MEDIA_ALLOWED_HOSTS_ENV, f"ok.com,{bad}")
    with pytest.raises(ValueError, match=MEDIA_ALLOWED_HOSTS_ENV):
        media_allowed_hosts()


def test_odd_part_shapes_are_left_to_vllm() -> None:
    odd = [5, "text", {"type": "image_url", "image_url": 7}, {"type": "image_url", "image_url": {"url": None}}]
    body = {"messages": [{"role": "user", "content": odd}, {"role": "user", "content": "x"}, "junk"]}
    check_media_urls(body, frozenset())  # nothing to refuse: vLLM's own validation answers
