"""Message shapes: system messages anywhere, content blocks, images, scripts; malformed input."""

from __future__ import annotations

import pytest

from tests.admission.conftest import assert_openai_error, chat, ok, png_data_url, post

pytestmark = pytest.mark.server

USER = {"role": "user", "content": "Hello"}


@pytest.mark.parametrize(
    "messages",
    [
        [USER],
        [{"role": "system", "content": "Be brief."}, USER],
        [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."}, USER],
        [USER, {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Late rule."},
         {"role": "user", "content": "And now?"}],
        [{"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "blocks"}]}],
        [{"role": "system", "content": [{"type": "text", "text": "System as blocks."}]}, USER],
    ],
    ids=["no-system", "system", "two-leading-systems", "late-system", "text-blocks", "system-blocks"],
)  # fmt: skip
def test_message_shapes(server, messages) -> None:
    assert ok(chat(server, messages, max_tokens=4))["usage"]["completion_tokens"] == 4


def test_late_system_message_keeps_the_prefix_cached(server) -> None:
    """A late system message is rendered in place, so the earlier turns stay a cached prefix."""
    turns = [{"role": "user", "content": "Cache-prefix late system " + "word " * 300},
             {"role": "assistant", "content": "Noted."}]  # fmt: skip
    ok(chat(server, [*turns, {"role": "user", "content": "one"}], max_tokens=1))
    late = [*turns, {"role": "system", "content": "New rule."}, {"role": "user", "content": "two"}]
    body = ok(chat(server, late, max_tokens=1))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256


def test_image_data_url(server) -> None:
    content = [{"type": "text", "text": "What colour is this?"},
               {"type": "image_url", "image_url": {"url": png_data_url((255, 0, 0))}}]  # fmt: skip
    with_image = ok(chat(server, [{"role": "user", "content": content}], max_tokens=4))
    text_only = ok(chat(server, [{"role": "user", "content": content[:1]}], max_tokens=4))
    # the image became vision tokens in the prompt (64x64 px -> 16 merged patches)
    assert with_image["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"] + 10


def test_several_images_in_one_prompt(server) -> None:
    quadrants = [png_data_url(c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0))]
    content = [{"type": "text", "text": "Name the four colours."}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in quadrants
    ]
    one = ok(chat(server, [{"role": "user", "content": content[:2]}], max_tokens=2))
    four = ok(chat(server, [{"role": "user", "content": content}], max_tokens=2))
    assert four["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "text", ["你好，世界！请重复这句话。", "こんにちは、世界。", "Emoji: 🚀🔥👍🏽 ok"]
)
def test_chinese_japanese_emoji_round_trip(server, text) -> None:
    assert ok(chat(server, [{"role": "user", "content": text}], max_tokens=4))
    ids = ok(post(server, "/tokenize", {"model": server.model, "prompt": text}))["tokens"]
    back = ok(post(server, "/detokenize", {"model": server.model, "tokens": ids}))["prompt"]
    assert back == text


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": "llm"},
        {"model": "llm", "messages": []},
        {"model": "llm", "messages": [{"content": "no role"}]},
        {"model": "llm", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "llm", "messages": "hello"},
        {"model": "llm", "messages": [{"role": "user", "content": 42}]},
        {"model": "llm", "messages": [USER], "temperature": "hot"},
        {"model": "llm", "messages": [USER], "n": 0},
        {"model": "llm", "messages": [USER], "stream": [1]},
    ],
    ids=["empty-object", "no-messages", "empty-messages", "missing-role", "unknown-role",
         "messages-not-list", "content-number", "temperature-string", "n-zero", "stream-string"],
)  # fmt: skip
def test_malformed_requests_are_4xx_with_an_error_body(server, body) -> None:
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, 422)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"null", b"\xff\xfe"])
def test_unparseable_bodies_are_4xx(server, raw) -> None:
    with server.client() as c:
        resp = c.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert_openai_error(resp, 400, 422)


def test_unknown_model_is_404(server) -> None:
    resp = post(server, "/v1/chat/completions", {"model": "no-such-model", "messages": [USER]})
    assert_openai_error(resp, 404)


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "system"}, USER],
        [{"role": "system", "content": None}, USER],
        [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1"}],
    ],
    ids=["user-absent", "user-null", "system-absent", "system-null", "tool-absent"],
)  # fmt: skip
def test_message_without_content_is_a_400(server, messages) -> None:
    """The platform's check t16b: ``{"role": "user"}`` alone must be a 4xx (vLLM answers 200)."""
    resp = post(server, "/v1/chat/completions",
                {"model": server.model, "messages": messages, "max_tokens": 5})  # fmt: skip
    assert_openai_error(resp, 400)


def test_assistant_tool_calls_need_no_content(server) -> None:
    """An assistant turn that called tools comes back without ``content``: served."""
    history = [USER, {"role": "assistant", "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    assert ok(chat(server, history, max_tokens=2))["usage"]["completion_tokens"] == 2


def test_assistant_history_without_content_is_served(server) -> None:
    """An agent may echo a turn whose content was null (it only reasoned): the request can be
    served, so it is (the template renders the turn empty)."""
    history = [USER, {"role": "assistant", "content": None}, {"role": "user", "content": "And?"}]
    assert ok(chat(server, history, max_tokens=2))["usage"]["completion_tokens"] == 2
