"""The platform's functional_acceptance checks (modelsphere/llm-bench), request for request.

Each test sends the body the evaluator's check sends (``bench/tests/functional/
functional_acceptance.py``: prompt, fields, thinking switch) and asserts its pass criterion. The
evaluator runs against our server as a bare engine ("direct": ``/version`` answers JSON), with
the served name ``llm``, which it does not recognise as Qwen, so it probes the thinking switch
and ends on ``chat_template_kwargs.enable_thinking``; that is what ``NO_THINK`` sends.

Two kinds of criteria:

- protocol (status, shape, finish_reason, usage, what the server refuses): asserted always;
- content (the answer names Alice, echoes a marker, contains "4", calls the tool on its own, ends
  its story with a stop): a random-weight model cannot meet these by construction. They are
  asserted after the protocol part, through :func:`content_criterion`, which marks the test
  ``xfail`` with the evaluator's check id and the reason unless ``ADMISSION_JUDGE_CONTENT=1``
  (a real model), where a miss fails. Nothing of the protocol part is skipped. ``CHECKS``
  below maps every check id to the tests that cover it.

Budgets: the evaluator gives 1,500-4,096 tokens to checks a thinking model must not starve in.
A random-weight model does not stop early, so such a budget only decides how long it writes:
``ADMISSION_BUDGET_CAP`` (default 256; 0 = the evaluator's own) bounds them, and each test says
where it applies. Checks that depend on the budget itself (t3, the truncation check) use the
evaluator's values.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import httpx
import pytest

from tests.admission.conftest import JUDGE_CONTENT, chat, content_criterion, ok, post

pytestmark = pytest.mark.server

BUDGET_CAP = int(os.environ.get("ADMISSION_BUDGET_CAP", "256"))
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
# The evaluator's tool (its wording, not conftest's WEATHER_TOOL).
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def budget(evaluator_value: int) -> int:
    return min(evaluator_value, BUDGET_CAP) if BUDGET_CAP > 0 else evaluator_value


_THINK_RE = re.compile(r"^\s*<think(?:ing)?>(.*?)(?:</think(?:ing)?>|\Z)\s*", re.S | re.I)


def message(body: dict[str, Any]) -> dict[str, Any]:
    return body["choices"][0]["message"]


def reasoning_and_visible(body: dict[str, Any]) -> tuple[str, str]:
    """Reasoning by any transport and the visible answer, the way the evaluator reads them: a
    dedicated field, else a leading ``<think>`` block left in the content."""
    msg = message(body)
    content = msg.get("content") or ""
    field = msg.get("reasoning_content") or msg.get("reasoning") or ""
    m = _THINK_RE.match(content)
    inline, visible = (m.group(1), content[m.end() :]) if m else ("", content)
    return field or inline, visible


def raw_stream(srv, body: dict[str, Any], timeout: float = 300) -> tuple[int, str]:
    """Status and the raw SSE text, as the evaluator reads a streamed answer."""
    with httpx.Client(base_url=srv.base_url, headers=srv.headers(), timeout=timeout) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            return r.status_code, r.read().decode()


def sse_counts(raw: str) -> tuple[int, int, int]:
    """(data chunks, [DONE] markers, usage chunks): d02 / t7's three numbers."""
    return (
        len(re.findall(r"^data: ", raw, re.M)),
        raw.count("[DONE]"),
        raw.count('"completion_tokens"'),
    )


def body_of(srv, **fields: Any) -> dict[str, Any]:
    return {"model": srv.model, **fields}


# --- backend detection: the evaluator must read us as a bare engine ---------------------------


def test_evaluator_reads_the_server_as_a_bare_engine(server) -> None:
    """``/version`` answering 200 JSON makes the evaluator resolve "direct": top_p 0 may then be
    a 4xx, and t11a/b are skipped when no key is enforced. "gateway" would demand a 2xx for
    top_p 0 and a 401 without a key."""
    with server.client() as c:
        r = c.get("/version")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert isinstance(r.json()["version"], str) and r.json()["version"]
    choice = ok(chat(server, [{"role": "user", "content": "hi"}], max_tokens=1))["choices"][0]
    assert "stop_reason" in choice  # the second signal the evaluator looks for


