"""Streaming OpenAI-compatible client for the benchmarks: one record per request, never dropped.

Shared by ``formal_perf_bench.py`` and ``decode_microbench.py``. Timing uses one monotonic
clock (``time.perf_counter``) for all records of a run; ``perf_metrics.compute_metrics`` turns
the records into numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm


@dataclass
class RequestSpec:
    """What to send, plus the bits of the dataset's meta that the records keep."""

    id: str
    body: dict[str, Any]
    session_id: str | None = None
    counted_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _first_token_in(chunk: dict[str, Any]) -> bool:
    """Does this chunk carry generated output (content, reasoning or a tool call)?"""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
        if delta.get("tool_calls"):
            return True
    return False


async def stream_one(client: httpx.AsyncClient, url: str, spec: RequestSpec, index: int,
                     timeout_s: float, headers: dict[str, str]) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "index": index, "id": spec.id, "session_id": spec.session_id,
        "counted_tokens": spec.counted_tokens,
        "max_completion_tokens": spec.body.get("max_completion_tokens",
                                               spec.body.get("max_tokens")),
        "status": "error", "http_status": None, "error": None,
        "t_start": time.perf_counter(), "t_first_token": None, "t_end": None,
        "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
        "finish_reason": None, "n_chunks": 0, "content_chars": 0, "reasoning_chars": 0,
        "tool_call_chunks": 0, "done": False, **spec.extra,
    }

    async def read() -> None:
        async with client.stream("POST", url, json=spec.body, headers=headers) as resp:
            rec["http_status"] = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec["status"] = "http_error"
                rec["error"] = body[:1000]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec["done"] = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # vLLM reports mid-stream failures as a data event
                    rec["status"] = "stream_error"
                    rec["error"] = json.dumps(chunk["error"])[:1000]
                    return
                rec["n_chunks"] += 1
                if rec["t_first_token"] is None and _first_token_in(chunk):
                    rec["t_first_token"] = time.perf_counter()
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    rec["content_chars"] += len(delta.get("content") or "")
                    rec["reasoning_chars"] += len(delta.get("reasoning_content")
                                                  or delta.get("reasoning") or "")
                    rec["tool_call_chunks"] += 1 if delta.get("tool_calls") else 0
                    if choice.get("finish_reason"):
                        rec["finish_reason"] = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    rec["completion_tokens"] = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = details.get("cached_tokens")

    try:
        # asyncio.wait_for, not asyncio.timeout (3.11+): the tools run on the card's Python 3.10.
        await asyncio.wait_for(read(), timeout_s)
        if rec["status"] in ("http_error", "stream_error"):
            return rec
        if not rec["done"]:
            rec["status"], rec["error"] = "incomplete", "stream ended without [DONE]"
        elif rec["completion_tokens"] is None:
            rec["status"], rec["error"] = "incomplete", "no usage chunk"
        else:
            rec["status"] = "ok"
    # Python 3.10's asyncio.TimeoutError is not yet the builtin TimeoutError (3.11+).
    except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException) as exc:  # noqa: UP041
        rec["status"] = "timeout"
        rec["error"] = f"no complete response within {timeout_s:g} s ({type(exc).__name__})"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        rec["t_end"] = time.perf_counter()
    return rec


class Progress:
    """Progress on stderr through ``tqdm`` (requests done, ok / failed, output tokens per s)."""

    def __init__(self, total: int, label: str = "") -> None:
        self.total, self.label = total, label
        self.done = self.ok = self.completion = 0
        self.t0 = time.perf_counter()
        # Not a terminal (CI logs, nohup): a line every 10 s instead of a redrawn bar.
        self.bar = tqdm(total=total, desc=label.strip() or None, unit="req", file=sys.stderr,
                        mininterval=0.2 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)

    def update(self, rec: dict[str, Any]) -> None:
        self.done += 1
        if rec["status"] == "ok":
            self.ok += 1
            self.completion += rec["completion_tokens"] or 0
        el = time.perf_counter() - self.t0
        self.bar.set_postfix_str(
            f"ok {self.ok} err {self.done - self.ok} | out "
            f"{self.completion / el if el > 0 else 0:.1f} tok/s", refresh=False)
        self.bar.update(1)
        if self.done == self.total:
            self.bar.close()


