"""Images through the platform line's OpenAI server (the launcher's ``--cpu`` start from
``computility-run.yaml``, the tiny model): what the evaluator sends -- a base64 PNG, several
images in one message -- is served, and an image that cannot be used is a 400 with an OpenAI
error body for that request only: the engine keeps serving.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from v0_model_harness import REPO, TINY_MODEL

from tests.native_engine.hf_oracle import make_image

START_TIMEOUT_S = 420


def _png(array: Any) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    import httpx

    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: build it with `make model`")
    port = _free_port()
    log = (REPO / "build" / "v0-images-server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_overrides.launcher", "--cpu", "--model", str(TINY_MODEL),
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {START_TIMEOUT_S} s; see {log.name}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _chat(url: str, images: list[str], text: str = "What is in the picture?") -> Any:
    import httpx

    content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    content.append({"type": "text", "text": text})
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def _error_message(response: Any) -> str:
    """The message of an OpenAI-style error body (vLLM's flat one or the nested one)."""
    body = response.json()
    if isinstance(body.get("error"), dict):
        return str(body["error"]["message"])
    assert body.get("object") == "error", body
    return str(body["message"])


def _healthy(url: str) -> None:
    r = _chat(url, [], "hello")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_base64_png_is_served(server: str) -> None:
    text_only = _chat(server, [])
    assert text_only.status_code == 200, text_only.text
    # 64 x 64 pixels: scaled up to the processor's 65,536-pixel minimum, 256 x 256 = 64 tokens.
    r = _chat(server, [_png(make_image("quadrants", 64, 64))])
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4
    # The image's pad became its 64 tokens (the placeholder's own 3 were 1 pad + start / end).
    assert usage["prompt_tokens"] >= text_only.json()["usage"]["prompt_tokens"] + 64


def test_several_images_in_one_message(server: str) -> None:
    one = _chat(server, [_png(make_image("gradient", 256, 320))])
    three = _chat(
        server,
        [
            _png(make_image(*s))
            for s in (("gradient", 256, 320), ("noise", 288, 256), ("quadrants", 64, 64))
        ],
    )
    assert one.status_code == 200 and three.status_code == 200, (one.text, three.text)
    # 80 + 72 + 64 tokens against 80, plus two more placeholders' start / end tokens.
    extra = three.json()["usage"]["prompt_tokens"] - one.json()["usage"]["prompt_tokens"]
    assert extra >= 72 + 64


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,AAAAAAAA",  # not an image: the server cannot decode it
        "data:image/png;base64,%%%notbase64",  # not base64
    ],
)
def test_undecodable_image_is_a_400(server: str, url: str) -> None:
    r = _chat(server, [url])
    assert r.status_code == 400, r.text
    assert _error_message(r)
    _healthy(server)


def test_unusable_image_is_a_400_and_the_engine_lives(server: str) -> None:
    """Decodes, but the model's processor refuses it (aspect ratio 300:1): refused at admission
    in the engine, for this request only."""
    import numpy as np

    r = _chat(server, [_png(np.zeros((2, 600, 3), dtype=np.uint8))])
    assert r.status_code == 400, r.text
    assert "aspect ratio" in _error_message(r)
    _healthy(server)


def test_audio_is_a_4xx(server: str) -> None:
    """The model takes images only: an audio part is the client's error, not a 500."""
    import httpx

    content = [
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRiQAAABXQVZF"}},
        {"type": "text", "text": "hi"},
    ]
    body = {"model": "llm", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert 400 <= r.status_code < 500, r.text
    _healthy(server)
