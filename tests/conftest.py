"""Shared fixtures: the server under test.

With ``VLLM_BASE_URL`` set, tests run against that server (a container, a remote box; model name
from ``VLLM_MODEL``, default ``llm``; key from ``VLLM_API_KEY``). Otherwise one patched server is
started for the whole session from this checkout's venv with the tiny model, through the launcher
(so from ``computility-run.yaml``), and stopped at the end; its log is kept in build/.

The local server runs with a 256-token default output budget (``VLLM_OVERRIDES_DEFAULT_MAX_TOKENS``)
so that the "no max_tokens" checks finish quickly on two CPU cores; the shipped default is 4,096.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.serverlib import REPO_DIR, Server, start_local_server, stop_process_group, wait_healthy

os.environ.setdefault("VLLM_OVERRIDES_DEFAULT_MAX_TOKENS", "256")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    model = os.environ.get("VLLM_MODEL", "llm")
    api_key = os.environ.get("VLLM_API_KEY") or None
    if base_url := os.environ.get("VLLM_BASE_URL"):
        srv = Server(base_url.rstrip("/"), model, api_key)
        wait_healthy(srv.base_url, None, None)
        srv.max_model_len = _max_model_len(srv)
        yield srv
        return
    log_path = REPO_DIR / "build" / "test-server.log"
    proc, base_url = start_local_server(log_path)
    try:
        wait_healthy(base_url, proc, log_path)
        srv = Server(base_url, model, api_key, log_path)
        srv.max_model_len = _max_model_len(srv)
        yield srv
    finally:
        stop_process_group(proc)


def _max_model_len(srv: Server) -> int:
    with srv.client() as c:
        models = c.get("/v1/models").json()["data"]
    return int(next(m for m in models if m["id"] == srv.model)["max_model_len"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run tests/native_engine first. Its modules start their own servers (float32, and at
    ``-tp 2`` one worker process per rank); the shared servers above live for the whole session
    once started, and on a 24 GiB CI machine the main server, the admission tests' small server
    and the TP2 server together ran out of memory (the kernel killed the main server's worker)."""
    first = [i for i in items if "native_engine" in i.path.parts]
    if first:
        items[:] = first + [i for i in items if "native_engine" not in i.path.parts]
