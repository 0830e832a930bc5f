"""Helpers shared by the robustness tests: what counts as an error body, as engine trouble in the
server log, how to read SSE and /metrics, and how much memory a local server's processes hold.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

# ----------------------------------------------------------------------------------------------
# Error bodies
# ----------------------------------------------------------------------------------------------


def error_message(body: Any) -> str | None:
    """The message of an error body, or None when the body is not an error in a known format.

    vLLM 0.32.0 answers every error it raises itself, its request-validation errors included, in
    the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` (ErrorResponse). Older
    vLLM releases used a flat ``{"object": "error", "message", "type", "code"}``; it is accepted
    too so the tests also run against a VLLM_BASE_URL server of another version.
    """
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"].strip():
        return err["message"]
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return body["message"] or None
    return None


# ----------------------------------------------------------------------------------------------
# Engine trouble in the server log
# ----------------------------------------------------------------------------------------------

# Lines that mean the engine (the EngineCore process or its workers) failed, as opposed to the
# API server rejecting a request. vLLM prefixes every line of a child process with
# "(EngineCore pid=N)" / "(Worker pid=N)" (decorate_logs), so any ERROR/CRITICAL record or
# traceback line from those processes is engine trouble; the rest are the messages the
# front end logs when it finds the engine dead.
ENGINE_TROUBLE = [
    re.compile(r"^\((?:EngineCore|Worker)[^)]*\)\s+(?:ERROR|CRITICAL)\b", re.M),
    re.compile(r"^\((?:EngineCore|Worker)[^)]*\)\s+Traceback \(most recent call last\)", re.M),
    re.compile(r"EngineDeadError"),
    re.compile(r"EngineCore encountered a fatal error"),
    re.compile(r"engine core exited unexpectedly", re.I),
    re.compile(r"Engine core proc \S+ died unexpectedly"),
    re.compile(r"\bcore dumped\b|Segmentation fault|Fatal Python error"),
]
# A traceback printed by the API server process itself does not mean the engine failed: a
# request handler raised and the API server answered (a 5xx, which the tests catch by its
# status) or dropped the connection (caught as a transport error). They are counted in the
# fuzz summary, not failed on, so that one bug is reported once, by the request that shows it.


def engine_trouble(log: str) -> list[str]:
    """The log lines (with a little context) that show engine trouble."""
    hits: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if any(p.search(line) for p in ENGINE_TROUBLE):
            hits.append("\n".join(lines[max(0, i - 1) : i + 6]))
    return hits


def api_tracebacks(log: str) -> list[str]:
    lines = log.splitlines()
    return [
        "\n".join(lines[i : i + 25])
        for i, line in enumerate(lines)
        if "Traceback (most recent call last)" in line
    ]


class LogWindow:
    """The part of the server log written after this object was created."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.start = len(server.log_text())
        path = getattr(server, "log_path", None)
        self.start_bytes = path.stat().st_size if path is not None and path.exists() else 0

    def text(self) -> str:
        return self.server.log_text()[self.start :]


# ----------------------------------------------------------------------------------------------
# SSE
# ----------------------------------------------------------------------------------------------


@dataclass
class SSE:
    events: list[Any]  # decoded JSON payloads
    done: bool  # "[DONE]" seen
    undecodable: list[str]

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]


def parse_sse(text: str) -> SSE:
    events: list[Any] = []
    bad: list[str] = []
    done = False
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            bad.append(payload[:200])
    return SSE(events, done, bad)


# ----------------------------------------------------------------------------------------------
# /metrics and process memory
# ----------------------------------------------------------------------------------------------

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def read_metrics(client: httpx.Client, names: Iterable[str]) -> dict[str, float]:
    """Sum of each named gauge over its label sets (one model here, but be label-agnostic)."""
    wanted = set(names)
    text = client.get("/metrics").text
    out = dict.fromkeys(wanted, 0.0)
    seen: set[str] = set()
    for name, _labels, value in _METRIC.findall(text):
        if name in wanted:
            out[name] += float(value)
            seen.add(name)
    missing = wanted - seen
    if missing:
        raise AssertionError(f"/metrics lacks {sorted(missing)}")
    return out


def wait_idle(client: httpx.Client, timeout_s: float) -> dict[str, float]:
    """Poll until no request is running or waiting; return the last reading."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    reading = read_metrics(client, names)
    while time.monotonic() < deadline:
        reading = read_metrics(client, names)
        if all(v == 0 for v in reading.values()):
            return reading
        time.sleep(0.5)
    return reading


def local_server_pgid(server: Any) -> int | None:
    """The process group of the session's local server (None for a VLLM_BASE_URL server).

    conftest starts the launcher with start_new_session=True, so the API server, the engine
    core and their helpers share one process group whose id is the launcher's pid; the
    launcher execs vLLM, so that pid is the API server. It is found by the port it listens on.
    """
    if server.log_path is None:
        return None
    import psutil

    port = httpx.URL(server.base_url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid:
                return os.getpgid(conn.pid)
    return None


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in the group (USS would be truer but costs seconds)."""
    import psutil

    total = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                total += proc.memory_info().rss
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return total
