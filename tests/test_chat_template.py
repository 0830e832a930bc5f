"""Tests for chat_template_multi_system.jinja, the chat template the server starts with.

The golden vectors pin the canonical conversations byte-for-byte to the model's own Qwen3.5 /
Qwen3.6 template; the other tests pin what the template does where the reference raises or
renders a malformed prompt. Rendering goes through the same function Hugging Face and vLLM use
(same Jinja settings, same `tojson`), so a pass here is a pass in the server.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_PATH = REPO_ROOT / "chat_template_multi_system.jinja"
# CI clones the repository next to `shared/`, so the golden data sits at ../shared/golden.
GOLDEN_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
GOLDEN_FILE = GOLDEN_DIR / "qwen3_5_chat_template_vectors.jsonl"
GOLDEN_MISSING = (
    f"golden vectors not found at {GOLDEN_FILE}: the repository must be checked out next to "
    "`shared/` (CI layout ../shared/golden); without them the template is untested against the "
    "model's own rendering"
)

Message = dict[str, Any]

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
THINK_OPEN = "<|im_start|>assistant\n<think>\n"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _template() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def render(
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    **kwargs: Any,
) -> str:
    """Render like HF / vLLM do; enable_thinking is passed only when set, as a request would."""
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    rendered, _ = render_jinja_template(
        [copy.deepcopy(messages)],
        tools=copy.deepcopy(tools),
        chat_template=_template(),
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return rendered[0]


def diff_report(expected: str, rendered: str) -> str:
    """A readable account of where two prompts differ (escapes shown, so whitespace is visible)."""
    at = next(
        (i for i, (a, b) in enumerate(zip(expected, rendered, strict=False)) if a != b),
        min(len(expected), len(rendered)),
    )
    lo = max(0, at - 60)
    lines = [
        f"first difference at character {at} "
        f"(expected {len(expected)} chars, rendered {len(rendered)})",
        f"  expected: ...{expected[lo : at + 60]!r}",
        f"  rendered: ...{rendered[lo : at + 60]!r}",
        "line diff (each line shown as a Python literal):",
    ]
    lines += difflib.unified_diff(
        [repr(line) for line in expected.splitlines(keepends=True)],
        [repr(line) for line in rendered.splitlines(keepends=True)],
        "expected",
        "rendered",
        lineterm="",
    )
    return "\n".join(lines)


def assert_prompt(rendered: str, expected: str) -> None:
    if rendered != expected:
        pytest.fail(diff_report(expected, rendered), pytrace=False)


_TURN = re.compile(
    r"<\|im_start\|>(system|user|assistant)\n"
    r"(?:(?!<\|im_start\|>|<\|im_end\|>).)*"
    r"<\|im_end\|>\n",
    re.DOTALL,
)
_GENERATION_TAILS = (
    "<|im_start|>assistant\n<think>\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
)


def assert_well_formed(prompt: str, add_generation_prompt: bool = True) -> None:
    """The prompt is a run of complete ChatML turns (plus the generation prompt when asked)."""
    body = prompt
    if add_generation_prompt:
        tail = next((t for t in _GENERATION_TAILS if prompt.endswith(t)), None)
        assert tail is not None, f"no generation prompt at the end of {prompt!r}"
        body = prompt[: -len(tail)]
    pos = 0
    while pos < len(body):
        match = _TURN.match(body, pos)
        assert match is not None, (
            f"malformed turn at {pos}: {body[pos : pos + 120]!r}\nin {prompt!r}"
        )
        pos = match.end()
    # Tool responses only ever travel inside user turns.
    for match in _TURN.finditer(body):
        if "<tool_response>" in match.group(0):
            assert match.group(1) == "user", match.group(0)


# --- golden vectors -------------------------------------------------------------------------


def _load_golden() -> list[dict[str, Any]]:
    with GOLDEN_FILE.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _golden_params() -> list[Any]:
    # Collection must not crash or skip when the data is absent: the tests fail, saying why.
    if not GOLDEN_FILE.is_file():
        return [pytest.param(None, id="golden-vectors-missing")]
    return [pytest.param(case, id=case["id"]) for case in _load_golden()]


GOLDEN_PARAMS = _golden_params()


def _render_case(case: dict[str, Any], messages: list[Message]) -> str:
    return render(
        messages,
        tools=case["tools"],
        add_generation_prompt=case["add_generation_prompt"],
        enable_thinking=case["enable_thinking"],
    )


def test_golden_vectors_present() -> None:
    if not GOLDEN_FILE.is_file():
        pytest.fail(GOLDEN_MISSING, pytrace=False)
    ids = [case["id"] for case in _load_golden()]
    assert ids, f"{GOLDEN_FILE} holds no vectors"
    assert len(ids) == len(set(ids)), f"duplicate vector ids in {GOLDEN_FILE}"


@pytest.mark.parametrize("case", GOLDEN_PARAMS)
def test_golden_vector(case: dict[str, Any] | None) -> None:
    if case is None:
        pytest.fail(GOLDEN_MISSING, pytrace=False)
    assert_prompt(_render_case(case, case["messages"]), case["expected"])


def _as_vllm_openai_format(messages: list[Message]) -> list[Message]:
    """The conversation as vLLM 0.32 hands it over once it detects the "openai" content format.

    Mirrors vllm/renderers/chat_utils.py `_parse_chat_message_content`: content always a block
    list (null -> []); a tool result made only of text blocks joined by "\\n" into a string;
    reasoning sent as either field arriving in both `reasoning` and `reasoning_content`.
    """
    converted: list[Message] = []
    for message in copy.deepcopy(messages):
        content = message.get("content")
        if content is None:
            blocks: list[Any] = []
        elif isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        else:
            blocks = list(content)
        out: Message = {"role": message["role"], "content": blocks}
        if message["role"] == "tool":
            if all(block.get("type") == "text" for block in blocks):
                out["content"] = "\n".join(block["text"] for block in blocks)
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
        if message["role"] == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = message["tool_calls"]
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        converted.append(out)
    return converted


@pytest.mark.parametrize("case", GOLDEN_PARAMS)
def test_golden_vector_in_vllm_block_format(case: dict[str, Any] | None) -> None:
    """The same prompts come out when content arrives as vLLM's block lists."""
    if case is None:
        pytest.fail(GOLDEN_MISSING, pytrace=False)
    assert_prompt(_render_case(case, _as_vllm_openai_format(case["messages"])), case["expected"])


