"""Response-side compatibility: ``reasoning_content`` beside vLLM 0.32.0's ``reasoning``.

vLLM 0.32 names the separated chain of thought ``reasoning``; the platform and most
DeepSeek/Qwen-style clients read ``reasoning_content``. We copy the model's own text into the
second field; nothing else in the answer changes.
"""

from __future__ import annotations

import json
from typing import Any

_MARKER = b'"reasoning"'


def _mirror(choices: Any, key: str) -> bool:
    changed = False
    for choice in choices if isinstance(choices, list) else []:
        part = choice.get(key) if isinstance(choice, dict) else None
        if isinstance(part, dict) and "reasoning" in part and "reasoning_content" not in part:
            part["reasoning_content"] = part["reasoning"]
            changed = True
    return changed


def add_reasoning_content(body: bytes) -> bytes:
    """A non-streamed chat completion with ``message.reasoning_content`` added."""
    if _MARKER not in body:
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if isinstance(payload, dict) and _mirror(payload.get("choices"), "message"):
        return json.dumps(payload, ensure_ascii=False).encode()
    return body


def mirror_event(event: bytes) -> bytes:
    """One SSE event (``data: {...}``) with ``delta.reasoning_content`` added."""
    if _MARKER not in event or not event.startswith(b"data: "):
        return event
    try:
        payload = json.loads(event[len(b"data: ") :])
    except ValueError:
        return event
    if isinstance(payload, dict) and _mirror(payload.get("choices"), "delta"):
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode()
    return event


class SSEReasoningMirror:
    """Rewrites an event stream chunk by chunk; holds back only an unfinished event."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        *events, self.pending = data.split(b"\n\n")
        return b"".join(mirror_event(e) + b"\n\n" for e in events)

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return mirror_event(rest) if rest else b""
