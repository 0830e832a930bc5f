"""Shared helpers for the native-engine checks: a server in ports 8120-8129, greedy requests."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serverlib import start_local_server, stop_process_group, wait_healthy

PORTS = range(8120, 8130)
NATIVE_ON = {
    "GDN_NATIVE": "1", "MOE_NATIVE": "1", "MOE_DECODE_NATIVE": "0", "RMSNORM_NATIVE": "1",
    "QK_NORM_ROPE_NATIVE": "1", "VISION_ROPE_NATIVE": "1",
}  # fmt: skip
NATIVE_OFF = {
    "GDN_NATIVE": "0", "MOE_NATIVE": "0", "MOE_DECODE_NATIVE": "0", "RMSNORM_NATIVE": "0",
    "QK_NORM_ROPE_NATIVE": "0", "VISION_ROPE_NATIVE": "0",
}  # fmt: skip


def free_port_in_range() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 8120-8129")


@contextmanager
def engine_server(
    log: Path, env: dict[str, str], extra_args: list[str], launcher_args: list[str] = ()
) -> Iterator[str]:
    port = free_port_in_range()
    proc, _ = start_local_server(
        log,
        extra_args,
        {"VLLM_CPU_KVCACHE_SPACE": "1", **env},
        ["--port", str(port), "--max-model-len", "16384", *launcher_args],  # fp32 KV: 1 GiB
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop_process_group(proc)


def greedy(
    url: str, ids: list[int], max_tokens: int = 64, cache_salt: str | None = None
) -> dict[str, Any]:
    """Greedy completion of a token-id prompt: tokens, chosen logprobs, usage, wall seconds.
    ``cache_salt`` keeps the request out of other requests' prefix-cache entries."""
    body = {
        "model": "llm", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
    }  # fmt: skip
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "usage": data["usage"],
        "wall_s": wall,
    }


def greedy_many(url: str, prompts: list[list[int]], max_tokens: int = 64) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy(url, p, max_tokens), prompts))


def check_same_tokens(name: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    """Fail with the first divergent token (and the oracle's top-2 gap there), if any."""
    i = first_divergence(got["tokens"], want["tokens"])
    if i is not None:
        gap = want["top2_gap"][i] if i < len(want["top2_gap"]) else float("nan")
        pytest.fail(
            f"{name}: first divergence at generated token {i}: engine {got['tokens'][i]} "
            f"(logprob {got['logprobs'][i]:.6f}) vs HF {want['tokens'][i]} "
            f"(logprob {want['logprobs'][i]:.6f}, HF top-2 gap {gap:.3g})"
        )


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
