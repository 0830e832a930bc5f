"""The server fetches no media a request points it at (the platform's check d08).

A remote ``image_url`` is a 400 and nothing is fetched, unless the operator names the host in
``VLLM_OVERRIDES_MEDIA_ALLOWED_HOSTS`` (empty on the servers these tests start; the allow-list
itself is covered in tests/unit). Base64 ``data:`` URLs are unaffected (test_messages.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.admission.conftest import assert_openai_error, chat, post

pytestmark = pytest.mark.server

# The URL the platform's check d08 sends.
EVALUATOR_URL = "https://upload.wikimedia.org/wikipedia/commons/thumb/3/3a/Cat03.jpg/200px-Cat03.jpg"


def image_message(url: str) -> list[dict]:
    parts = [{"type": "text", "text": "What color is this?"},
             {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    return [{"role": "user", "content": parts}]


class _Recorder(ThreadingHTTPServer):
    paths: list[str]


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    """An HTTP server on this machine that records every request (and answers 404)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.server.paths.append(self.path)  # type: ignore[attr-defined]
            self.send_error(404)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    srv = _Recorder(("127.0.0.1", 0), Handler)
    srv.paths = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_evaluators_remote_image_is_refused(server) -> None:
    """d08's own request. Without network a fetch fails with a 400 too, so the proof that
    nothing is fetched is the next test's."""
    assert_openai_error(chat(server, image_message(EVALUATOR_URL), max_tokens=50), 400)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_remote_image_is_not_fetched(server, recorder, host: str) -> None:
    """A host this machine can reach: a server that fetched it would leave a request here."""
    url = f"http://{host}:{recorder.server_port}/cat.png"
    assert_openai_error(chat(server, image_message(url), max_tokens=5), 400)
    stream = chat(server, image_message(url), max_tokens=5, stream=True)
    assert_openai_error(stream, 400)
    assert recorder.paths == []


def test_tokenize_does_not_fetch_either(server, recorder) -> None:
    """Every endpoint that renders messages loads their media; none may fetch a remote URL."""
    url = f"http://127.0.0.1:{recorder.server_port}/cat.png"
    resp = post(server, "/tokenize", {"model": server.model, "messages": image_message(url)})
    assert_openai_error(resp, 400)
    assert recorder.paths == []
