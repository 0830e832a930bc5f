"""Our OpenAI-compat layer for vLLM's API server, installed by patch 0001 into ``build_app``.

A plain ASGI middleware (no upstream code is replaced): it stamps every response with the
distribution's version so a client can tell a patched server from a stock one.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from vllm_overrides import __version__

VERSION_HEADER = b"x-vllm-overrides-version"

Scope = dict[str, Any]
Message = dict[str, Any]


class CompatMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((VERSION_HEADER, __version__.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)


def install_api_compat(app: Any, args: Namespace) -> None:
    """Called once from ``vllm.entrypoints.launchers.app.build_app`` (patch 0001)."""
    app.add_middleware(CompatMiddleware)
