"""Media a client sends that cannot be loaded is the client's error: a 400, never a 5xx.

vLLM 0.32.0 maps only some media failures to 4xx (``_wrap_media_fetch_error``: HTTP 4xx from the
remote host, malformed URLs). Everything else escapes as a raw exception and the server answers
500 or 501, and uvicorn logs "Exception in ASGI application": a data URL that is not base64
(``NotImplementedError``, 501), an image over PIL's decompression-bomb limit
(``DecompressionBombError``, 500), a ``file://`` URL without ``--allowed-local-media-path``
(``RuntimeError``, 500), a host that cannot be reached (500). The request cannot be served as
sent, so the answer is a 400 that says why (tests/robustness/test_fuzz.py found each of them).

vLLM's extension point for media loading is its connector registry (``VLLM_MEDIA_CONNECTOR``,
default ``http``). ``install_media_error_mapping`` re-registers the configured connector's name
with a subclass that converts load failures into ``VLLMValidationError``; what loads is unchanged,
except that a URL the server would have to fetch is refused first unless the operator allow-listed
its host (``request_compat.check_media_url``). The middleware already refuses those in chat
requests; here the same rule covers every other endpoint that loads media (``/v1/responses``,
``/v1/messages``, ``/tokenize`` with messages), so no request makes the server fetch anything.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_overrides.request_compat import CompatError, check_media_url, media_allowed_hosts

logger = logging.getLogger("vllm.overrides.media_errors")

_MAX_REASON_CHARS = 300  # a data URL can be megabytes: never echo it whole


def _client_error(url: str, exc: Exception) -> Exception:
    from vllm.exceptions import VLLMClientError, VLLMValidationError

    if isinstance(exc, VLLMClientError):
        return exc  # vLLM already answers it with a 4xx
    kind = "data URL" if url[:5].lower() == "data:" else "URL"
    reason = f"{type(exc).__name__}: {exc}"[:_MAX_REASON_CHARS]
    return VLLMValidationError(
        f"media could not be loaded from the {kind} in the request ({reason})",
        parameter="image_url",
    )


def refuse_unlisted_remote_url(url: str) -> None:
    """A URL the server would fetch from a host the operator did not allow is a 400, unfetched."""
    from vllm.exceptions import VLLMValidationError

    try:
        check_media_url(url, "image_url", media_allowed_hosts())
    except CompatError as exc:
        raise VLLMValidationError(exc.message, parameter="image_url") from None


def client_error_connector(base: type) -> type:
    """A subclass of the connector class ``base`` whose load failures are client errors."""

    class ClientErrorMediaConnector(base):  # type: ignore[misc, valid-type]
        def load_from_url(self, url: str, *args: Any, **kwargs: Any) -> Any:
            refuse_unlisted_remote_url(url)
            try:
                return super().load_from_url(url, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every load failure is the input's
                raise _client_error(url, exc) from exc

        async def load_from_url_async(self, url: str, *args: Any, **kwargs: Any) -> Any:
            refuse_unlisted_remote_url(url)
            try:
                return await super().load_from_url_async(url, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every load failure is the input's
                raise _client_error(url, exc) from exc

    ClientErrorMediaConnector.__qualname__ = f"ClientError{base.__name__}"
    ClientErrorMediaConnector.wrapped = base  # type: ignore[attr-defined]
    return ClientErrorMediaConnector


def install_media_error_mapping() -> None:
    """Wrap the configured media connector (once per process)."""
    from vllm import envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    name = envs.VLLM_MEDIA_CONNECTOR
    base = MEDIA_CONNECTOR_REGISTRY.name2class.get(name)
    if base is None:
        logger.warning("media connector %r is not registered: media errors left as vLLM's", name)
        return
    if hasattr(base, "wrapped"):
        return
    MEDIA_CONNECTOR_REGISTRY.register(name)(client_error_connector(base))