# --- d01-d10 -----------------------------------------------------------------------------------


def test_d01_basic_non_stream(server) -> None:
    """d01: 2xx, content or reasoning non-empty, completion_tokens > 0 (budget 1,500, capped)."""
    body = ok(chat(server, [{"role": "user", "content": "What is 2+2?"}], max_tokens=budget(1500)))
    reasoning, visible = reasoning_and_visible(body)
    assert (reasoning or visible) and body["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    "check,prompt,max_tokens",
    [("d02", "hi briefly", 50), ("t7", "Count 1 to 5 in english.", 80)],
)
def test_d02_t7_stream_with_usage(server, check, prompt, max_tokens) -> None:
    """d02 / t7: 2xx, >= 5 data chunks, exactly one [DONE], >= 1 usage chunk."""
    req = body_of(server, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                  stream=True, stream_options={"include_usage": True})  # fmt: skip
    status, raw = raw_stream(server, req)
    chunks, done, usage = sse_counts(raw)
    assert status == 200 and chunks >= 5 and done == 1 and usage >= 1, (check, raw[-400:])


def _tool_request(srv, tool_choice: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "What's the weather in Beijing today?"}]
    return body_of(srv, messages=messages, max_tokens=budget(4096), temperature=0,
                   tools=[GET_WEATHER], tool_choice=tool_choice, **NO_THINK)  # fmt: skip


def test_d03_t5_tool_call_auto(server) -> None:
    """d03 / t5 in the evaluator's default mode (tool_choice "auto"): 2xx and a tool call whose
    arguments parse. Whether to call is the model's decision: content."""
    body = ok(post(server, "/v1/chat/completions", _tool_request(server, "auto")))
    calls = message(body).get("tool_calls") or []
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    if calls:  # a call the parser extracted is well-formed whatever the weights
        assert calls[0]["function"]["name"] == "get_weather"
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    content_criterion("d03/t5 (auto)", bool(calls), "the model answered in prose, no call")
    json.loads(calls[0]["function"]["arguments"])