# --- system messages ------------------------------------------------------------------------


@pytest.mark.parametrize("late_role", ["system", "developer"])
def test_late_system_message_rendered_in_place(late_role: str) -> None:
    messages: list[Message] = [
        {"role": "system", "content": "Base rules."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": late_role, "content": "From now on answer in French."},
        {"role": "user", "content": "Q2"},
    ]
    prompt = render(messages)
    assert_prompt(
        prompt,
        "<|im_start|>system\nBase rules.<|im_end|>\n"
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>system\nFrom now on answer in French.<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n" + THINK_OPEN,
    )
    # The next turn of the same conversation extends this prompt, so the prefix cache hits.
    follow_up = [
        *messages,
        {"role": "assistant", "content": "R2"},
        {"role": "user", "content": "Q3"},
    ]
    assert render(follow_up).startswith(render(messages, add_generation_prompt=False))


def test_late_system_between_tool_results_keeps_turns_well_formed() -> None:
    messages: list[Message] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "A"}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "B"}},
                },
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "system", "content": "Be brief."},
        {"role": "tool", "content": "rain"},
    ]
    prompt = render(messages, tools=[WEATHER_TOOL])
    assert_well_formed(prompt)
    assert prompt.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n" + THINK_OPEN
    )


def test_leading_system_messages_merge_in_order_skipping_empty_ones() -> None:
    messages: list[Message] = [
        {"role": "system", "content": "  One.  "},
        {"role": "developer", "content": ""},
        {
            "role": "system",
            "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "."}],
        },
        {"role": "user", "content": "Hi"},
    ]
    assert_prompt(
        render(messages),
        "<|im_start|>system\nOne.\n\nTwo.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + THINK_OPEN,
    )


