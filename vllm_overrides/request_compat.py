"""Request-side compatibility rules, as pure functions on the decoded JSON body.

Each rule either rewrites a request the server can serve into the form vLLM understands, or
rejects one it cannot serve with a clear 400 *before* it reaches the engine. None of them changes
what the model is asked to generate beyond what the client asked for. They import nothing from
vLLM, so every engine line (0.32.0's middleware, the V0 line) applies the same functions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# Documented in the README: the budget of a request that names no max_tokens. vLLM's own default
# is "the rest of the context" (262K tokens at the platform's settings), which can keep a stream
# busy for hours; clients that want more ask for it explicitly.
DEFAULT_MAX_TOKENS_ENV = "VLLM_OVERRIDES_DEFAULT_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 4096


class CompatError(ValueError):
    """A request the server cannot serve: becomes an OpenAI-style 400 (or ``status``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "NotFoundError" if self.status == 404 else "BadRequestError"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class ServerLimits:
    max_model_len: int
    default_max_tokens: int


def default_max_tokens() -> int:
    raw = os.environ.get(DEFAULT_MAX_TOKENS_ENV, str(DEFAULT_MAX_TOKENS))
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{DEFAULT_MAX_TOKENS_ENV} must be an integer, got {raw!r}") from exc
    if value < 1:
        raise ValueError(f"{DEFAULT_MAX_TOKENS_ENV} must be >= 1, got {value}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_limit(body: dict[str, Any], name: str, limits: ServerLimits) -> None:
    """An explicit output budget must be an integer in [1, max_model_len].

    A budget that fits max_model_len but not what the prompt leaves is served: vLLM fits it to
    the remaining context and the answer ends with finish_reason "length" when it is reached.
    """
    value = body.get(name)
    if value is None:
        return
    if not _is_int(value):
        raise CompatError(f"'{name}' must be an integer, got {json.dumps(value)[:50]}", name)
    if value < 1:
        raise CompatError(f"'{name}' must be at least 1, got {value}", name)
    if value > limits.max_model_len:
        raise CompatError(
            f"'{name}' is {value}, more than this model's context length "
            f"({limits.max_model_len} tokens, prompt included)",
            name,
        )


def normalize_output_budget(body: dict[str, Any], limits: ServerLimits, chat: bool) -> None:
    """Validate max_tokens / max_completion_tokens / min_tokens; apply the server default.

    Rule (both endpoints): the budget is max_completion_tokens, else max_tokens, else the server
    default; min_tokens must be an integer in [0, budget]. /v1/completions' legacy default of 16
    tokens is replaced by the same server default, so ``min_tokens`` alone is accepted there too.
    """
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        check_token_limit(body, name, limits)
    budget_name = next((n for n in names if body.get(n) is not None), None)
    if budget_name is None:
        budget_name = names[0]
        body[budget_name] = min(limits.default_max_tokens, limits.max_model_len)
    budget = body[budget_name]
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_int(min_tokens) or min_tokens < 0:
            raise CompatError("'min_tokens' must be a non-negative integer", "min_tokens")
        if min_tokens > budget:
            raise CompatError(
                f"'min_tokens' ({min_tokens}) is larger than the output budget "
                f"'{budget_name}' ({budget})",
                "min_tokens",
            )


def _default_enable_thinking(body: dict[str, Any], value: bool) -> None:
    """Set ``chat_template_kwargs.enable_thinking`` unless the client already set it."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = body["chat_template_kwargs"] = {}
    if isinstance(kwargs, dict):
        kwargs.setdefault("enable_thinking", value)


def _thinking_switch(value: Any) -> bool | None:
    """Anthropic/DeepSeek style ``thinking``: a bool or ``{"type": "enabled"|"disabled"}``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):
        return value["type"] == "enabled"
    if value is None:
        return None
    raise CompatError(
        '\'thinking\' must be a boolean or {"type": "enabled"|"disabled"}', "thinking"
    )


def normalize_thinking(body: dict[str, Any]) -> None:
    """Map top-level ``thinking`` / ``enable_thinking`` onto the template's ``enable_thinking``.

    An explicit ``chat_template_kwargs.enable_thinking`` wins; ``reasoning_effort: "none"`` is
    handled by vLLM itself.
    """
    switches = []
    if "thinking" in body:
        switches.append(_thinking_switch(body.pop("thinking")))
    if "enable_thinking" in body:
        value = body.pop("enable_thinking")
        if value is not None and not isinstance(value, bool):
            raise CompatError("'enable_thinking' must be a boolean", "enable_thinking")
        switches.append(value)
    chosen = next((s for s in switches if s is not None), None)
    if chosen is not None:
        _default_enable_thinking(body, chosen)


def forced_tool_choice_without_thinking(body: dict[str, Any]) -> None:
    """``tool_choice`` required or named, thinking not asked for: render with thinking off.

    vLLM applies the tool-call grammar only after the reasoning ends; with thinking on, a model
    that reasons until ``max_tokens`` returns no call at all. A client that forces a call wants
    the call, so unless it explicitly asked for thinking (``chat_template_kwargs``,
    ``thinking``/``enable_thinking``, or a ``reasoning_effort`` other than "none"), the prompt
    opens the answer after an empty think block and the grammar holds from the first token.
    """
    choice = body.get("tool_choice")
    if not body.get("tools") or not (choice == "required" or isinstance(choice, dict)):
        return
    if body.get("reasoning_effort") is None:
        _default_enable_thinking(body, False)


def normalize_tool_calls(body: dict[str, Any]) -> None:
    """Accept the assistant tool-call history shapes real clients send back.

    - a stray ``index`` (clients echo streamed deltas) is dropped;
    - ``arguments`` given as a JSON object (or any non-string JSON value) is serialised to the
      string the OpenAI schema specifies; a string, even a malformed one, is left as it is.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
            continue
        for call in message["tool_calls"]:
            if not isinstance(call, dict):
                continue
            call.pop("index", None)
            function = call.get("function")
            if isinstance(function, dict) and "arguments" in function:
                args = function["arguments"]
                if args is not None and not isinstance(args, str):
                    function["arguments"] = json.dumps(args, ensure_ascii=False)


KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_roles(body: dict[str, Any]) -> None:
    """vLLM 0.32.0 passes any role string to the template; an unknown one is a client error."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in KNOWN_ROLES:
            raise CompatError(
                f"messages[{i}].role {role!r} is not one of {sorted(KNOWN_ROLES)}", "messages"
            )


# OpenAI requires ``content`` on these roles (a string or a list of parts, never null); vLLM
# renders a message without it as an empty turn and answers 200 (the platform's check t16b).
CONTENT_REQUIRED_ROLES = frozenset({"system", "developer", "user", "tool"})


def check_message_content(body: dict[str, Any]) -> None:
    """A system / developer / user / tool message without ``content`` (absent or null) is a 400:
    it gives the model nothing to read (the platform's check t16b sends ``{"role": "user"}``).

    An assistant message never needs one: it is history the model produced, and an agent may
    send back a turn whose content was null (one that only called tools, or only reasoned);
    the template renders it empty, so the request can be served and is. The deprecated
    ``function`` role is left to vLLM (its schema allows null).
    """
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict) or message.get("content") is not None:
            continue
        role = message.get("role")
        # A fuzzed role may be any JSON value (a list is unhashable); vLLM's schema refuses those.
        if isinstance(role, str) and role in CONTENT_REQUIRED_ROLES:
            raise CompatError(
                f"messages[{i}] (role {role!r}) has no 'content'", f"messages[{i}].content"
            )