def test_d03_t5_tool_call_named(server) -> None:
    """d03 / t5 with ``tool_choice_mode: named``: the server forces the call, so a call named
    get_weather is protocol; that its arguments are complete JSON needs the model to close the
    argument object within the budget (a random model may write one string until it runs out)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = ok(post(server, "/v1/chat/completions", _tool_request(server, named)))
    choice = body["choices"][0]
    calls = message(body)["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    args = calls[0]["function"]["arguments"]
    assert args.lstrip().startswith("{")  # the grammar held from the first token
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = None
    if choice["finish_reason"] != "length":  # it stopped, so the grammar was complete
        assert isinstance(parsed, dict), args
    content_criterion("d03/t5 (named)", isinstance(parsed, dict),
                      f"arguments unfinished at the budget ({choice['finish_reason']})")  # fmt: skip


def test_d04_reasoning(server) -> None:
    """d04: 2xx, reasoning + content > 20 chars, containing "1" or "one" (budget 1,500, capped).
    The digit is content; random text contains it often, not always."""
    prompt = "If I have 3 apples and give 1 to Alice and eat 1, how many left? Think step by step."
    body = ok(chat(server, [{"role": "user", "content": prompt}], max_tokens=budget(1500),
                   temperature=0.2))  # fmt: skip
    reasoning, visible = reasoning_and_visible(body)
    text = reasoning + visible
    assert len(text) > 20
    content_criterion("d04", "1" in text or "one" in text.lower(), "no '1' / 'one' in the text")


def test_d06_cache_hit_the_evaluators_way(server) -> None:
    """d06: a ~2.9K-token prompt streamed twice, 5 s apart; the second stream's usage reports
    cached_tokens > 0 (it reads every usage chunk and keeps the largest)."""
    target = max(64, min(2048, server.max_model_len - 1024))
    sentence = ("Explain the concept of quantum superposition in detail with examples "
                "from physics experiments. ")  # fmt: skip
    req = body_of(server, messages=[{"role": "user", "content": sentence * ((target + 11) // 12)}],
                  max_tokens=20, stream=True, stream_options={"include_usage": True})  # fmt: skip

    def cached_of(raw: str) -> tuple[int, int]:
        prompt = cached = 0
        for line in raw.splitlines():
            if line.startswith("data: ") and "prompt_tokens" in line:
                usage = json.loads(line[6:]).get("usage") or {}
                prompt = usage.get("prompt_tokens", 0) or prompt
                details = usage.get("prompt_tokens_details") or {}
                cached = max(cached, details.get("cached_tokens", 0) or 0)
        return prompt, cached

    status1, raw1 = raw_stream(server, req)
    time.sleep(5)
    status2, raw2 = raw_stream(server, req)
    assert status1 == status2 == 200
    (prompt1, _), (prompt2, cached2) = cached_of(raw1), cached_of(raw2)
    assert prompt1 == prompt2 > 2048
    assert cached2 > 0


def test_d07_reasoning_split_into_its_own_field(server) -> None:
    """d07: reasoning > 20 chars in ``reasoning_content`` (not inline ``<think>``) and content
    > 20 chars; a budget that ends inside the reasoning is a SKIP there, never a fail. A random
    model never closes ``</think>``: protocol is that what it wrote is in the field."""
    prompt = ("A train leaves NYC at 60 mph heading north. Another leaves Boston (200 miles from "
              "NYC) at 40 mph heading toward NYC. When do they meet and how far from NYC? Show "
              "your reasoning then give the final answer.")  # fmt: skip
    body = ok(chat(server, [{"role": "user", "content": prompt}], max_tokens=budget(4096),
                   temperature=0.3))  # fmt: skip
    msg, finish = message(body), body["choices"][0]["finish_reason"]
    field = msg.get("reasoning_content") or ""
    assert len(field) > 20 and "<think>" not in (msg.get("content") or "")
    visible = (msg.get("content") or "").strip()
    if finish == "length" and len(visible) <= 20:
        return  # the evaluator's SKIP: truncated before the answer
    content_criterion("d07", len(visible) > 20, f"finish={finish}, content[{len(visible)}]")


@pytest.mark.parametrize("check", ["d09", "d10"])
def test_d09_d10_thinking_off(server, check) -> None:
    """d09 / d10 (both reach us as ``chat_template_kwargs.enable_thinking: false``): 2xx, no
    reasoning by any transport; content contains "4" and is < 100 chars (content)."""
    body = ok(chat(server, [{"role": "user", "content": "2 + 2 = ? 直接给数字。"}],
                   max_tokens=300, temperature=0, **NO_THINK))  # fmt: skip
    reasoning, visible = reasoning_and_visible(body)
    assert reasoning.strip() == "" and visible.strip()
    content_criterion(check, "4" in visible and len(visible.strip()) < 100, repr(visible[:60]))


# --- t1: the thinking switch -------------------------------------------------------------------


@pytest.mark.parametrize(
    "check,switch,max_tokens,expect_reasoning",
    [("t1a", THINK, 300, True), ("t1b", NO_THINK, 100, False), ("t1c", {}, 300, True)],
)
def test_t1_thinking_switch(server, check, switch, max_tokens, expect_reasoning) -> None:
    body = ok(chat(server, [{"role": "user", "content": "2+2=?"}], max_tokens=max_tokens,
                   **switch))  # fmt: skip
    reasoning, _ = reasoning_and_visible(body)
    assert bool(reasoning.strip()) is expect_reasoning, check


def test_thinking_probe_candidates(server) -> None:
    """The evaluator's probe for an unknown model name tries ``chat_template_kwargs.thinking``
    alone first; it must not break anything (here: ignored, reasoning stays on), so the probe
    moves on to ``enable_thinking``, which turns reasoning off with visible content."""
    base = {"messages": [{"role": "user", "content": "2+2=?"}], "max_tokens": 32, "temperature": 0}
    on = ok(post(server, "/v1/chat/completions", body_of(server, **base)))
    assert reasoning_and_visible(on)[0].strip()
    spelled = body_of(server, **base, chat_template_kwargs={"thinking": False})
    ok(post(server, "/v1/chat/completions", spelled))
    off = ok(post(server, "/v1/chat/completions", body_of(server, **base, **NO_THINK)))
    reasoning, visible = reasoning_and_visible(off)
    assert not reasoning.strip() and visible.strip()


# --- t3: max_tokens boundaries -----------------------------------------------------------------

STORY = [{"role": "user", "content": "Write a short story"}]


def _reserve(ctx: int) -> int:
    return min(2048, max(1, ctx // 4))


@pytest.mark.parametrize("check", ["t3_mid", "t3_max", "t3_ctx"])
def test_t3_large_budgets_are_accepted(server, check) -> None:
    """t3_mid (min(65536, ctx - reserve)), t3_max (ctx - reserve) and PLATFORM.md's reading of
    it (ctx itself, fitted to what the prompt leaves): 2xx and finish "stop". The request is
    streamed and dropped after the first tokens: acceptance is protocol; "stop" needs the model
    to end its story (content: a random model writes to the budget)."""
    ctx = server.max_model_len
    max_tokens = {"t3_mid": min(65536, ctx - _reserve(ctx)), "t3_max": ctx - _reserve(ctx),
                  "t3_ctx": ctx}[check]  # fmt: skip
    req = body_of(server, messages=STORY, max_tokens=max_tokens, stream=True)
    events = []
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=300) as c:
        with c.stream("POST", "/v1/chat/completions", json=req) as r:
            assert r.status_code == 200, r.read().decode()[:300]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                if len(events) >= 3 and not JUDGE_CONTENT:
                    break  # a real model is read to its end: its finish is judged below
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert any(d.get("content") or d.get("reasoning_content") for d in deltas), events
    # The dropped stream was aborted: the engine serves the next request at once.
    assert ok(chat(server, max_tokens=1))["usage"]["completion_tokens"] == 1
    finishes = [ch.get("finish_reason") for e in events for ch in e["choices"]]
    content_criterion(check, "stop" in finishes, "finish 'stop' needs the model to end its story")


def test_t3_none(server) -> None:
    """t3_none: no max_tokens -> 2xx within the request timeout, finish "stop" (content). The
    server's default budget (4,096; the suite's servers 256) bounds a model that never stops."""
    start = time.monotonic()
    body = ok(post(server, "/v1/chat/completions", body_of(server, messages=STORY), timeout=300))
    assert time.monotonic() - start < 300
    finish = body["choices"][0]["finish_reason"]
    assert finish in ("stop", "length")
    content_criterion("t3_none", finish == "stop", "the default budget ran out")


@pytest.mark.parametrize("n", [1, 64])
def test_t3_small_budgets_end_with_length(server, n) -> None:
    """t3_1 / t3_64: the evaluator's prompt, thinking on by default: 2xx, finish "length"."""
    body = ok(post(server, "/v1/chat/completions", body_of(server, messages=STORY, max_tokens=n)))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == n