def test_empty_leading_system_without_tools_still_opens_a_turn() -> None:
    # The reference renders an empty first system message as an empty turn; so do we.
    assert_prompt(
        render([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]),
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + THINK_OPEN,
    )


# --- tool results ---------------------------------------------------------------------------


def test_tool_result_right_after_system_opens_user_turn() -> None:
    messages: list[Message] = [
        {"role": "system", "content": "Agent."},
        {"role": "tool", "content": "result one", "tool_call_id": "call_0"},
        {"role": "tool", "content": "result two", "tool_call_id": "call_1"},
    ]
    prompt = render(messages)
    assert_prompt(
        prompt,
        "<|im_start|>system\nAgent.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nresult one\n</tool_response>\n"
        "<tool_response>\nresult two\n</tool_response><|im_end|>\n" + THINK_OPEN,
    )
    assert_well_formed(prompt)


def test_tool_result_as_first_message_opens_user_turn() -> None:
    prompt = render([{"role": "tool", "content": "orphan result"}])
    assert_prompt(
        prompt,
        "<|im_start|>user\n<tool_response>\norphan result\n</tool_response><|im_end|>\n"
        + THINK_OPEN,
    )


# --- conversations without a user query ----------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        pytest.param(
            [{"role": "system", "content": "Only rules."}],
            "<|im_start|>system\nOnly rules.<|im_end|>\n" + THINK_OPEN,
            id="system-only",
        ),
        pytest.param(
            [{"role": "system", "content": "S"}, {"role": "assistant", "content": "Hello."}],
            "<|im_start|>system\nS<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n" + THINK_OPEN,
            id="system-assistant",
        ),
        pytest.param(
            [
                {"role": "system", "content": "S"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "Need data.",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                },
                {"role": "tool", "content": "42"},
            ],
            "<|im_start|>system\nS<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nNeed data.\n</think>\n\n"
            "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" + THINK_OPEN,
            id="trimmed-agent-history",
        ),
        pytest.param(
            [{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}],
            "<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n" + THINK_OPEN,
            id="user-turn-of-tool-responses-only",
        ),
    ],
)
def test_no_user_query_renders(messages: list[Message], expected: str) -> None:
    prompt = render(messages)
    assert_prompt(prompt, expected)
    assert_well_formed(prompt)


# --- tool calls -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    ['{"city": "Paris", oops', "not json at all", '{"city": "Paris"}', "  multi\nline  "],
)
def test_string_arguments_rendered_verbatim(arguments: str) -> None:
    messages: list[Message] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
    ]
    prompt = render(messages, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert prompt.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        + arguments
        + "\n</function>\n</tool_call><|im_end|>\n"
    ), prompt


def test_argument_values_scalars_and_nested() -> None:
    messages: list[Message] = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "arguments": {
                            "s": "text",
                            "n": 3,
                            "b": True,
                            "z": None,
                            "l": ["a", 1],
                            "m": {"k": "ü"},
                        },
                    },
                }
            ],
        },
    ]
    prompt = render(messages, add_generation_prompt=False)
    expected_params = "".join(
        f"<parameter={name}>\n{value}\n</parameter>\n"
        for name, value in [
            ("s", "text"),
            ("n", "3"),
            ("b", "true"),
            ("z", "null"),
            ("l", '["a", 1]'),
            ("m", '{"k": "ü"}'),
        ]
    )
    assert "<tool_call>\n<function=f>\n" + expected_params + "</function>\n</tool_call>" in prompt


# --- multimodal -----------------------------------------------------------------------------


def test_multiple_images_and_video() -> None:
    messages: list[Message] = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "Compare these."},
            ],
        },
        {"role": "assistant", "content": "Both red."},
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "And?"}],
        },
    ]
    assert_prompt(
        render(messages),
        f"<|im_start|>user\n{IMAGE}{IMAGE}Compare these.<|im_end|>\n"
        "<|im_start|>assistant\nBoth red.<|im_end|>\n"
        f"<|im_start|>user\n{VIDEO}{IMAGE}And?<|im_end|>\n" + THINK_OPEN,
    )
    numbered = render(messages, add_vision_id=True)
    assert f"Picture 1: {IMAGE}Picture 2: {IMAGE}Compare these." in numbered
    assert f"Video 1: {VIDEO}Picture 3: {IMAGE}And?" in numbered


