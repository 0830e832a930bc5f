"""Our OpenAI-compat layer for vLLM's API server, installed by patch 0001 into ``build_app``.

A plain ASGI middleware; no upstream code is replaced. It

- stamps every response with the distribution's version (``x-vllm-overrides-version``), so a
  client can tell a patched server from a stock one;
- rewrites or rejects request bodies of the OpenAI endpoints (``request_compat``) before vLLM
  parses them: rejected requests get an OpenAI-style 400 and never reach the engine;
- mirrors ``reasoning`` into ``reasoning_content`` in chat answers (``response_compat``), the
  field most clients and the platform read. Upstream's field stays.
"""

from __future__ import annotations

import json
from argparse import Namespace
from typing import Any

from vllm_overrides.asgi_body import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Message,
    Receive,
    Scope,
    Send,
    encode_json_body,
    raised_by_body_validation,
    read_body,
    send_json,
    version_stamped,
    with_header,
)
from vllm_overrides.engines.v1_0_32.engine_watchdog import install_engine_watchdog
from vllm_overrides.media_errors import install_media_error_mapping
from vllm_overrides.request_compat import (
    CompatError,
    ServerLimits,
    default_max_tokens,
    media_allowed_hosts,
    normalize_chat_request,
    normalize_completion_request,
)
from vllm_overrides.response_compat import SSEReasoningMirror, add_reasoning_content


def _server_limits(scope: Scope) -> ServerLimits | None:
    state = getattr(scope.get("app"), "state", None)
    vllm_config = getattr(state, "vllm_config", None)
    if vllm_config is None:
        return None
    return ServerLimits(vllm_config.model_config.max_model_len, default_max_tokens())


class CompatMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        send_with_version = version_stamped(send)
        path = scope.get("path", "")
        if scope.get("method") != "POST" or path not in (CHAT_PATH, COMPLETIONS_PATH):
            await self.app(scope, receive, send_with_version)
            return
        await self._openai_request(scope, receive, send_with_version, chat=path == CHAT_PATH)

    async def _openai_request(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        raw, disconnect = await read_body(receive)
        if disconnect is not None:
            return  # the client left before sending its request
        body = raw
        limits = _server_limits(scope)
        try:
            decoded = json.loads(raw) if raw else None
        except (ValueError, RecursionError) as exc:
            # Answered here: FastAPI's parser fails on the same bodies, and on some (nesting past
            # Python's recursion limit, integers over 4,300 digits) with {"detail": ...} instead
            # of an OpenAI-style error.
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            await send_json(
                send, 400, CompatError(f"request body is not valid JSON ({why})").body()
            )
            return
        if limits is not None and isinstance(decoded, dict):
            try:
                normalize = normalize_chat_request if chat else normalize_completion_request
                body = encode_json_body(normalize(decoded, limits))
            except CompatError as exc:
                await send_json(send, exc.status, exc.body())
                return

        delivered = False

        async def replay_body() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: disconnect detection, as upstream expects

        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        inner = _ReasoningSender(send) if chat else send
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await inner(message)

        try:
            await self.app(scope, replay_body, send_tracked)
        except Exception as exc:
            if started or not raised_by_body_validation(exc):
                raise
            # vLLM's request models run "before" validators on the raw body; one that meets an
            # unexpected type (e.g. ``structured_outputs: "x"``) raises AttributeError/KeyError,
            # which pydantic passes through and starlette answers with a 500. The body is at fault.
            reason = f"{type(exc).__name__}: {exc}"[:300]
            await send_json(send, 400, CompatError(f"invalid request body ({reason})").body())


class _ReasoningSender:
    """Wraps ``send`` for chat answers: adds ``reasoning_content`` beside ``reasoning``."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.mode = "pass"  # "json" buffers a whole answer, "sse" rewrites events as they pass
        self.start: Message | None = None
        self.buffer: list[bytes] = []
        self.sse = SSEReasoningMirror()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            ctype = dict(message.get("headers", [])).get(b"content-type", b"")
            if message.get("status") == 200 and ctype.startswith(b"application/json"):
                self.mode, self.start = "json", message
                return
            if message.get("status") == 200 and ctype.startswith(b"text/event-stream"):
                self.mode = "sse"
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.mode == "pass":
            await self.send(message)
            return
        more = message.get("more_body", False)
        if self.mode == "sse":
            out = self.sse.feed(message.get("body", b""))
            if not more:
                out += self.sse.flush()
            await self.send({**message, "body": out})
            return
        self.buffer.append(message.get("body", b""))
        if more:
            return
        body = add_reasoning_content(b"".join(self.buffer))
        assert self.start is not None
        start = with_header(self.start, b"content-length", str(len(body)).encode())
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def install_api_compat(app: Any, args: Namespace) -> None:
    """Called once from ``vllm.entrypoints.launchers.app.build_app`` (patch 0001)."""
    default_max_tokens()  # a bad setting stops the start-up, not the first request
    media_allowed_hosts()  # likewise
    app.add_middleware(CompatMiddleware)
    install_media_error_mapping()
    # vLLM 0.32.0 exits with status 0 after its engine core dies; the platform restarts only a
    # failed server (engine_watchdog.py).
    install_engine_watchdog(app)
