"""Engine-independent ASGI request / response plumbing for both lines' OpenAI middleware.

The 0.32.0 line's ``engines/v1_0_32/api_compat.py`` and the platform line's ``engines/v0/api.py``
read a request body whole before vLLM parses it, answer a rejected one with a JSON error, and
stamp every response with the distribution's version. None of that depends on a vLLM version:
it is plain ASGI (messages are dicts) plus FastAPI's name for its body validator.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_overrides import __version__
from vllm_overrides.request_compat import CompatError

VERSION_HEADER = b"x-vllm-overrides-version"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def with_header(message: Message, name: bytes, value: bytes) -> Message:
    """``message`` (a response start) with header ``name`` set to ``value``, replacing any."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != name]
    return {**message, "headers": [*headers, (name, value)]}


def encode_json_body(request: dict[str, Any]) -> bytes:
    """A rewritten request as the JSON body passed on to vLLM (UTF-8, non-ASCII kept)."""
    try:
        return json.dumps(request, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        # JSON can escape a lone UTF-16 surrogate ("\ud800"); it is not Unicode text and no
        # tokenizer can encode it.
        raise CompatError(
            f"the request holds a lone UTF-16 surrogate ({exc.object[exc.start]!a}), "
            "which is not valid Unicode text"
        ) from exc


async def read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole request body, or the disconnect message that cut it short."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def version_stamped(send: Send) -> Send:
    """``send`` with ``x-vllm-overrides-version`` added to the response start (both lines)."""

    async def send_with_version(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = with_header(message, VERSION_HEADER, __version__.encode())
        await send(message)

    return send_with_version


# FastAPI's function that validates a request body into the endpoint's pydantic model.
_BODY_VALIDATION = ("fastapi.dependencies.utils", "request_body_to_args")


def raised_by_body_validation(exc: BaseException) -> bool:
    """True when ``exc`` escaped FastAPI's validation of the request body (not the handler)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _BODY_VALIDATION:
            return True
        tb = tb.tb_next
    return False


async def send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    """Answer with ``payload`` as a JSON body and ``status``."""
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