def test_image_in_tool_result_and_system_renders_placeholder() -> None:
    # vLLM queues every image it parses, wherever it sits, and needs one placeholder per image.
    messages: list[Message] = [
        {"role": "system", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "user", "content": "Screenshot please."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "shot", "arguments": {}}}],
        },
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "done"}]},
    ]
    prompt = render(messages)
    assert prompt.startswith(f"<|im_start|>system\nLook:{IMAGE}<|im_end|>\n")
    assert f"<tool_response>\n{IMAGE}done\n</tool_response>" in prompt
    assert prompt.count(IMAGE) == 2


# --- reasoning ------------------------------------------------------------------------------


def _reasoning_conversation(**assistant_fields: Any) -> list[Message]:
    return [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Answer.", **assistant_fields},
    ]


def test_reasoning_synonym_used_when_reasoning_content_absent() -> None:
    prompt = render(
        _reasoning_conversation(reasoning="Thought it through."), add_generation_prompt=False
    )
    assert_prompt(
        prompt,
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThought it through.\n</think>\n\nAnswer.<|im_end|>\n",
    )


def test_reasoning_content_wins_over_reasoning() -> None:
    prompt = render(
        _reasoning_conversation(reasoning_content="Primary.", reasoning="Secondary."),
        add_generation_prompt=False,
    )
    assert "<think>\nPrimary.\n</think>\n\nAnswer." in prompt
    assert "Secondary." not in prompt


def test_reasoning_synonym_dropped_before_last_query_like_reasoning_content() -> None:
    messages = [
        *_reasoning_conversation(reasoning="Old thought."),
        {"role": "user", "content": "Q2"},
    ]
    prompt = render(messages)
    assert "Old thought." not in prompt
    assert "<|im_start|>assistant\nAnswer.<|im_end|>\n" in prompt


def test_preserve_thinking_keeps_past_reasoning() -> None:
    messages = [
        *_reasoning_conversation(reasoning="Old thought."),
        {"role": "user", "content": "Q2"},
    ]
    prompt = render(messages, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nOld thought.\n</think>\n\nAnswer.<|im_end|>\n" in prompt


@pytest.mark.parametrize(
    ("enable_thinking", "tail"),
    [(None, "<think>\n"), (True, "<think>\n"), (False, "<think>\n\n</think>\n\n")],
)
def test_enable_thinking_generation_prompt(enable_thinking: bool | None, tail: str) -> None:
    prompt = render([{"role": "user", "content": "Hi"}], enable_thinking=enable_thinking)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + tail


# --- robustness -----------------------------------------------------------------------------


ODD_CONVERSATIONS: list[Any] = [
    pytest.param([{"role": "user"}], id="missing-content"),
    pytest.param([{"role": "user", "content": None}], id="null-content"),
    pytest.param([{"role": "user", "content": ""}], id="empty-content"),
    pytest.param([{"role": "user", "content": []}], id="empty-block-list"),
    pytest.param(
        [{"role": "user", "content": {"type": "text", "text": "one block"}}], id="block-as-mapping"
    ),
    pytest.param(
        [
            {
                "role": "user",
                "content": ["bare string", {"type": "text", "text": None}, {"type": "audio"}, 7],
            }
        ],
        id="odd-blocks",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": None, "tool_calls": None},
        ],
        id="null-tool-calls",
    ),
    pytest.param(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": []}],
        id="empty-tool-calls",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "x"},
                    {"function": None},
                    {"function": {"name": None, "arguments": None}},
                    {"function": {"name": "f", "arguments": ["a", 1]}},
                    {"function": {"name": "g", "arguments": ""}},
                ],
            },
        ],
        id="broken-tool-calls",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "reasoning": None},
        ],
        id="null-reasoning",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>unclosed answer"},
        ],
        id="unclosed-think",
    ),
    pytest.param([{"role": "function", "name": "f", "content": "result"}], id="function-role"),
    pytest.param([{"role": "critic", "content": "Looks fine."}], id="custom-role"),
    pytest.param([{"content": "no role"}], id="missing-role"),
    pytest.param([{"role": "developer", "content": "Dev rules."}], id="developer-only"),
    pytest.param([{"role": "assistant", "content": "Hi"}], id="assistant-only"),
]