@pytest.mark.parametrize("check", ["t3_neg1", "t3_over"])
def test_t3_budgets_refused(server, check) -> None:
    value = -1 if check == "t3_neg1" else server.max_model_len + 1
    resp = post(server, "/v1/chat/completions", body_of(server, messages=STORY, max_tokens=value))
    assert 400 <= resp.status_code < 500 and resp.json()["error"]["message"]


# --- t2: sampling boundaries (the evaluator's prompt and budget) -------------------------------


@pytest.mark.parametrize(
    "extra,expect",
    [({"temperature": t}, "2xx") for t in (0.0, 1.0, 1.1, 2.0)]
    + [({"top_p": p}, "2xx") for p in (0.01, 0.95, 1.0)]
    + [({"top_p": 0.0}, "2xx-or-4xx"), ({"top_p": 1.1}, "4xx")]
    + [({name: v}, "2xx") for name in ("frequency_penalty", "presence_penalty")
       for v in (-2, 0, 2)]
    + [({"n": 1}, "2xx"), ({"n": 2}, "2xx")],
)  # fmt: skip
def test_t2_sampling_boundaries(server, extra, expect) -> None:
    req = body_of(server, messages=[{"role": "user", "content": "hi"}], max_tokens=20, **extra)
    status = post(server, "/v1/chat/completions", req).status_code
    if expect == "2xx":
        assert 200 <= status < 300
    elif expect == "4xx":
        assert 400 <= status < 500
    else:  # direct backend: an engine may validly refuse top_p 0; a 5xx fails
        assert 200 <= status < 300 or 400 <= status < 500


