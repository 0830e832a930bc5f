"""The platform line's OpenAI layer on vLLM 0.6.3's API server (installed by patch 0010).

``install_api_compat(app, args)`` is called from ``build_app``: it adds ``V0CompatMiddleware``
(innermost, so auth and CORS wrap it) and starts the engine watchdog. The middleware

- stamps every response with ``x-vllm-overrides-version``;
- applies the shared request rules (``vllm_overrides.request_compat``: budget, thinking
  switches, tool-call history, roles, sampling ranges, ...) and then the V0 mapping
  (``request_rules``) to chat and completion bodies; a rejected request is an OpenAI-style 4xx
  that never reaches the engine;
- answers a body that is not a JSON object, or that 0.6.3's validators trip over with
  something other than a validation error (a 500 there), with a 400;
- gives every JSON error answer OpenAI's body, ``{"error": {...}}`` (0.6.3 answers with the
  bare error object, which OpenAI clients and the platform's checks do not read as an error).

Reasoning, ``tool_choice`` none / required, budget fitting and stream usage are done by the
serving subclasses (``serving.py``) that patch 0010 puts in place of 0.6.3's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from argparse import Namespace
from typing import Any

from vllm_overrides.asgi_body import CHAT_PATH, COMPLETIONS_PATH, version_stamped
from vllm_overrides.asgi_body import encode_json_body as _encode
from vllm_overrides.asgi_body import raised_by_body_validation as _raised_by_body_validation
from vllm_overrides.asgi_body import read_body as _read_body
from vllm_overrides.asgi_body import send_json as _send_json
from vllm_overrides.asgi_body import with_header as _with_header
from vllm_overrides.engines.v0.request_rules import (
    MARKER_HEADER,
    adapt_chat_body,
    adapt_completion_body,
)
from vllm_overrides.request_compat import (
    CompatError,
    ServerLimits,
    check_media_urls,
    default_max_tokens,
    normalize_chat_request,
    normalize_completion_request,
)

logger = logging.getLogger("vllm.overrides.v0.api")

TOKENIZE_PATH = "/tokenize"

Scope = dict[str, Any]
Message = dict[str, Any]


def _known_fields(model: type) -> frozenset[str]:
    names = set()
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        names.add(info.alias or name)
        names.add(name)
    return frozenset(names)


def _server_limits(scope: Scope) -> ServerLimits | None:
    state = getattr(scope.get("app"), "state", None)
    serving = getattr(state, "openai_serving_chat", None)
    max_model_len = getattr(serving, "max_model_len", None)
    if not isinstance(max_model_len, int):
        return None
    return ServerLimits(max_model_len, default_max_tokens())


def check_parallel_sequences(body: dict[str, Any], max_num_seqs: int | None) -> None:
    """``best_of`` above ``--max-num-seqs`` is a 400: 0.6.3's scheduler never admits such a
    request, and as the head of its queue it holds back every prompt behind it."""
    if max_num_seqs is None:
        return
    for name in ("best_of",):  # a wider n is served choice by choice (serving._FanOutClient)
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_num_seqs:
            raise CompatError(
                f"'{name}' is {value}, more sequences than this server runs at once "
                f"(--max-num-seqs {max_num_seqs})",
                name,
            )


class V0CompatMiddleware:
    def __init__(self, app: Any, max_num_seqs: int | None = None) -> None:
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

        self.app = app
        self.max_num_seqs = max_num_seqs
        self.chat_fields = _known_fields(ChatCompletionRequest)
        self.completion_fields = _known_fields(CompletionRequest)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        send_with_version = _ErrorBodySender(version_stamped(send))

        path = scope.get("path", "")
        try:
            if scope.get("method") == "POST" and path in (CHAT_PATH, COMPLETIONS_PATH):
                await self._openai_request(scope, receive, send_with_version, path == CHAT_PATH)
            elif scope.get("method") == "POST" and path == TOKENIZE_PATH:
                await self._tokenize_request(scope, receive, send_with_version)
            else:
                await self.app(scope, receive, send_with_version)
        finally:
            # A request that met a dead engine: vLLM stops the server right after this
            # response, before the watchdog's next look; record the death now.
            note_engine_state(scope.get("app"))

    async def _tokenize_request(self, scope: Scope, receive: Any, send: Any) -> None:
        """/tokenize renders messages too: the same media URL rule as chat (nothing fetched)."""
        raw, disconnect = await _read_body(receive)
        if disconnect is not None:
            return
        try:
            decoded = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            decoded = None  # vLLM's own validation answers it
        if isinstance(decoded, dict) and isinstance(decoded.get("messages"), list):
            try:
                check_media_urls(decoded)
            except CompatError as exc:
                await _send_json(send, exc.status, exc.body())
                return
        await self.app(scope, _replay(raw, receive), send)

    def _rewrite(self, decoded: Any, limits: ServerLimits, chat: bool) -> tuple[bytes, str | None]:
        if not isinstance(decoded, dict):
            raise CompatError("the request body must be a JSON object")
        check_parallel_sequences(decoded, self.max_num_seqs)
        if chat:
            body = normalize_chat_request(decoded, limits)
            marker = adapt_chat_body(body, self.chat_fields)
        else:
            body = normalize_completion_request(decoded, limits)
            adapt_completion_body(body, self.completion_fields)
            marker = None
        return _encode(body), marker

    async def _openai_request(self, scope: Scope, receive: Any, send: Any, chat: bool) -> None:
        raw, disconnect = await _read_body(receive)
        if disconnect is not None:
            return
        body, marker = raw, None
        limits = _server_limits(scope)
        try:
            decoded = json.loads(raw) if raw else None
        except (ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            await _send_json(
                send, 400, CompatError(f"request body is not valid JSON ({why})").body()
            )
            return
        if limits is not None:
            try:
                body, marker = self._rewrite(decoded, limits, chat)
            except CompatError as exc:
                await _send_json(send, exc.status, exc.body())
                return

        drop = (b"content-length", MARKER_HEADER)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in drop]
        headers.append((b"content-length", str(len(body)).encode()))
        if marker is not None:
            headers.append((MARKER_HEADER, marker.encode()))
        scope = {**scope, "headers": headers}
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _replay(body, receive), send_tracked)
        except Exception as exc:
            if started or not _raised_by_body_validation(exc):
                raise
            reason = f"{type(exc).__name__}: {exc}"[:300]
            await _send_json(send, 400, CompatError(f"invalid request body ({reason})").body())


def openai_error_body(body: bytes) -> bytes:
    """vLLM 0.6.3's error body (``{"object": "error", "message", ...}``) in OpenAI's form,
    ``{"error": {"message", "type", "param", "code"}}``, as vLLM 0.32.0 and OpenAI answer."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or payload.get("object") != "error":
        return body
    error = {key: payload.get(key) for key in ("message", "type", "param", "code")}
    return json.dumps({"error": error}).encode()