@pytest.mark.parametrize("messages", ODD_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_odd_shapes_render_without_raising(
    messages: list[Message], add_generation_prompt: bool
) -> None:
    prompt = render(messages, tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt)
    assert prompt.startswith("<|im_start|>")
    if all(
        message.get("role") in {"system", "developer", "user", "assistant", "tool", "function"}
        for message in messages
    ):
        assert_well_formed(prompt, add_generation_prompt)


def test_empty_messages_still_rejected() -> None:
    # Deliberate: vLLM 0.32 lets `messages: []` through, and this error is what makes it a 400.
    with pytest.raises(jinja2.exceptions.TemplateError, match="No messages provided"):
        render([])


# Built from single characters rather than st.text, and with no example database below: the
# test then writes no .hypothesis/ cache into the shared checkout.
_TEXT = st.lists(st.sampled_from(list("abc XYZ\n")), max_size=12).map("".join)
_BLOCK = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text}, _TEXT),
    st.just({"type": "image"}),
    st.just({"type": "video"}),
)
_CONTENT = st.one_of(st.none(), _TEXT, st.lists(_BLOCK, max_size=3))
_ARGUMENTS = st.one_of(
    st.none(),
    _TEXT,
    st.dictionaries(
        st.sampled_from(["a", "b"]), st.one_of(_TEXT, st.integers(), st.booleans(), st.none())
    ),
)
_TOOL_CALL = st.builds(
    lambda name, arguments: {
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    },
    st.sampled_from(["f", "g"]),
    _ARGUMENTS,
)


@st.composite
def _message(draw: st.DrawFn) -> Message:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]))
    message: Message = {"role": role, "content": draw(_CONTENT)}
    if role == "assistant":
        message["tool_calls"] = draw(st.one_of(st.none(), st.lists(_TOOL_CALL, max_size=2)))
        message["reasoning"] = draw(st.one_of(st.none(), _TEXT))
    return message


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    messages=st.lists(_message(), min_size=1, max_size=7),
    with_tools=st.booleans(),
    add_generation_prompt=st.booleans(),
    enable_thinking=st.sampled_from([None, True, False]),
)
def test_any_message_sequence_renders_well_formed(
    messages: list[Message],
    with_tools: bool,
    add_generation_prompt: bool,
    enable_thinking: bool | None,
) -> None:
    prompt = render(
        messages,
        tools=[WEATHER_TOOL] if with_tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    assert_well_formed(prompt, add_generation_prompt)
    # Leading system messages make one turn at most; every later message keeps its own place.
    leading = next(
        (i for i, m in enumerate(messages) if m["role"] not in {"system", "developer"}),
        len(messages),
    )
    late_systems = sum(m["role"] in {"system", "developer"} for m in messages[leading:])
    has_system_turn = bool(leading or with_tools)
    assert prompt.count("<|im_start|>system\n") == has_system_turn + late_systems


# --- the file itself and vLLM's view of it --------------------------------------------------


def test_template_has_no_carriage_return() -> None:
    data = TEMPLATE_PATH.read_bytes()
    assert b"\r" not in data, "CRLF or CR in the template: the platform choked on CRLF files before"


@pytest.mark.slow
def test_vllm_detects_block_content_and_forwards_kwargs() -> None:
    """vLLM decides from the template text how it hands content over and which kwargs pass."""
    from vllm.renderers import hf

    template = _template()
    # "openai" keeps text blocks apart and images as blocks; "string" would join text with "\n".
    assert hf._detect_content_format(template, default="string") == "openai"
    accepted = hf._resolve_chat_template_kwargs(template)
    assert {"enable_thinking", "preserve_thinking", "add_vision_id", "tools"} <= accepted
    # Loop-local names must not be accepted as request chat_template_kwargs.
    assert not {"content", "reasoning_content", "part", "query"} & accepted
    # Developer messages reach the template instead of being merged by vLLM into the first system
    # message (which would move later system text and break the prefix cache).
    assert hf._detect_developer_role_support(template)