# --- t4, t6, t12: instructions the answer must follow (content) --------------------------------


@pytest.mark.parametrize(
    "check,messages,marker",
    [
        ("t4a", [{"role": "user", "content": "Reply with exactly this string: _NO_SYSTEM"}],
         "_NO_SYSTEM"),
        ("t4b", [{"role": "system", "content": "Always reply with exactly: _SYSTEM_CONTROL"},
                 {"role": "user", "content": "anything"}], "_SYSTEM_CONTROL"),
        ("t6", [{"role": "user", "content": "Remember the secret word is BLUE_42."},
                {"role": "assistant", "content": "Got it, the secret word is BLUE_42."},
                {"role": "user", "content": "What is the secret word? Reply with only the word."}],
         "BLUE_42"),
        ("t12_chinese", [{"role": "user", "content": "Repeat exactly: '中文测试：你好世界'"}],
         "中文测试：你好世界"),
        ("t12_japanese", [{"role": "user", "content": "Repeat exactly: '日本語: こんにちは'"}],
         "こんにちは"),
        ("t12_emoji", [{"role": "user", "content": "Repeat exactly: 'Emoji: 🎉🚀✨🇨🇳'"}], "🎉"),
    ],
)  # fmt: skip
def test_t4_t6_t12_answer_follows_the_instruction(server, check, messages, marker) -> None:
    """2xx, thinking off honoured (no reasoning, visible content); the marker in the visible
    content is content (budget 4,096, capped)."""
    body = ok(chat(server, messages, max_tokens=budget(4096), temperature=0, **NO_THINK))
    reasoning, visible = reasoning_and_visible(body)
    assert not reasoning.strip() and visible
    content_criterion(check, marker in visible, repr(visible[:60]))


# --- t8 / t9: structured output ----------------------------------------------------------------


def test_t8_json_object(server) -> None:
    """t8: ``response_format: json_object``, thinking off, greedy, budget 4,096 (capped): the
    evaluator parses the visible content and wants name "Alice", age 30 (content). Protocol:
    2xx within the evaluator's time, the JSON grammar from the first token, and an answer that
    stopped parses as an object."""
    prompt = "Return a JSON object with keys 'name' and 'age'. Set name='Alice', age=30."
    start = time.monotonic()
    body = ok(chat(server, [{"role": "user", "content": prompt}], max_tokens=budget(4096),
                   temperature=0, response_format={"type": "json_object"}, **NO_THINK))  # fmt: skip
    assert time.monotonic() - start < 120  # the evaluator's default request timeout
    _json_check("t8", body)