async def run_specs(base_url: str, specs: Sequence[RequestSpec], concurrency: int,
                    timeout_s: float, api_key: str | None = None, session_deps: bool = True,
                    progress_label: str = "", t_ref: float | None = None,
                    transport: httpx.AsyncBaseTransport | None = None,
                    record_log: str | Path | None = None) -> list[dict[str, Any]]:
    """Send ``specs`` in order with at most ``concurrency`` in flight; one record per spec.

    With ``session_deps`` a request waits until the previous request of its session finished,
    as an agent would (it needs the answer before its next turn); the wait happens before
    ``t_start`` so it is not charged to the request. With ``record_log`` every record is also
    appended to that JSON-lines file as its request ends (times relative to the call's
    origin), so a run cut short -- hours of a long replay -- still leaves what it measured.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key or 'EMPTY'}"}
    records: list[dict[str, Any] | None] = [None] * len(specs)
    last_of_session: dict[str, asyncio.Event] = {}
    done_events = [asyncio.Event() for _ in specs]
    waits: list[asyncio.Event | None] = []
    for i, spec in enumerate(specs):
        waits.append(last_of_session.get(spec.session_id) if session_deps and spec.session_id
                     else None)
        if spec.session_id:
            last_of_session[spec.session_id] = done_events[i]
    prog = Progress(len(specs), progress_label)
    t_call0 = time.perf_counter() if t_ref is None else t_ref
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    # ``transport`` lets the tests plug in httpx.MockTransport instead of a server
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(specs):
                i = next_index
                next_index += 1
                ev = waits[i]
                if ev is not None:
                    await ev.wait()
                rec = await stream_one(client, url, specs[i], i, timeout_s, headers)
                records[i] = rec
                if record_log is not None:
                    with open(record_log, "a", encoding="utf-8") as f:
                        f.write(json.dumps(_relative(rec, t_call0)) + "\n")
                done_events[i].set()
                prog.update(rec)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(specs))))))
    out = [r for r in records if r is not None]
    assert len(out) == len(specs)
    # times relative to the start of this call (or t_ref, to share one origin across calls):
    # readable, and the metrics are shift-invariant
    return [_relative(r, t_call0) for r in out]


def _relative(rec: dict[str, Any], t0: float) -> dict[str, Any]:
    return {**rec, **{k: round(rec[k] - t0, 6) for k in ("t_start", "t_first_token", "t_end")
                      if rec.get(k) is not None}}  # fmt: skip


def server_info(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """/v1/models and /version (vLLM), best effort: failures are recorded, not raised."""
    info: dict[str, Any] = {"base_url": base_url}
    headers = {"Authorization": f"Bearer {api_key or 'EMPTY'}"}
    for key, path in (("models", "/v1/models"), ("version", "/version")):
        try:
            r = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=10)
            info[key] = r.json() if r.status_code == 200 else {"http_status": r.status_code}
            if key == "models":
                info["x-vllm-overrides-version"] = r.headers.get("x-vllm-overrides-version")
        except (httpx.HTTPError, ValueError) as exc:
            info[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


def reset_prefix_cache(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """Best effort: vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1."""
    headers = {"Authorization": f"Bearer {api_key or 'EMPTY'}"}
    try:
        r = httpx.post(base_url.rstrip("/") + "/reset_prefix_cache", headers=headers, timeout=60)
        return {"ok": r.status_code == 200, "http_status": r.status_code}
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def run_environment() -> dict[str, Any]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", repo, "status", "--porcelain"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"git_commit": commit, "git_dirty": dirty, "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(),
            "started_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def preflight_spec(model: str, max_tokens: int = 8) -> RequestSpec:
    """The platform's preflight shape: history with an assistant ``content: null`` +
    ``tool_calls`` message and its tool result."""
    body = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": max_tokens,
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_preflight0001", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_preflight0001",
             "content": "Sunny, 21 degrees Celsius."},
        ],
    }
    return RequestSpec("preflight", body)


def tokenize_chat(base_url: str, bodies: Sequence[dict[str, Any]], api_key: str | None = None,
                  timeout_s: float = 300.0) -> list[list[int] | None]:
    """The server's own token ids of each chat request: POST /tokenize with its messages and
    tools and the generation prompt, rendered by the server's chat template. ``None`` where the
    server refused (the record keeps no ideal then)."""
    headers = {"Authorization": f"Bearer {api_key or 'EMPTY'}"}
    out: list[list[int] | None] = []
    with httpx.Client(timeout=timeout_s) as client:
        for body in tqdm(bodies, desc="tokenize", unit="req", file=sys.stderr,
                         mininterval=0.5 if sys.stderr.isatty() else 10.0):
            req = {"model": body.get("model"), "messages": body["messages"],
                   "add_generation_prompt": True}
            for key in ("tools", "chat_template_kwargs"):
                if body.get(key) is not None:
                    req[key] = body[key]
            try:
                r = client.post(base_url.rstrip("/") + "/tokenize", json=req, headers=headers)
                out.append(r.json()["tokens"] if r.status_code == 200 else None)
            except (httpx.HTTPError, ValueError, KeyError):
                out.append(None)
    return out