class _ErrorBodySender:
    """Wraps ``send``: a JSON error answer (status >= 400) gets OpenAI's error body."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            ctype = dict(message.get("headers", [])).get(b"content-type", b"")
            if message.get("status", 200) >= 400 and ctype.startswith(b"application/json"):
                self.start = message  # held until the body is complete
                return
            await self.send(message)
            return
        if self.start is None or message["type"] != "http.response.body":
            await self.send(message)
            return
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = openai_error_body(b"".join(self.chunks))
        start, self.start = self.start, None
        await self.send(_with_header(start, b"content-length", str(len(body)).encode()))
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives ``body`` once, then the client's own messages (disconnects)."""
    delivered = False

    async def replay_body() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_body


# ---- engine death -------------------------------------------------------------------------

EXIT_CODE = 3  # as the 0.32.0 line (engine_watchdog.py): a supervisor restarts a failed server
_dead = {"since": None}


def _engine_errored(app: Any) -> bool:
    """True while the server runs and its engine client says the engine failed.

    At shutdown vLLM 0.6.3 deletes ``app.state`` (its lifespan) *before* it stops the engine,
    so a requested stop never reads as a death here.
    """
    state = getattr(app, "state", None)
    client = getattr(state, "engine_client", None) if state is not None else None
    if client is None:
        return False
    try:
        return bool(client.errored)
    except Exception:  # noqa: BLE001 - a client that cannot answer is not a live engine
        return True


def note_engine_state(app: Any) -> None:
    """Record the engine's death if it is dead now (called after every request)."""
    if _dead["since"] is None and app is not None and _engine_errored(app):
        _dead["since"] = time.monotonic()
        logger.error("engine is dead; the API server exits with status %d", EXIT_CODE)


def _exit_status_hook() -> None:
    if _dead["since"] is not None:
        os._exit(EXIT_CODE)


def _watch(app: Any, poll_s: float, exit_deadline_s: float) -> None:
    while not _engine_errored(app) and _dead["since"] is None:
        time.sleep(poll_s)
    if _dead["since"] is None:
        _dead["since"] = time.monotonic()
        logger.error(
            "engine is dead; the API server exits with status %d so that it is restarted",
            EXIT_CODE,
        )
    # vLLM 0.6.3 stops its server only when a request meets the dead engine: ask it to stop
    # now (its SIGTERM handler shuts the server and the engine down), then force the status.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(exit_deadline_s)
    logger.error("shutdown did not finish in %.0f s; exiting now", exit_deadline_s)
    os._exit(EXIT_CODE)


def install_engine_watchdog(
    app: Any, *, poll_s: float = 1.0, exit_deadline_s: float = 30.0
) -> threading.Thread | None:
    if os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").lower() in ("1", "true"):
        logger.info("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH set: engine watchdog not installed")
        return None
    import atexit

    atexit.register(_exit_status_hook)
    thread = threading.Thread(
        target=_watch, args=(app, poll_s, exit_deadline_s), name="EngineWatchdog", daemon=True
    )
    thread.start()
    return thread


# ---- media ---------------------------------------------------------------------------------

# The text that stands for one media item in a Qwen3.5 / Qwen3.6 prompt (the model's processor
# expands the pad token to the item's patch count).
_QWEN3_5_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
_QWEN3_5_TYPES = frozenset({"qwen3_5_moe", "qwen3_5"})


def media_placeholder(model_type: str, modality: str) -> str | None:
    """Our models' placeholder for ``modality`` (None: not one of ours; vLLM decides)."""
    if model_type in _QWEN3_5_TYPES:
        return _QWEN3_5_PLACEHOLDERS.get(modality)
    return None


def install_api_compat(app: Any, args: Namespace) -> None:
    """Called once from ``vllm.entrypoints.openai.api_server.build_app`` (patch 0010)."""
    default_max_tokens()  # a bad setting stops the start-up, not the first request
    # Registers qwen3_coder when --tool-parser-plugin was not given (after the flag check).
    import vllm_overrides.engines.v0.tool_parser  # noqa: F401

    # The engine's default when the flag is absent (vLLM 0.6.3: 256).
    max_num_seqs = getattr(args, "max_num_seqs", None) or 256
    app.add_middleware(V0CompatMiddleware, max_num_seqs=max_num_seqs)
    from vllm_overrides.engines.v0.serving import SCHEDULER

    SCHEDULER["max_num_seqs"] = max_num_seqs
    install_engine_watchdog(app)
