"""A prompt the platform line's engine can never schedule is a 400 through the real server (the
launcher's ``--cpu`` start from ``computility-run.yaml``, the tiny model, a deliberately small
KV pool), a prompt that fits is still served after it, and the stand-in's block counts follow
from the block size ``make preflight``'s V0 model computes.

With ``--num-gpu-blocks-override 200`` and ``--max-model-len 3200`` (200 blocks of 16), V0's
block manager keeps ``int(0.01 * 200) = 2`` blocks as its watermark, so a prompt of 3,185+
tokens (200 blocks) passes the API's length check but is never scheduled: 0.6.3 answered it
with a 200 and no tokens.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from v0_model_harness import REPO, TINY_MODEL

from vllm_overrides import preflight as pf
from vllm_overrides.launcher import CPU_V0_KVCACHE_GIB, CPU_V0_SWAP_GIB

START_TIMEOUT_S = 420
BLOCKS = 200
MAX_LEN = BLOCKS * pf.V0_BLOCK_SIZE
LOG = REPO / "build" / "v0-never-scheduled-server.log"
# The server's KV GiB: the caller's VLLM_CPU_KVCACHE_SPACE wins over the launcher's --cpu value.
KV_GIB: list[int] = []


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
    KV_GIB.append(int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_V0_KVCACHE_GIB))
    log = LOG.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_overrides.launcher", "--cpu", "--model", str(TINY_MODEL),
         "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_LEN),
         "--num-gpu-blocks-override", str(BLOCKS)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}; see {LOG}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {START_TIMEOUT_S} s; see {LOG}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _prompt(tokens: int) -> list[int]:
    """A token-id prompt of exactly ``tokens`` ids (the completions endpoint takes ids)."""
    return [1000 + i % 5000 for i in range(tokens)]


def test_never_schedulable_prompt_is_a_400_and_the_server_keeps_serving(server: str) -> None:
    import httpx

    watermark = int(pf.V0_WATERMARK * BLOCKS)
    too_long = (BLOCKS - watermark) * pf.V0_BLOCK_SIZE + 1  # one block more than schedulable
    assert too_long + 4 <= MAX_LEN  # the API's own length check lets it through
    for stream in (False, True):
        body = {"model": "llm", "prompt": _prompt(too_long), "max_tokens": 4,
                "stream": stream}  # fmt: skip
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=300)
        assert r.status_code == 400, r.text
        error = r.json()["error"]  # OpenAI's error body (api.py rewrites 0.6.3's)
        assert error["code"] == 400 and "can never be scheduled" in error["message"]
    fits = (BLOCKS - watermark) * pf.V0_BLOCK_SIZE - 64
    body = {"model": "llm", "prompt": _prompt(fits), "max_tokens": 4}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] >= 1 and choice["finish_reason"]
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=300).status_code == 200


def _chat_of(server: str, tokens: int) -> list[dict[str, str]]:
    """A user message whose rendered chat prompt is ``tokens`` tokens long (the server's own
    /tokenize counts; " a" is one token of the tiny model's tokenizer)."""
    import httpx

    words = tokens
    for _ in range(4):
        messages = [{"role": "user", "content": "a" + " a" * (words - 1)}]
        r = httpx.post(f"{server}/tokenize", json={"model": "llm", "messages": messages},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        count = r.json()["count"]
        if count == tokens:
            return messages
        words += tokens - count
    raise AssertionError(f"could not render a {tokens}-token chat prompt")


def test_chat_never_schedulable_is_a_400_streamed_or_not(server: str) -> None:
    import httpx

    watermark = int(pf.V0_WATERMARK * BLOCKS)
    messages = _chat_of(server, (BLOCKS - watermark) * pf.V0_BLOCK_SIZE + 1)
    for stream in (False, True):
        body = {"model": "llm", "messages": messages, "max_tokens": 4, "stream": stream}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 400, r.text
        assert "can never be scheduled" in r.json()["error"]["message"]


def test_standin_block_count_is_the_preflights(server: str) -> None:
    """The stand-in sizes its pools as V0's worker does (``get_cache_block_size`` over the
    attention layers ``layers_block_type`` names): ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV and
    ``--swap-space`` GiB of swap, over the preflight's block bytes of the tiny model (float32,
    TP1: 1 attention layer of 2 kv heads x 256 -> 64 KiB a block)."""
    text = LOG.read_text(encoding="utf-8", errors="replace")
    gpu = re.search(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override", text)
    cpu = re.search(r"# GPU blocks: (\d+), # CPU blocks: (\d+)", text)
    assert gpu and cpu, f"no block counts in {LOG}"
    block = pf.v0_block_bytes(pf.ModelFacts.load(TINY_MODEL / "config.json"), tp=1, dtype_bytes=4)
    assert int(gpu.group(1)) == KV_GIB[-1] * pf.GIB // block
    assert int(cpu.group(1)) == BLOCKS
    assert int(cpu.group(2)) == int(float(CPU_V0_SWAP_GIB) * pf.GIB) // block
