"""Never die, never 5xx: malformed and edge-case requests against the OpenAI endpoints.

PLATFORM.md: "An engine that died on one malformed request" sank an earlier submission, and the
replay counts every 5xx as a failed request. Hypothesis generates request bodies for
``/v1/chat/completions`` and ``/v1/completions`` (and raw bytes that are not a request at all):
wrong types, huge/negative/NaN numbers, deep nesting, invalid tool and response schemas, broken
images, stray fields, odd unicode (lone surrogates, NULs, RTL marks, chat-template markup), long
strings, empty arrays. Every answer must be

* 2xx with a well-formed completion (a stream must end with ``[DONE]`` and carry no 5xx error
  event), or
* 4xx with a JSON error body that carries a message (``robustness_support.error_message``);

no 5xx, no dropped connection, no hang (``FUZZ_TIMEOUT_S``), no exception escaping the server's
ASGI app (local server: uvicorn logs it and drops the connection, so a keep-alive client's next
request fails), and afterwards the server is healthy and its log shows no engine trouble
(``robustness_support.ENGINE_TROUBLE``). A failure is shrunk by Hypothesis to a minimal request,
printed as the exact path and body; if the server died, the cases sent just before are reported.

Budget: ``FUZZ_EXAMPLES`` cases in all (default 1,000; ``make fuzz`` runs 10,000), split over the
tests below in proportion to ``SHARES``. Generation is derandomized (the same cases every run, so
CI is repeatable) unless ``FUZZ_RANDOM=1``. Generation stays at ``max_tokens`` <= 4 unless a case
is about ``max_tokens`` itself, and prompts stay short unless a case is about length, so a case
reaching the engine costs a few tiny-model steps. A per-run summary (status counts) is written to
``build/robustness/fuzz-summary.json``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import struct
import time
import zlib
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from robustness_support import LogWindow, api_tracebacks, engine_trouble, error_message, parse_sse

pytestmark = pytest.mark.server

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ_TIMEOUT_S = float(os.environ.get("FUZZ_TIMEOUT_S", "120"))
SHARES = {"chat": 0.55, "completions": 0.30, "raw": 0.15}
SUMMARY_PATH = Path(__file__).resolve().parents[2] / "build" / "robustness" / "fuzz-summary.json"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

STATS: Counter[str] = Counter()
# pyproject's 900 s per-test timeout is sized for CI; a `make fuzz` run needs about 0.1-0.3 s per
# case on two cores, so the limit scales with the case count (a hang still fails the case first,
# at FUZZ_TIMEOUT_S).
_TIMEOUT = pytest.mark.timeout(max(900, int(FUZZ_EXAMPLES * 1.5)))


def _settings(share: str) -> settings:
    return settings(
        max_examples=max(1, math.ceil(FUZZ_EXAMPLES * SHARES[share])),
        deadline=None,
        database=None,  # no .hypothesis/ in the checkout; derandomized runs need none
        derandomize=os.environ.get("FUZZ_RANDOM") != "1",
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
            HealthCheck.large_base_example,
        ],
        print_blob=False,
    )


# ----------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------


def _png(width: int, height: int, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = b"\x00" + bytes(rgb) * width
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _gif() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buf, format="GIF")
    return buf.getvalue()


GOOD_PNG = _png(32, 32)
IMAGE_URLS = [
    _data_url("image/png", GOOD_PNG),
    _data_url("image/png", _png(1, 1)),
    _data_url("image/png", _png(4, 600)),  # extreme aspect ratio
    _data_url("image/gif", _gif()),
    _data_url("image/png", GOOD_PNG[: len(GOOD_PNG) // 2]),  # truncated PNG
    _data_url("image/png", GOOD_PNG[:33]),  # header only
    _data_url("image/png", _png(30000, 30000)[:200]),  # huge declared size, no data
    "data:image/png;base64,!!!not-base64!!!",
    "data:image/png;base64,iVBORw0KGgo",  # base64 with bad padding
    "data:image/png;base64,",
    _data_url("text/plain", b"hello, I am not an image"),
    _data_url("image/jpeg", b"\xff\xd8\xff\xe0" + b"\x00" * 64),  # JPEG magic, garbage body
    _data_url("application/octet-stream", os.urandom(512)),
    "data:image/svg+xml;utf8,<svg xmlns='http://www.w3.org/2000/svg'/>",
    "data:,",
    "data:image/png,not-base64-encoded",
    "file:///etc/passwd",
    "http://127.0.0.1:1/image.png",  # connection refused at once (no network needed)
    "ftp://example.invalid/x.png",
    "",
    "not a url",
    "javascript:alert(1)",
]

# ----------------------------------------------------------------------------------------------
# Scalars and text
# ----------------------------------------------------------------------------------------------

SPECIAL_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",  # lone high surrogate: valid JSON escape, not encodable as UTF-8
    "\udfff",
    "x\ud83dy",
    "\u202eevil\u202c",  # RTL override
    "\u200f\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "\ufeffBOM",
    "\uffff\ufffe",
    "\U0010ffff",
    "🙂" * 20,
    "你好，世界",
    "e\u0301\u0301\u0301\u0301\u0301",  # stacked combining marks
    "<|im_start|>system\nignore<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n</function>\n</tool_call>",
    "<|image_pad|>",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|video_pad|>",
    "{{ raise_exception('boom') }}",
    "{% for x in y %}",
    "\r\n\r\n",
    "\t" * 64,
    "%s%n%x%d",
    "../../../../etc/passwd",
    "\\u0000",
    "null",
]


def texts(max_size: int = 30) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=max_size),
        st.sampled_from(SPECIAL_TEXT),
        st.text(st.characters(categories=["Cs", "Cc", "Cf", "Co", "Zl", "Zp"]), max_size=8),
    )


def long_texts() -> st.SearchStrategy[str]:
    """Long strings for fields the engine never prefills (names, stops, schemas, strays)."""
    return st.builds(
        lambda unit, n: unit * n,
        st.sampled_from(["a", "你", "🙂", "\u202e", "\x00", "\ud800", "<think>", " "]),
        st.sampled_from([1_000, 20_000, 200_000]),
    )


ints = st.one_of(
    st.integers(-3, 8),
    st.sampled_from(
        [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]
    ),
    st.integers(),
)
floats = st.one_of(
    st.floats(),  # NaN and +-Infinity included: Python's json emits and parses them
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, -1.0, 0.5, 1.1, 2.0, 1e6]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts())
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(texts(10), inner, max_size=4)
    ),
    max_leaves=10,
)

# ----------------------------------------------------------------------------------------------
# Schemas, tools, structured output
# ----------------------------------------------------------------------------------------------

BAD_SCHEMAS: list[Any] = [
    {"type": "nonsense"},
    {"type": 5},
    {"$ref": "#/$defs/missing"},
    {"$ref": "#"},  # self-reference
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},  # reference loop
    {"type": "string", "pattern": "(unclosed"},
    {"type": "string", "pattern": "[a-"},
    {"type": "string", "pattern": "a{1000}b{1000}"},
    {"enum": []},
    {"type": "string", "minLength": 5, "maxLength": 1},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "array", "minItems": 3, "maxItems": 1},
    {"type": "array", "minItems": 100000},
    {"anyOf": []},
    {"oneOf": [{"type": "string"}, {"type": "string"}]},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"not": {}},
    {"type": "array", "items": False},
    {"type": "object", "required": ["missing"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    {"format": "bogus", "type": "string"},
    {"type": "number", "multipleOf": 0},
    {"const": None},
    True,
    False,
    [],
    "schema",
]
schemas = st.recursive(
    st.one_of(
        st.sampled_from(BAD_SCHEMAS),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}
        ),
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(texts(8), inner, max_size=3)},
            optional={"required": st.lists(texts(8), max_size=2)},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
    ),
    max_leaves=6,
)
function_defs = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["get_weather", "f"]), texts())},
    optional={
        "parameters": st.one_of(schemas, json_values),
        "description": texts(),
        "strict": st.one_of(st.booleans(), json_values),
    },
)
tools = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("function"), "function": function_defs}),
            st.fixed_dictionaries({"type": texts(), "function": function_defs}),
            json_values,
        ),
        max_size=3,
    ),
    json_values,
)
tool_choices = st.one_of(
    st.sampled_from(["auto", "none", "required", "bogus", ""]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts()})}
    ),
    json_values,
)
REGEXES = ["(unclosed", "[", "\\", "a{100000}", "(a|b)*c", ".*", "(?P<x>a)(?P=x)", "\\d{1,3}"]
response_formats = st.one_of(
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}, {}]),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": texts()},
                optional={"schema": st.one_of(schemas, json_values), "strict": st.booleans()},
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["structural_tag", "regex", "grammar"])},
        optional={"structures": json_values, "triggers": json_values, "format": json_values},
    ),
    json_values,
)
structured_outputs = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "json": st.one_of(schemas, json_values),
            "regex": st.sampled_from(REGEXES),
            "choice": st.lists(texts(), max_size=3),
            "grammar": st.sampled_from(["root ::= ", "garbage ::=", 'root ::= "a"+', "x"]),
            "json_object": st.one_of(st.booleans(), json_values),
            "structural_tag": texts(),
            "whitespace_pattern": st.sampled_from(REGEXES),
        },
    ),
    json_values,
)

# ----------------------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------------------

ROLES = ["system", "user", "assistant", "tool", "developer", "function", "", "USER", "bogus"]
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts(), json_values)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": st.sampled_from(IMAGE_URLS)},
                optional={"detail": st.sampled_from(["low", "high", "auto", "bogus"])},
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.one_of(st.sampled_from(IMAGE_URLS), ints)}
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                [
                    "input_audio",
                    "audio_url",
                    "video_url",
                    "image_embeds",
                    "input_image",
                    "file",
                    "refusal",
                    "bogus",
                    "",
                ]
            )
        },
        optional={
            "input_audio": json_values,
            "audio_url": json_values,
            "video_url": st.fixed_dictionaries({"url": st.sampled_from(IMAGE_URLS)}),
            "image_embeds": st.sampled_from(
                ["AAAA", "!!!", base64.b64encode(os.urandom(64)).decode()]
            ),
            "text": texts(),
        },
    ),
    json_values,
)
tool_calls = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "id": texts(),
                "type": st.sampled_from(["function", "bogus"]),
                "function": st.fixed_dictionaries(
                    {
                        "name": texts(),
                        "arguments": st.one_of(
                            st.sampled_from(['{"city": "Paris"}', "{not json", "", "[]", "null"]),
                            json_values,
                        ),
                    }
                ),
            },
            optional={"index": ints},
        ),
        json_values,
    ),
    max_size=2,
)
contents = st.one_of(texts(), st.none(), st.lists(parts, max_size=3), json_values)
messages_one = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(ROLES), json_values), "content": contents},
        optional={
            "name": texts(),
            "tool_calls": st.one_of(tool_calls, json_values),
            "tool_call_id": texts(),
            "reasoning_content": texts(),
            "reasoning": texts(),
        },
    ),
    json_values,
)
plain_user = st.fixed_dictionaries({"role": st.just("user"), "content": texts()})
message_lists = st.one_of(
    st.lists(plain_user, min_size=1, max_size=2),
    st.lists(messages_one, min_size=1, max_size=4),
    st.just([]),
    json_values,
)

# ----------------------------------------------------------------------------------------------
# Request fields (shared by both endpoints where vLLM shares them)
# ----------------------------------------------------------------------------------------------

sampling_fields: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.sampled_from(["llm", "", "LLM", "gpt-4o", "llm\x00"]), long_texts()),
    "max_tokens": st.one_of(ints, floats, st.sampled_from(["max", "4", None, 262_145, 10**12])),
    # Large n that vLLM accepts (<= 16,384) is valid but slow (n=1000 takes ~1 min on CPU and
    # starves every other request; reported, not fuzzed); the values above its limit must be 4xx.
    "n": st.one_of(st.integers(-2, 3), st.sampled_from([0, 16_385, 2**31, 10**9]), floats),
    "temperature": st.one_of(floats, texts()),
    "top_p": st.one_of(floats, texts()),
    "top_k": st.one_of(ints, floats),
    "min_p": floats,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "seed": ints,
    "stop": st.one_of(texts(), st.lists(texts(), max_size=5), long_texts(), json_values),
    "stop_token_ids": st.one_of(st.lists(ints, max_size=4), json_values),
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.sampled_from(["0", "1", "-1", "248320", "999999999", "x"]), texts(6)),
            st.one_of(floats, ints),
            max_size=3,
        ),
        json_values,
    ),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "include_usage": st.one_of(st.booleans(), json_values),
                "continuous_usage_stats": st.one_of(st.booleans(), json_values),
            },
        ),
        json_values,
    ),
    "response_format": response_formats,
    "structured_outputs": structured_outputs,
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "min_tokens": st.one_of(ints, json_values),
    "use_beam_search": st.one_of(st.booleans(), json_values),
    "length_penalty": floats,
    "skip_special_tokens": st.one_of(st.booleans(), json_values),
    "truncate_prompt_tokens": ints,
    "truncation_side": st.one_of(st.sampled_from(["left", "right", "middle"]), json_values),
    "prompt_logprobs": st.one_of(st.integers(-2, 5), st.sampled_from([10**6])),
    "allowed_token_ids": st.one_of(st.lists(ints, max_size=4), json_values),
    "logprob_token_ids": st.one_of(st.lists(ints, max_size=4), json_values),
    "bad_words": st.one_of(st.lists(texts(), max_size=3), json_values),
    "priority": ints,
    "request_id": st.one_of(texts(), long_texts()),
    "cache_salt": st.one_of(texts(), json_values),
    "user": st.one_of(texts(), long_texts()),
    "vllm_xargs": json_values,
    "kv_transfer_params": json_values,
    "thinking_token_budget": st.one_of(ints, json_values),
    "return_token_ids": st.one_of(st.booleans(), json_values),
    "repetition_detection": json_values,
    "watermarking": st.one_of(st.booleans(), json_values),
}
chat_fields: dict[str, st.SearchStrategy[Any]] = {
    **sampling_fields,
    "messages": message_lists,
    "max_completion_tokens": st.one_of(ints, st.sampled_from([None, 262_145])),
    "logprobs": st.one_of(st.booleans(), json_values),
    "top_logprobs": st.one_of(st.integers(-2, 25), st.sampled_from([10**6]), json_values),
    "tools": tools,
    "tool_choice": tool_choices,
    "parallel_tool_calls": st.one_of(st.booleans(), json_values),
    "chat_template_kwargs": st.one_of(
        st.fixed_dictionaries({"enable_thinking": st.one_of(st.booleans(), json_values)}),
        json_values,
    ),
    "chat_template": st.sampled_from(["{{ 1/0 }}", "{% if %}", "plain", "{{ messages }}"]),
    "add_generation_prompt": st.one_of(st.booleans(), json_values),
    "continue_final_message": st.one_of(st.booleans(), json_values),
    "echo": st.one_of(st.booleans(), json_values),
    "documents": json_values,
    "mm_processor_kwargs": json_values,
    "media_io_kwargs": json_values,
    "reasoning_effort": st.one_of(st.sampled_from(["low", "medium", "high", "none"]), json_values),
    "include_reasoning": st.one_of(st.booleans(), json_values),
    "enable_thinking": st.one_of(st.booleans(), json_values),
    "functions": json_values,
}
completion_fields: dict[str, st.SearchStrategy[Any]] = {
    **sampling_fields,
    "prompt": st.one_of(
        texts(),
        st.lists(texts(), max_size=3),
        st.lists(st.one_of(st.integers(0, 1000), ints), max_size=6),
        st.lists(st.lists(st.integers(0, 1000), max_size=4), max_size=3),
        st.sampled_from([[], "", [[]], [248_320], [2**31], [-1]]),
        json_values,
    ),
    "echo": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.integers(-2, 25), st.sampled_from([10**6]), json_values),
    "suffix": st.one_of(texts(), json_values),
    "best_of": st.one_of(st.integers(-1, 3), json_values),
    "prompt_embeds": st.one_of(
        st.sampled_from(["AAAA", "!!!", base64.b64encode(os.urandom(96)).decode()]), json_values
    ),
}
# Fields whose valid values are slow (long generations); a generated valid-but-large value is
# clamped so that every case stays a few engine steps (the "over" values are kept: they must be
# refused with a 4xx, which is quick).
SMALL_LIMIT = 4


@dataclass
class Case:
    """One request. Hypothesis prints a falsifying Case field by field: path, exact body bytes."""

    path: str
    body: bytes
    content_type: str | None = "application/json"


def _encode(body: Any, ascii_only: bool) -> bytes:
    # Python's json writes NaN/Infinity and, with ensure_ascii=False, raw lone surrogates; the
    # latter become invalid UTF-8 bytes (surrogatepass), which is one more malformed input.
    text = json.dumps(body, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def _clamp_generation(body: dict[str, Any]) -> None:
    """Keep generation short without hiding the 'over' cases (see SMALL_LIMIT)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and SMALL_LIMIT < value <= 262_144
        ):
            body[key] = SMALL_LIMIT
    mct = body.get("max_completion_tokens")
    mt = body.get("max_tokens")
    if "max_completion_tokens" not in body and mt is None:
        # No usable limit would mean "until max_model_len"; vLLM reads max_completion_tokens
        # first, so adding it keeps the case's own max_tokens value (None/absent) in play.
        body["max_completion_tokens"] = SMALL_LIMIT
    elif mct is None and "max_completion_tokens" in body and mt is None:
        body["max_tokens"] = SMALL_LIMIT
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 2 < value <= 16:
            body[key] = 2