# Documented in the README: the hosts a media URL in a request may name. Empty by default: the
# server fetches nothing a request points it at (an SSRF guard: the platform's check d08), and
# clients send images inline as base64 data: URLs.
MEDIA_ALLOWED_HOSTS_ENV = "VLLM_OVERRIDES_MEDIA_ALLOWED_HOSTS"
# The content-part keys that carry a media URL (OpenAI's image_url; vLLM's video_url, audio_url),
# as {"url": ...} or, in vLLM's short form, the URL string itself.
MEDIA_URL_KEYS = ("image_url", "video_url", "audio_url")
# URL parsers disagree about the host of a URL with a backslash (it ends the authority for a
# WHATWG parser, not for urllib), with userinfo, or with spaces or control characters (urllib
# drops tabs and newlines, others do not): such a URL never counts as naming an allowed host.
_SPACE_OR_CONTROL = frozenset(chr(c) for c in range(33)) | {"\x7f"}


def media_allowed_hosts() -> frozenset[str]:
    """The operator's allow-list: comma-separated host names (any port), case-insensitive."""
    hosts = set()
    for entry in os.environ.get(MEDIA_ALLOWED_HOSTS_ENV, "").split(","):
        host = entry.strip().lower().rstrip(".")
        if not host:
            continue
        if any(c in host for c in "/\\@") or _SPACE_OR_CONTROL & set(host):
            raise ValueError(
                f"{MEDIA_ALLOWED_HOSTS_ENV} holds host names separated by commas, got {entry!r}"
            )
        hosts.add(host.strip("[]"))  # an IPv6 literal may be written as in a URL
    return frozenset(hosts)


