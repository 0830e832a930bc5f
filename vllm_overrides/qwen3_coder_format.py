"""The ``qwen3_coder`` tool-call format, read from model text; no vLLM imports.

Qwen3.5/3.6 (like Qwen3-Coder) write a call as XML-like markup, one parameter per element,
values as raw text rather than JSON::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

``parse`` reads a whole (or partial) answer: the content before the first call and every call
seen so far, each with its arguments converted to JSON values by the tool's parameter schema
(a raw string for ``string`` parameters, numbers, booleans and JSON objects / arrays parsed
where the schema says so, anything else parsed as JSON when it is JSON). Both engine lines wrap
it: vLLM 0.6.3 as a ``ToolParser`` plugin (``engines/v0/tool_parser.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

_FUNCTION_HEADER = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_HEADER = re.compile(r"<parameter=([^>\n]*)>")
# Where a parameter's value ends when its closing tag is missing.
_VALUE_END = re.compile(r"</parameter>|<parameter=|</function>")


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    complete: bool = False  # its </function> was seen


@dataclass
class ParsedAnswer:
    content: str  # the text before the first call (all of it when there is none)
    calls: list[ParsedCall]
    tools_started: bool  # a call's markup has begun (its header may still be incomplete)


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (``type``, a list of types, or ``anyOf``)."""
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get("type")
    found = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found |= _schema_types(option)
    enum = schema.get("enum")
    if not found and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        found = {"string"}
    return {str(k) for k in found}


def _as_json(raw: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(raw)
    except ValueError:
        return False, None


def convert_value(raw: str, schema: Any) -> Any:
    """One parameter's raw text as the JSON value its schema asks for."""
    kinds = _schema_types(schema)
    if kinds == {"string"} or (kinds and kinds <= {"string", "null"} and raw != "null"):
        return raw
    if raw.strip().lower() == "null" and (not kinds or "null" in kinds):
        return None
    if "boolean" in kinds and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    if kinds & {"integer", "number"}:
        text = raw.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and number == number and abs(number) != float("inf"):
            return int(number) if "integer" in kinds and number.is_integer() else number
    ok, value = _as_json(raw.strip())
    if ok and (not kinds or kinds & {"object", "array", "boolean", "integer", "number", "null"}):
        return value
    return raw


def _strip_value(raw: str) -> str:
    # The format puts the value on its own line(s): one newline after the header and one before
    # the closing tag belong to the markup, not to the value.
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _parse_body(body: str, schema: dict[str, Any], complete: bool) -> dict[str, Any]:
    """The parameters inside one ``<function=...>`` element (its body, header excluded).

    In a complete element the last value may end at ``</function>`` without its closing tag;
    in an incomplete one a value without an end is still being written and is left out.
    """
    args: dict[str, Any] = {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    pos = 0
    while True:
        header = _PARAMETER_HEADER.search(body, pos)
        if header is None:
            return args
        start = header.end()
        end = _VALUE_END.search(body, start)
        if end is None and not complete:
            return args
        stop = end.start() if end else len(body)
        name = header.group(1).strip()
        args[name] = convert_value(_strip_value(body[start:stop]), properties.get(name))
        if end is None:
            return args
        pos = end.end() if end.group(0) == PARAMETER_CLOSE else end.start()


def tool_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """``{name: parameters schema}`` from a request's ``tools`` (dicts or pydantic models)."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        if isinstance(tool, dict):
            function = tool.get("function")
        else:
            function = getattr(tool, "function", None)
        if function is None:
            continue
        if not isinstance(function, dict):
            function = {"name": function.name, "parameters": function.parameters}
        if isinstance(function.get("name"), str):
            found[function["name"]] = function.get("parameters") or {}
    return found


def _first(text: str, *markers: str) -> int:
    hits = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(hits) if hits else -1


def parse(text: str, schemas: dict[str, dict[str, Any]] | None = None) -> ParsedAnswer:
    """Content and calls of ``text``; a call whose header is incomplete is not listed."""
    schemas = schemas or {}
    start = _first(text, TOOL_CALL_OPEN, FUNCTION_OPEN)
    if start < 0:
        return ParsedAnswer(content=text, calls=[], tools_started=False)
    calls: list[ParsedCall] = []
    pos = start
    while True:
        header = _FUNCTION_HEADER.search(text, pos)
        if header is None:
            break
        end = text.find(FUNCTION_CLOSE, header.end())
        body = text[header.end() : end if end >= 0 else len(text)]
        name = header.group(1).strip()
        calls.append(
            ParsedCall(name, _parse_body(body, schemas.get(name, {}), end >= 0), complete=end >= 0)
        )
        if end < 0:
            break
        pos = end + len(FUNCTION_CLOSE)
    return ParsedAnswer(content=text[:start], calls=calls, tools_started=True)


def held_back(text: str) -> int:
    """How many trailing characters could be the start of a call's opening markup."""
    for n in range(min(len(FUNCTION_OPEN), len(text)), 0, -1):
        tail = text[-n:]
        if TOOL_CALL_OPEN.startswith(tail) or FUNCTION_OPEN.startswith(tail):
            return n
    return 0


def arguments_json(call: ParsedCall) -> str:
    """The OpenAI ``arguments`` string of a call.

    ``json.dumps``' defaults (ASCII escapes, ", " and ": "): vLLM 0.6.3's stream generator
    re-serialises the last call's arguments this way to check that nothing was left unsent.
    """
    return json.dumps(call.arguments)
