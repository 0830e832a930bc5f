"""Media that cannot be loaded is a client error (400), through vLLM's real MediaConnector;
a URL on a host the operator did not allow is refused before anything is fetched."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image
from vllm.connections import HTTPConnection
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from vllm_overrides.media_errors import client_error_connector, install_media_error_mapping
from vllm_overrides.request_compat import MEDIA_ALLOWED_HOSTS_ENV


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _bomb() -> bytes:
    """A PNG whose header claims 30,000 x 30,000 pixels (PIL refuses it before decoding)."""
    png = bytearray(_png(1, 1))
    png[16:24] = (30000).to_bytes(4, "big") * 2  # IHDR width, height (CRC is checked later)
    return bytes(png)


CONNECTOR = client_error_connector(MediaConnector)()

BAD = {
    "not base64": "data:image/png;charset=utf-8,hello",
    "base64 but not an image": _data_url(b"definitely not a picture"),
    "decompression bomb": _data_url(_bomb()),
    "local file not allowed": "file:///etc/passwd",
    "unreachable host": "http://127.0.0.1:1/x.png",  # allow-listed below, so it is tried
}


@pytest.fixture(autouse=True)
def _allow_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEDIA_ALLOWED_HOSTS_ENV, "127.0.0.1")


@pytest.mark.parametrize("case", sorted(BAD))
def test_unloadable_media_is_a_client_error(case: str) -> None:
    with pytest.raises(VLLMValidationError) as info:
        asyncio.run(CONNECTOR.load_from_url_async(BAD[case], ImageMediaIO(), fetch_timeout=5))
    assert str(info.value).startswith("media could not be loaded from the "), str(info.value)
    assert info.value.parameter == "image_url"
    assert len(str(info.value)) < 1000, "the payload must not be echoed back"


def test_upstream_leaves_them_server_errors() -> None:
    """Why the wrapper exists: the same inputs escape vLLM's own connector as non-client errors."""
    raw = MediaConnector()
    for case in ("not base64", "decompression bomb", "local file not allowed"):
        with pytest.raises(Exception) as info:
            asyncio.run(raw.load_from_url_async(BAD[case], ImageMediaIO(), fetch_timeout=5))
        assert not isinstance(info.value, VLLMClientError), case


def test_a_good_image_loads_unchanged() -> None:
    url = _data_url(_png(7, 5))
    ours = asyncio.run(CONNECTOR.load_from_url_async(url, ImageMediaIO(), fetch_timeout=5))
    theirs = asyncio.run(MediaConnector().load_from_url_async(url, ImageMediaIO(), fetch_timeout=5))
    assert ours.size == theirs.size == (7, 5)
    assert ours.tobytes() == theirs.tobytes()


def test_sync_load_maps_too() -> None:
    with pytest.raises(VLLMValidationError):
        CONNECTOR.load_from_url(BAD["not base64"], ImageMediaIO())


def test_install_wraps_the_configured_connector_once() -> None:
    before = MEDIA_CONNECTOR_REGISTRY.name2class["http"]
    try:
        install_media_error_mapping()
        wrapped = MEDIA_CONNECTOR_REGISTRY.name2class["http"]
        assert wrapped.wrapped is before  # type: ignore[attr-defined]
        install_media_error_mapping()
        assert MEDIA_CONNECTOR_REGISTRY.name2class["http"] is wrapped
    finally:
        MEDIA_CONNECTOR_REGISTRY.name2class["http"] = before


class _CountingImageServer(ThreadingHTTPServer):
    hits = 0


@pytest.fixture
def image_server() -> Iterator[_CountingImageServer]:
    """A local HTTP server that serves one PNG and counts the requests it gets."""
    png = _png(3, 2)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.server.hits += 1  # type: ignore[attr-defined]
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    server = _CountingImageServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("allowed", ["", "example.com", "localhost"])
def test_a_host_not_allowed_is_refused_without_a_fetch(
    monkeypatch: pytest.MonkeyPatch, image_server: _CountingImageServer, allowed: str
) -> None:
    """The check d08's rule at the loader, so every endpoint that loads media obeys it."""
    monkeypatch.setenv(MEDIA_ALLOWED_HOSTS_ENV, allowed)
    url = f"http://127.0.0.1:{image_server.server_port}/cat.png"
    with pytest.raises(VLLMValidationError, match="remote host") as info:
        asyncio.run(CONNECTOR.load_from_url_async(url, ImageMediaIO(), fetch_timeout=5))
    assert info.value.parameter == "image_url"
    with pytest.raises(VLLMValidationError, match="remote host"):
        CONNECTOR.load_from_url(url, ImageMediaIO())
    with pytest.raises(VLLMValidationError, match="unsupported URL scheme"):
        CONNECTOR.load_from_url("gopher://127.0.0.1/x.png", ImageMediaIO())
    assert image_server.hits == 0


def test_an_allowed_host_is_fetched(
    monkeypatch: pytest.MonkeyPatch, image_server: _CountingImageServer
) -> None:
    monkeypatch.setenv(MEDIA_ALLOWED_HOSTS_ENV, "example.com,127.0.0.1")
    url = f"http://127.0.0.1:{image_server.server_port}/cat.png"
    # its own HTTP sessions: the shared one is bound to an earlier test's closed event loop
    connector = client_error_connector(MediaConnector)(connection=HTTPConnection())
    image = asyncio.run(connector.load_from_url_async(url, ImageMediaIO(), fetch_timeout=5))
    assert image.size == (3, 2) and image_server.hits == 1
    assert connector.load_from_url(url, ImageMediaIO()).size == (3, 2)
    assert image_server.hits == 2
