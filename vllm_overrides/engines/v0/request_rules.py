"""Request rules of the platform line: bodies our 0.32.0 line serves, mapped onto vLLM 0.6.3.

They run after the shared rules (``vllm_overrides.request_compat``), on the decoded JSON body,
before vLLM 0.6.3 validates it. 0.6.3's request models forbid every field they do not declare
(``extra="forbid"``, down to each message and content part) and lack fields agents send, so
without these a body that the 0.32.0 line serves is a 400 here. Nothing is added to what the
model is asked to generate; fields 0.6.3 cannot act on are dropped the way vLLM 0.32.0 ignores
unknown fields (a warning in the log). The rules:

- ``max_completion_tokens`` becomes ``max_tokens`` (the shared rule already chose the budget);
- ``reasoning_effort``: ``"none"`` turns thinking off, like vLLM 0.32.0; other levels have no
  effect on Qwen's template and are dropped;
- ``tool_choice: "none"`` / ``"required"`` (0.6.3 refuses both) travel in the ``MARKER_HEADER``
  request header to ``engines/v0/serving.py``, which applies them;
- ``response_format: json_schema`` (0.6.3 accepts and ignores it) becomes ``guided_json``;
  ``json_object`` becomes ``guided_regex`` :data:`JSON_OBJECT_REGEX`, a JSON object nested at
  most two deep (its values: strings, numbers, booleans, null, or objects / arrays of those).
  0.6.3's own json_object path is outlines' Lark grammar (``CFGGuide``), which compiles regex
  guides for each terminal inside the engine's step and ships a 19.7 MB pickle (the adapted
  tokenizer) with every request: 150 s for 64 tokens of the tiny model on the stand-in, twice in
  a row, so the platform's t8 (4,096 tokens, 300 s) could not finish. An "any object" JSON
  schema was worse (333 s to build its index). The regex's index is built once per process
  (~110 s cold on the loaded two-core stand-in, then outlines' disk cache: ~2 s) and costs
  ~0.1 s a step at most. The depth bound is what keeps that index small; it is the one way this
  json_object is narrower than the 0.32.0 line's;
- structured output (JSON, a regex / choice / grammar, a forced tool call) renders with thinking
  off unless the client asked for thinking: 0.6.3 applies the grammar from the first generated
  token, so inside an open think block it would fill the reasoning, never the answer. Asking for
  both is a 400, not an answer that silently lacks one;
- ``stream_options.include_usage`` alone means usage in the last chunk only (0.6.3's default
  would add a per-chunk usage whose count is the delta's);
- messages: ``reasoning_content`` / ``reasoning`` of an assistant turn goes back into its content
  as ``<think>...</think>`` (0.6.3 passes only role, content, name, tool calls and the tool call id
  to the template; our template splits the block off again and renders it as before); other
  keys 0.6.3 does not declare are dropped; a tool call's ``arguments`` that is not JSON becomes
  ``{}`` (0.6.3 parses every one and fails the request; vLLM 0.32.0 does the same coercion).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import Any

from vllm_overrides.request_compat import CompatError, _default_enable_thinking

logger = logging.getLogger("vllm.overrides.v0.request_rules")

MARKER_HEADER = b"x-vllm-overrides-tool-choice"

_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls"},
    "tool": {"role", "content", "tool_call_id", "name"},
    "function": {"role", "content", "name"},
}
_PART_KEYS = {
    "text": {"type", "text"},
    "image_url": {"type", "image_url"},
    "audio_url": {"type", "audio_url"},
    "refusal": {"type", "refusal"},
}
_TOOL_CALL_KEYS = {"id", "type", "function"}
_STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _json_object_regex(depth: int) -> str:
    """A JSON object whose values nest at most ``depth - 1`` levels below it (RFC 8259 tokens).

    Counted repetitions are left out on purpose: each one multiplies the automaton's states,
    and outlines walks the 248K-token vocabulary once per state to build the index."""
    ws = r"[ \t\n\r]*"
    string = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
    number = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
    primitive = f"({string}|{number}|true|false|null)"

    def obj(value: str) -> str:
        pair = f"{string}{ws}:{ws}{value}"
        return rf"\{{{ws}({pair}({ws},{ws}{pair})*)?{ws}\}}"

    def arr(value: str) -> str:
        return rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"

    value = primitive
    for _ in range(depth - 1):
        value = f"({primitive}|{obj(value)}|{arr(value)})"
    return obj(value)


JSON_OBJECT_REGEX = _json_object_regex(2)


def _thinking_asked(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True


def map_budget(body: dict[str, Any]) -> None:
    budget = body.pop("max_completion_tokens", None)
    if budget is not None:
        body["max_tokens"] = budget


def map_reasoning_effort(body: dict[str, Any]) -> None:
    if "reasoning_effort" not in body:
        return
    effort = body.pop("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise CompatError("'reasoning_effort' must be a string", "reasoning_effort")
    if effort == "none":
        _default_enable_thinking(body, False)


def map_tool_choice(body: dict[str, Any]) -> str | None:
    """Take out what 0.6.3 refuses; return the marker for the serving layer (or None)."""
    choice = body.get("tool_choice")
    if not body.get("tools"):
        # 0.6.3 refuses any tool_choice without tools; with no tools there is nothing to choose.
        if choice in ("none", "auto", None):
            body.pop("tool_choice", None)
        return None
    if choice in ("none", "required"):
        body.pop("tool_choice")
        return choice
    return None


def map_response_format(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind == "text":
        body.pop("response_format")
    elif kind == "json_object":
        if any(body.get(name) is not None for name in _STRUCTURED_FIELDS):
            raise CompatError(
                "'response_format' json_object and 'guided_*' cannot be combined",
                "response_format",
            )
        body.pop("response_format")
        body["guided_regex"] = JSON_OBJECT_REGEX
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise CompatError(
                "'response_format.json_schema.schema' must be a JSON schema object",
                "response_format",
            )
        if body.get("guided_json") is not None:
            raise CompatError(
                "'response_format' json_schema and 'guided_json' cannot be combined",
                "response_format",
            )
        body.pop("response_format")
        body["guided_json"] = schema


def structured_output_without_thinking(body: dict[str, Any], marker: str | None) -> None:
    fmt = body.get("response_format")
    structured = (
        any(body.get(name) is not None for name in _STRUCTURED_FIELDS)
        or (isinstance(fmt, dict) and fmt.get("type") == "json_object")
        or isinstance(body.get("tool_choice"), dict)
        or marker == "required"
    )
    if not structured:
        return
    if _thinking_asked(body):
        raise CompatError(
            "structured output (response_format, guided_*, a forced tool call) cannot be combined "
            "with thinking on this server: its grammar applies from the first generated token; "
            "turn thinking off (chat_template_kwargs.enable_thinking: false)",
            "response_format",
        )
    _default_enable_thinking(body, False)


def map_stream_options(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" not in options:
        options["continuous_usage_stats"] = False


def _fold_reasoning(message: dict[str, Any]) -> None:
    reasoning = message.pop("reasoning_content", None)
    other = message.pop("reasoning", None)
    if not isinstance(reasoning, str):
        reasoning = other if isinstance(other, str) else None
    if not reasoning:
        return
    block = f"<think>\n{reasoning}\n</think>\n\n"
    content = message.get("content")
    if content is None or isinstance(content, str):
        message["content"] = block + (content or "")
    elif isinstance(content, list):
        message["content"] = [{"type": "text", "text": block}, *content]


def _clean_arguments(call: dict[str, Any]) -> None:
    function = call.get("function")
    if not isinstance(function, dict):
        return
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            logger.warning("tool call arguments are not JSON; passed to the template as {}")
            function["arguments"] = "{}"
    elif args is None:
        function["arguments"] = "{}"


def map_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "assistant":
            _fold_reasoning(message)
        allowed = _MESSAGE_KEYS.get(role) if isinstance(role, str) else None
        if allowed is not None:
            for key in [k for k in message if k not in allowed]:
                message.pop(key)
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                keys = _PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
                if keys is not None:
                    for key in [k for k in part if k not in keys]:
                        part.pop(key)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    for key in [k for k in call if k not in _TOOL_CALL_KEYS]:
                        call.pop(key)
                    _clean_arguments(call)


def drop_unknown_fields(body: dict[str, Any], known: Collection[str]) -> list[str]:
    """Remove top-level fields 0.6.3's request model does not declare; return their names."""
    dropped = sorted(k for k in body if k not in known)
    for key in dropped:
        body.pop(key)
    if dropped:
        logger.warning("request fields not supported on this server, ignored: %s", dropped)
    return dropped


def adapt_chat_body(body: dict[str, Any], known: Collection[str]) -> str | None:
    """Apply every chat rule in place; return the tool-choice marker (or None)."""
    map_budget(body)
    map_reasoning_effort(body)
    marker = map_tool_choice(body)
    map_response_format(body)
    structured_output_without_thinking(body, marker)
    map_stream_options(body)
    map_messages(body)
    drop_unknown_fields(body, known)
    return marker


def adapt_completion_body(body: dict[str, Any], known: Collection[str]) -> None:
    map_response_format(body)
    map_stream_options(body)
    drop_unknown_fields(body, known)