def check_media_url(url: str, param: str, allowed_hosts: frozenset[str]) -> None:
    """Refuse a media URL the server would have to fetch, unless its host is allow-listed.

    ``data:`` URLs are inline and pass. ``file:`` URLs pass too: the engine refuses them unless
    its operator named a local media path (0.32.0: ``--allowed-local-media-path``). Anything
    else — http(s) to a host not in ``allowed_hosts``, or a scheme the check does not know — is
    a 400 before any engine code sees the URL.
    """
    if url[:5].lower() == "data:":
        return
    hint = "send the media inline as a base64 data: URL"
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        raise CompatError(f"{param} is not a valid URL; {hint}", param) from None
    if parts.scheme in ("data", "file"):
        return
    if parts.scheme not in ("http", "https"):
        raise CompatError(f"{param} has an unsupported URL scheme; {hint}", param)
    if host is None:
        raise CompatError(f"{param} names no host; {hint}", param)
    if host.rstrip(".") not in allowed_hosts:
        raise CompatError(
            f"{param} points at a remote host ({host[:100]}) and this server does not fetch "
            f"media from URLs in requests; {hint}",
            param,
        )
    if "@" in parts.netloc or "\\" in url or _SPACE_OR_CONTROL & set(url):
        raise CompatError(f"{param} does not name its host unambiguously; {hint}", param)


def check_media_urls(body: dict[str, Any], allowed_hosts: frozenset[str] | None = None) -> None:
    """Apply ``check_media_url`` to every media URL in the messages' content parts."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            for key in MEDIA_URL_KEYS:
                value = part.get(key)
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    if allowed_hosts is None:
                        allowed_hosts = media_allowed_hosts()
                    check_media_url(url, f"messages[{i}].content[{j}].{key}", allowed_hosts)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_integer_range(body: dict[str, Any]) -> None:
    """A top-level integer beyond 64 bits is a 400 naming the field: vLLM carries request
    integers as 64-bit values, and one that does not fit (the fuzz suite's
    ``"thinking_token_budget": 18446744073709551616`` on /v1/completions) ended in a 500."""
    for name, value in body.items():
        if _is_int(value) and not INT64_MIN <= value <= INT64_MAX:
            raise CompatError(f"'{name}' is out of the 64-bit integer range", name)


def check_sampling(body: dict[str, Any]) -> None:
    top_p = body.get("top_p")
    if top_p is not None and not isinstance(top_p, bool) and isinstance(top_p, int | float):
        if not 0 <= top_p <= 1:
            raise CompatError(f"'top_p' must be in [0, 1], got {top_p}", "top_p")


def normalize_chat_request(body: Any, limits: ServerLimits) -> Any:
    """Rewrite/validate a /v1/chat/completions body in place; return it."""
    if not isinstance(body, dict):
        return body  # vLLM's own validation answers 400 for these
    check_integer_range(body)
    check_roles(body)
    check_message_content(body)
    check_media_urls(body)
    normalize_thinking(body)
    forced_tool_choice_without_thinking(body)
    normalize_tool_calls(body)
    check_sampling(body)
    normalize_output_budget(body, limits, chat=True)
    return body


def normalize_completion_request(body: Any, limits: ServerLimits) -> Any:
    """Rewrite/validate a /v1/completions body in place; return it."""
    if not isinstance(body, dict):
        return body
    check_integer_range(body)
    check_sampling(body)
    normalize_output_budget(body, limits, chat=False)
    return body
