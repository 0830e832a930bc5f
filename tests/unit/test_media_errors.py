"""Media that cannot be loaded is a client error (400), through vLLM's real MediaConnector."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from vllm_overrides.media_errors import client_error_connector, install_media_error_mapping


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
    "unknown scheme": "gopher://example.invalid/x.png",
    "unreachable host": "http://127.0.0.1:1/x.png",
}


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