def test_t9_json_schema(server) -> None:
    """t9: ``response_format: json_schema`` (person: name string, age integer, both required)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    start = time.monotonic()
    body = ok(chat(server, [{"role": "user", "content": "Output a person: name=Alice age=30"}],
                   max_tokens=budget(4096), temperature=0, response_format=fmt, **NO_THINK))  # fmt: skip
    assert time.monotonic() - start < 120
    parsed = _json_check("t9", body)
    assert parsed is None or (isinstance(parsed.get("name"), str)
                              and isinstance(parsed.get("age"), int))  # fmt: skip


def _json_check(check: str, body: dict[str, Any]) -> dict[str, Any] | None:
    reasoning, visible = reasoning_and_visible(body)
    finish = body["choices"][0]["finish_reason"]
    assert not reasoning.strip()
    assert visible.lstrip().startswith("{"), visible[:80]  # 1 in 248,320 without the grammar
    try:
        parsed = json.loads(visible)
    except ValueError:
        parsed = None
    if finish == "stop":
        assert isinstance(parsed, dict), visible[:200]
    else:
        assert finish == "length"
    content_criterion(check, isinstance(parsed, dict) and parsed.get("name") == "Alice"
                      and parsed.get("age") == 30, f"finish={finish} {visible[:80]!r}")  # fmt: skip
    return parsed


# --- t10, t14-t16 ------------------------------------------------------------------------------


def test_t10_stop_word(server) -> None:
    """t10: stop ["15"]: 2xx, "1" in the content and "16" not (content: the model must count;
    the stop string itself is protocol, test_stop_string_is_honoured)."""
    prompt = "Count from 1 to 30, separated by single spaces. Output only the numbers."
    body = ok(chat(server, [{"role": "user", "content": prompt}], max_tokens=100, temperature=0,
                   stop=["15"], **NO_THINK))  # fmt: skip
    _, visible = reasoning_and_visible(body)
    assert "15" not in visible  # the server cut at the stop string wherever it appeared
    content_criterion("t10", "1" in visible and "16" not in visible, repr(visible[:60]))


@pytest.mark.parametrize(
    "check,body",
    [("t14", {}), ("t16a", {"messages": [{"content": "hi"}], "max_tokens": 5}),
     ("t16b", {"messages": [{"role": "user"}], "max_tokens": 5}),
     ("t16c", {"messages": [], "max_tokens": 5})],
)  # fmt: skip
def test_t14_t16_malformed_is_4xx(server, check, body) -> None:
    """The evaluator's client always adds ``model`` (so t14's "empty body" is ``{"model": m}``)."""
    resp = post(server, "/v1/chat/completions", body_of(server, **body))
    assert 400 <= resp.status_code < 500, (check, resp.text[:200])
    assert resp.json()["error"]["message"]


def test_t15_same_seed_greedy_twice_is_identical(server) -> None:
    """t15: seed 42, temperature 0, thinking off, twice: identical, non-empty visible answers
    (budget 4,096, capped)."""
    req = body_of(server, messages=[{"role": "user", "content": "Say hello in exactly one word."}],
                  max_tokens=budget(4096), temperature=0, seed=42, **NO_THINK)  # fmt: skip
    first = reasoning_and_visible(ok(post(server, "/v1/chat/completions", req)))[1]
    second = reasoning_and_visible(ok(post(server, "/v1/chat/completions", req)))[1]
    assert first and first == second


# --- the map: every check of the evaluator's catalog -> our tests ------------------------------

E = "test_evaluator_checks.py::"
# check id -> (our tests, the evaluator's pass criterion, can random weights pass it and why).
CHECKS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "d01_basic_nostream": ((E + "test_d01_basic_non_stream",
        "test_chat_basics.py::test_non_streaming_answer_with_the_openai_client"),
        "2xx, content or reasoning, completion_tokens > 0", "yes"),
    "d02_stream_usage": ((E + "test_d02_t7_stream_with_usage",
        "test_chat_basics.py::test_streaming_ends_with_a_usage_chunk_and_done"),
        ">= 5 data chunks, one [DONE], a usage chunk", "yes"),
    "d03_tool_call": ((E + "test_d03_t5_tool_call_auto", E + "test_d03_t5_tool_call_named",
        "test_tools.py::test_forced_tool_choice_returns_a_parsed_call"),
        "a tool call whose arguments parse as JSON (tool_choice auto by default, or named)",
        "no: auto needs the model to decide to call; named needs it to close the arguments"),
    "d04_reasoning": ((E + "test_d04_reasoning",),
        "reasoning + content > 20 chars containing '1' or 'one'", "by chance (content)"),
    "d05_multimodal": (("test_messages.py::test_image_data_url",),
        "2xx, answer > 15 chars; SKIP when the image probe is refused", "yes (SKIP text-only)"),
    "d06_cache_hit": ((E + "test_d06_cache_hit_the_evaluators_way",
        "test_chat_basics.py::test_second_identical_prompt_is_served_from_the_prefix_cache"),
        "2nd stream of a ~2.9K-token prompt: cached_tokens > 0", "yes"),
    "d07_reasoning_plus_content": ((E + "test_d07_reasoning_split_into_its_own_field",),
        "reasoning_content > 20 and content > 20; SKIP if cut inside the reasoning",
        "SKIP: a random model never closes </think>"),
    "d08_image_url_blocked": (("test_media_urls.py::test_the_evaluators_remote_image_is_refused",
        "test_media_urls.py::test_a_remote_image_is_not_fetched"),
        "HTTP >= 400 for a remote image_url; SKIP when text-only", "yes"),
    "d09_thinking_disable_top": ((E + "test_d09_d10_thinking_off",
        "test_reasoning.py::test_thinking_off_gives_content_only"),
        "no reasoning, content contains '4', < 100 chars", "no: '4' in a short answer"),
    "d10_thinking_disable_ctk": ((E + "test_d09_d10_thinking_off",),
        "as d09, via chat_template_kwargs", "no: '4' in a short answer"),
    **{k: ((E + "test_t1_thinking_switch",), c, "yes") for k, c in (
        ("t1a_thinking_true", "reasoning > 0"), ("t1b_thinking_false", "reasoning == 0"),
        ("t1c_thinking_default", "reasoning > 0 (default on)"))},
    **{k: ((E + "test_t2_sampling_boundaries", "test_sampling.py"), c, "yes") for k, c in (
        ("t2_temperature_0_0", "2xx"), ("t2_temperature_1_0", "2xx"),
        ("t2_temperature_1_1", "2xx"), ("t2_temperature_2_0", "2xx"),
        ("t2_top_p_0_0", "direct: 2xx or 4xx"), ("t2_top_p_0_01", "2xx"),
        ("t2_top_p_0_95", "2xx"), ("t2_top_p_1_0", "2xx"), ("t2_top_p_1_1", "4xx"),
        ("t2_frequency_penalty_neg2", "2xx"), ("t2_frequency_penalty_0", "2xx"),
        ("t2_frequency_penalty_2", "2xx"), ("t2_presence_penalty_neg2", "2xx"),
        ("t2_presence_penalty_0", "2xx"), ("t2_presence_penalty_2", "2xx"),
        ("t2_n_1", "2xx"), ("t2_n_2", "2xx"))},
    "t3_max_tokens_none": ((E + "test_t3_none",
        "test_lengths.py::test_no_max_tokens_is_served_in_bounded_time"),
        "2xx within the timeout, finish 'stop'", "no: 'stop' needs the model to end"),
    "t3_max_tokens_1": ((E + "test_t3_small_budgets_end_with_length",
        "test_lengths.py::test_chat_exact_lengths"), "2xx, finish 'length'", "yes"),
    "t3_max_tokens_64": ((E + "test_t3_small_budgets_end_with_length",
        "test_lengths.py::test_chat_exact_lengths"), "2xx, finish 'length'", "yes"),
    "t3_max_tokens_mid": ((E + "test_t3_large_budgets_are_accepted",),
        "min(65536, ctx - 2048): 2xx, finish 'stop'", "no: 'stop' needs the model to end"),
    "t3_max_tokens_max": ((E + "test_t3_large_budgets_are_accepted",
        "test_lengths.py::test_budget_above_what_the_prompt_leaves_is_fitted"),
        "ctx - 2048 (PLATFORM.md: ctx): 2xx, finish 'stop'", "no: 'stop' needs the model to end"),
    "t3_max_tokens_neg1": ((E + "test_t3_budgets_refused",
        "test_lengths.py::test_invalid_budgets_are_refused_before_the_engine"), "4xx", "yes"),
    "t3_max_tokens_over": ((E + "test_t3_budgets_refused",
        "test_lengths.py::test_invalid_budgets_are_refused_before_the_engine"),
        "ctx + 1: 4xx", "yes"),
    **{k: ((E + "test_t4_t6_t12_answer_follows_the_instruction",), c, "no: echo a marker")
       for k, c in (("t4a_no_system", "content has _NO_SYSTEM"),
                    ("t4b_system_control", "content has _SYSTEM_CONTROL"),
                    ("t6_multi_turn", "content has BLUE_42"),
                    ("t12_chinese", "content has 中文测试：你好世界"),
                    ("t12_japanese", "content has こんにちは"), ("t12_emoji", "content has 🎉"))},
    "t5_function_calling": ((E + "test_d03_t5_tool_call_auto", E + "test_d03_t5_tool_call_named"),
        "as d03", "no: as d03"),
    "t7_streaming_sse": ((E + "test_d02_t7_stream_with_usage",), "as d02", "yes"),
    "t8_json_object": ((E + "test_t8_json_object", "test_structured_and_auth.py::test_json_object"),
        "content parses, name == 'Alice', age == 30", "no: the values are content"),
    "t9_json_schema": ((E + "test_t9_json_schema", "test_structured_and_auth.py::test_json_schema"),
        "content parses, name == 'Alice', age == 30", "no: the values are content"),
    "t10_stop_word": ((E + "test_t10_stop_word",
        "test_structured_and_auth.py::test_stop_string_is_honoured"),
        "stop ['15']: '1' in content, '16' not", "by chance: the model must count"),
    "t11a_no_auth": ((E + "test_evaluator_reads_the_server_as_a_bare_engine",
        "test_structured_and_auth.py::test_platform_yaml_has_keys_off"),
        "direct and no --api-key: SKIP", "SKIP"),
    "t11b_wrong_auth": ((E + "test_evaluator_reads_the_server_as_a_bare_engine",
        "test_structured_and_auth.py::test_missing_or_wrong_api_key_is_401"),
        "direct and no --api-key: SKIP", "SKIP"),
    "t13_multimodal_base64": (("test_messages.py::test_several_images_in_one_prompt",),
        "a 4096x4096 four-quadrant PNG: all four colours named; SKIP when text-only",
        "no: the colours are content (SKIP text-only)"),
    "t14_empty_body": ((E + "test_t14_t16_malformed_is_4xx",
        "test_messages.py::test_malformed_requests_are_4xx_with_an_error_body"), "4xx", "yes"),
    "t15_idempotency_seed": ((E + "test_t15_same_seed_greedy_twice_is_identical",
        "test_sampling.py::test_same_seed_gives_the_same_output"),
        "seed 42, temperature 0, twice: equal, non-empty", "yes"),
    "t16a_missing_role": ((E + "test_t14_t16_malformed_is_4xx",), "4xx", "yes"),
    "t16b_missing_content": ((E + "test_t14_t16_malformed_is_4xx",
        "test_messages.py::test_message_without_content_is_a_400"), "4xx", "yes"),
    "t16c_empty_messages": ((E + "test_t14_t16_malformed_is_4xx",), "4xx", "yes"),
}  # fmt: skip


def test_every_evaluator_check_maps_to_existing_tests() -> None:
    """56 checks (10 d-checks, 46 t-checks), each covered by tests that exist in this suite."""
    import ast
    from pathlib import Path

    assert len(CHECKS) == 56
    assert sum(k.startswith("d") for k in CHECKS) == 10
    here = Path(__file__).parent
    for check, (tests, criterion, verdict) in CHECKS.items():
        assert criterion and verdict, check
        for ref in tests:
            path, _, name = ref.partition("::")
            tree = ast.parse((here / path).read_text())
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert not name or name in names, (check, ref)
