"""Runs last in the admission suite: the server survived everything above."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.server

ENGINE_TROUBLE = re.compile(r"EngineCore.*(Traceback|ERROR)|EngineDeadError|Worker proc .* died")


def test_server_is_healthy_and_logged_no_engine_traceback(server) -> None:
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/chat/completions", json={
            "model": server.model, "messages": [{"role": "user", "content": "still there?"}],
            "max_tokens": 2}).status_code == 200  # fmt: skip
    trouble = [line for line in server.log_text().splitlines() if ENGINE_TROUBLE.search(line)]
    assert not trouble, "\n".join(trouble[:20])
