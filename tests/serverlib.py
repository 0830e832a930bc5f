"""The server under test: start, wait, stop, and talk to it (used by the fixtures)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_DIR = Path(__file__).resolve().parents[1]
TINY_MODEL = Path(os.environ.get("TINY_MODEL", REPO_DIR / "build" / "tiny-model"))
STARTUP_TIMEOUT_S = float(os.environ.get("SERVER_STARTUP_TIMEOUT", "1500"))


@dataclass
class Server:
    base_url: str
    model: str
    api_key: str | None = None
    log_path: Path | None = None  # None when the server is not ours (VLLM_BASE_URL)
    max_model_len: int = 0

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=timeout)

    def openai(self, timeout: float = 300.0):  # noqa: ANN201 - openai is imported lazily
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.api_key or "EMPTY", timeout=timeout
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen | None, log: Path | None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-6000:] if log else ""
            raise RuntimeError(f"server exited with {proc.returncode} before healthy:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server at {base_url} not healthy after {STARTUP_TIMEOUT_S:.0f} s")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_local_server(
    log_path: Path,
    extra_args: list[str] = (),
    env: dict[str, str] | None = None,
    launcher_args: list[str] = (),
) -> tuple[subprocess.Popen, str]:
    """Start the patched server from the launcher (the YAML) on a free port; return (proc, url)."""
    if not (TINY_MODEL / "config.json").exists():
        raise RuntimeError(f"{TINY_MODEL} missing: run `make setup` (or make test)")
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "vllm_overrides.launcher", "--cpu", "--model", str(TINY_MODEL),
        "--host", "127.0.0.1", "--port", str(port), *launcher_args, "--", *extra_args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_DIR, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"