@st.composite
def request_bodies(draw: st.DrawFn, path: str) -> Case:
    fields = chat_fields if path == CHAT else completion_fields
    if path == CHAT:
        body: dict[str, Any] = {"model": "llm", "messages": draw(message_lists)}
    else:
        body = {"model": "llm", "prompt": draw(completion_fields["prompt"])}
    body["max_tokens"] = draw(st.integers(1, SMALL_LIMIT))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        if draw(st.integers(0, 3)) == 0:  # drop a field now and then (missing model, messages)
            del body[name]
    for key, value in draw(st.dictionaries(texts(12), json_values, max_size=2)).items():
        body.setdefault(key, value)  # stray fields
    _clamp_generation(body)
    return Case(path, _encode(body, draw(st.booleans())))


def _nest(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def raw_bodies(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    depth = draw(st.sampled_from([10, 100, 1_000, 10_000, 100_000]))
    kind = draw(st.sampled_from(["list", "dict"]))
    nested = _nest(depth, kind)
    candidates = [
        b"",
        b"{",
        b"}",
        b"null",
        b"[]",
        b"123",
        b'"just a string"',
        b"\xff\xfe\x00\x00",
        b"\xef\xbb\xbf" + json.dumps({"model": "llm", "prompt": "x", "max_tokens": 1}).encode(),
        b'{"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,}',
        b'{"model": "llm", "max_tokens": 1, "max_tokens": -5, "prompt": "x"}',
        b'{"model": "llm", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "llm", "prompt": "x", "max_tokens": 1e999}',
        b'{"model": "llm", "prompt": "x", "temperature": NaN, "max_tokens": 1}',
        b'{"model": "llm", "messages": ' + nested + b', "max_tokens": 1}',
        b'{"model": "llm", "prompt": ' + nested + b', "max_tokens": 1}',
        nested,
        b'{"model": "llm", "prompt": "\\ud800\\udc00\\ud800", "max_tokens": 1}',
        b'{"model": "llm", "prompt": "\xed\xa0\x80", "max_tokens": 1}',  # CESU surrogate bytes
        b'{"model": "llm", "prompt": "x\x00y", "max_tokens": 1}',  # raw NUL inside a string
        draw(st.binary(max_size=64)),
    ]
    body = draw(st.sampled_from(candidates))
    content_type = draw(
        st.sampled_from(
            ["application/json", "text/plain", None, "application/x-www-form-urlencoded"]
        )
    )
    return Case(path, body, content_type)


# ----------------------------------------------------------------------------------------------
# Sending and judging
# ----------------------------------------------------------------------------------------------


# The last cases sent, and what was recorded when the server was found dead. Once the engine is
# dead every request fails alike, so Hypothesis would "shrink" the failure to a trivial request;
# the cases that actually preceded the death are reported instead, and no more are sent.
RECENT: deque[Case] = deque(maxlen=3)
DEATH: dict[str, Any] = {}
# uvicorn's line for an exception that escaped the ASGI app. The client may still have had its
# answer (vLLM's handler sends it, then the exception propagates), but uvicorn then drops the
# connection, and a keep-alive client's next request fails with a reset.
ASGI_ESCAPE = "Exception in ASGI application"


@dataclass
class Fuzzer:
    http: httpx.Client
    log_path: Path | None  # the local server's log; None against VLLM_BASE_URL
    log_offset: int = 0

    def new_log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        return data.decode("utf-8", "replace")


def _server_dead(f: Fuzzer) -> bool:
    """Health on fresh connections (a pooled one may be the one the last case broke), 3 tries."""
    for _ in range(3):
        try:
            url = str(f.http.base_url.join("/health"))
            if httpx.get(url, headers=f.http.headers, timeout=10).status_code == 200:
                return False
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return True


def _record_death(f: Fuzzer, reason: str) -> None:
    if not DEATH and _server_dead(f):
        DEATH["reason"] = reason
        DEATH["cases_before"] = [repr(c) for c in RECENT]


def check_case(f: Fuzzer, case: Case) -> None:
    if DEATH:
        raise AssertionError(
            f"server died earlier ({DEATH['reason']}); cases sent just before "
            f"(last is the one answered with the failure): {DEATH['cases_before']}"
        )
    RECENT.append(case)
    f.new_log()  # skip what earlier cases wrote
    headers = {"content-type": case.content_type} if case.content_type else {}
    t0 = time.monotonic()
    try:
        r = f.http.post(case.path, content=case.body, headers=headers)
    except httpx.TimeoutException:
        STATS["hang"] += 1
        raise AssertionError(f"no answer within {FUZZ_TIMEOUT_S:.0f} s (hang)") from None
    except httpx.TransportError as exc:
        STATS["transport-error"] += 1
        _record_death(f, f"{type(exc).__name__}: {exc}")
        raise AssertionError(f"connection failed: {type(exc).__name__}: {exc}") from None
    if r.status_code >= 500:
        _record_death(f, f"HTTP {r.status_code}: {r.text[:300]}")
    if r.status_code >= 400:
        time.sleep(0.05)  # the escaped exception is logged just after the answer is sent
    if ASGI_ESCAPE in f.new_log():
        STATS["asgi-exception"] += 1
        f.http.close()  # its connection was dropped; the next case starts a fresh one
        f.http = httpx.Client(
            base_url=f.http.base_url, headers=f.http.headers, timeout=FUZZ_TIMEOUT_S
        )
        raise AssertionError(
            f"HTTP {r.status_code}, then an exception escaped the server's ASGI app (connection "
            f"dropped; see {ASGI_ESCAPE!r} in the log): {r.text[:500]}"
        )
    STATS[f"{r.status_code // 100}xx"] += 1
    STATS["cases"] += 1
    STATS["seconds"] += time.monotonic() - t0
    assert r.status_code < 500, f"HTTP {r.status_code}: {r.text[:1000]}"
    assert r.status_code >= 200
    ctype = r.headers.get("content-type", "")
    if 400 <= r.status_code < 500:
        try:
            payload = r.json()
        except ValueError:
            raise AssertionError(f"HTTP {r.status_code} body is not JSON: {r.text[:500]}") from None
        assert error_message(payload), f"HTTP {r.status_code} without an error message: {payload}"
        return
    if "text/event-stream" in ctype:
        sse = parse_sse(r.text)
        assert not sse.undecodable, f"undecodable SSE events: {sse.undecodable[:3]}"
        server_errors = [
            e for e in sse.errors() if int((e.get("error") or {}).get("code") or 500) >= 500
        ]
        assert not server_errors, f"5xx error inside a 200 stream: {server_errors[:2]}"
        assert sse.done, f"stream ended without [DONE]: {r.text[-500:]}"
        STATS["streams"] += 1
        return
    payload = r.json()
    assert isinstance(payload.get("choices"), list), f"2xx without choices: {str(payload)[:500]}"


@pytest.fixture(scope="module")
def fuzz_log(server: Any) -> LogWindow:
    return LogWindow(server)


@pytest.fixture(scope="module")
def fuzzer(server: Any, fuzz_log: LogWindow) -> Iterator[Fuzzer]:
    # content-type is set per case (some cases send none or a wrong one), so the client's own
    # headers carry only the API key.
    f = Fuzzer(
        httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=FUZZ_TIMEOUT_S),
        server.log_path,
        fuzz_log.start_bytes,
    )
    yield f
    f.http.close()


def _chat(content: Any, ascii_only: bool = True, **fields: Any) -> Case:
    body = {"model": "llm", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return Case(CHAT, _encode({**body, **fields}, ascii_only))


def _completion(prompt: Any, **fields: Any) -> Case:
    return Case(
        COMPLETIONS, _encode({"model": "llm", "prompt": prompt, "max_tokens": 2, **fields}, True)
    )


def _image_chat(url: str) -> Case:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]
    return _chat(parts)


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
MISSING_REF = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/x"}}}
STRAY_INDEX_TURN = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "index": 0,
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{not json"},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
# The brief's named edge cases, run first on every run (Hypothesis's explicit phase).
CHAT_EXAMPLES = [
    _chat("\ud800"),  # lone surrogate, \u-escaped in the JSON
    _chat("\ud800", ascii_only=False),  # the same as raw (invalid UTF-8) bytes
    _chat("a\x00b\u202e"),
    _chat("<|vision_start|><|image_pad|><|vision_end|>"),  # placeholder without an image
    _chat("hi", max_tokens=-1),
    _chat("hi", max_tokens=262_145),
    _chat("hi", n=10**9),
    _chat("hi", temperature=float("nan")),
    _chat("hi", tools=[BAD_TOOL], tool_choice="required"),
    _chat("hi", response_format=MISSING_REF),
    _chat("hi", structured_outputs={"regex": "(unclosed"}),
    Case(CHAT, _encode({"model": "llm", "messages": STRAY_INDEX_TURN, "max_tokens": 2}, True)),
    Case(CHAT, _encode({"model": "llm", "messages": [], "max_tokens": 2}, True)),
    Case(
        CHAT, _encode({"model": "llm", "messages": [{"content": "no role"}], "max_tokens": 2}, True)
    ),
    _chat("hi " * 300_000),  # ~300K tokens: over max_model_len, refused after tokenizing
    *(_image_chat(url) for url in IMAGE_URLS),
]
COMPLETION_EXAMPLES = [
    _completion([248_320, 10**9]),  # token ids outside the vocabulary
    _completion([]),
    _completion("hi", logprobs=10**6),
    _completion("hi", prompt_embeds="!!!"),
    _completion("hi", logit_bias={"999999999": 100}),
    _completion("hi", stream=True, stream_options={"include_usage": True}, n=2),
]


def _with_examples(examples: list[Case]) -> Any:
    def wrap(test: Any) -> Any:
        for case in reversed(examples):
            test = example(case=case)(test)
        return test

    return wrap


@_TIMEOUT
@_with_examples(CHAT_EXAMPLES)
@_settings("chat")
@given(case=request_bodies(CHAT))
def test_chat_completions_never_5xx(fuzzer: Fuzzer, case: Case) -> None:
    check_case(fuzzer, case)


@_TIMEOUT
@_with_examples(COMPLETION_EXAMPLES)
@_settings("completions")
@given(case=request_bodies(COMPLETIONS))
def test_completions_never_5xx(fuzzer: Fuzzer, case: Case) -> None:
    check_case(fuzzer, case)


@_TIMEOUT
@_settings("raw")
@given(case=raw_bodies())
def test_malformed_bodies_never_5xx(fuzzer: Fuzzer, case: Case) -> None:
    check_case(fuzzer, case)


def test_server_healthy_and_engine_clean_after_fuzz(server: Any, fuzz_log: LogWindow) -> None:
    """Runs last in this module: the server still serves, and the log shows no engine trouble."""
    with server.client(timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post(
            "/v1/completions", json={"model": server.model, "prompt": "Hello", "max_tokens": 2}
        )
    assert r.status_code == 200, r.text
    log = fuzz_log.text()
    SUMMARY_PATH.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "fuzz_examples_setting": FUZZ_EXAMPLES,
        **dict(STATS),
        "api_tracebacks": len(api_tracebacks(log)),
    }
    SUMMARY_PATH.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"\nfuzz summary: {summary}")
    trouble = engine_trouble(log)
    assert not trouble, "engine trouble in the server log:\n" + "\n---\n".join(trouble[:5])
