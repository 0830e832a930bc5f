"""A dead engine must take the server down, visibly and with a failure status.

PLATFORM.md's replay lists "a dead engine (every later request fails)": a server that keeps its
port open and answers every request with an error turns one crash into a failed run. What the
platform can act on is a failing health check and a process that exits non-zero (then it
restarts it). So: SIGKILL the engine core of a real server and require

* ``/health`` to fail (non-200 or no connection) within ``HEALTH_FAIL_S``, and
* the API server process to exit with a non-zero status within ``EXIT_S``.

The server test starts its own server (not the session fixture: it kills it). The watchdog
module that provides the non-zero exit (``vllm_overrides.engines.v1_0_32.engine_watchdog``) is also tested
without a server, on a stand-in app, including its hard-exit deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import pytest

from tests.serverlib import REPO_DIR, start_local_server, stop_process_group, wait_healthy

HEALTH_FAIL_S = 15.0  # vLLM's monitor notices a dead child at once; the check is one poll
EXIT_S = 90.0  # vLLM's watchdog polls every 5 s, then shuts down; the hard deadline is 30 s
LOG_PATH = REPO_DIR / "build" / "robustness" / "engine-death-server.log"


def _engine_core(api_server_pid: int) -> psutil.Process:
    """The EngineCore child of the API server (vLLM titles it ``VLLM::EngineCore``)."""
    for child in psutil.Process(api_server_pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if title.startswith("VLLM::EngineCore"):
            return child
    raise AssertionError(f"no VLLM::EngineCore process under pid {api_server_pid}")


@pytest.mark.server
@pytest.mark.slow
def test_killed_engine_core_fails_health_and_exits_nonzero() -> None:
    if os.environ.get("VLLM_BASE_URL"):
        pytest.skip("needs a local server it may kill")
    # 1 GiB of KV cache instead of the default 4: this server runs beside the session server on
    # a small CI box, and the amount of KV is irrelevant to what is tested.
    # No compilation and no image budget: a start in well under half the time, and neither
    # matters to what is tested.
    proc, base_url = start_local_server(
        LOG_PATH,
        extra_args=["--enforce-eager", "--limit-mm-per-prompt", '{"image": 0, "video": 0}'],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        wait_healthy(base_url, proc, LOG_PATH)
        with httpx.Client(base_url=base_url, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": "llm", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        engine = _engine_core(proc.pid)
        killed_at = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)

        health_failed_after = None
        while time.monotonic() - killed_at < HEALTH_FAIL_S:
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code != 200:
                    health_failed_after = time.monotonic() - killed_at
                    break
            except httpx.HTTPError:
                health_failed_after = time.monotonic() - killed_at
                break
            time.sleep(0.2)
        assert health_failed_after is not None, f"/health still 200 {HEALTH_FAIL_S:.0f} s after"

        try:
            code = proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"API server still running {EXIT_S:.0f} s after") from None
        exited_after = time.monotonic() - killed_at
        log = LOG_PATH.read_text(errors="replace")
        assert code != 0, (
            f"API server exited with status 0 after {exited_after:.1f} s: a supervisor sees a "
            f"clean stop and does not restart it. Log tail:\n{log[-3000:]}"
        )
        print(
            f"\nengine killed: /health failed after {health_failed_after:.1f} s, "
            f"server exited {code} after {exited_after:.1f} s"
        )
    finally:
        stop_process_group(proc)


# ----------------------------------------------------------------------------------------------
# The watchdog on a stand-in app (no server, seconds)
# ----------------------------------------------------------------------------------------------

_STAND_IN = textwrap.dedent(
    """
    import sys, threading, time
    from types import SimpleNamespace
    from vllm_overrides.engines.v1_0_32.engine_watchdog import install_engine_watchdog

    class Handler:  # stands in for AsyncLLM.output_handler (an asyncio.Task)
        state = "running"

        def done(self):
            return self.state != "running"

        def cancelled(self):
            return self.state == "cancelled"

    app = SimpleNamespace(state=SimpleNamespace())
    poll_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    install_engine_watchdog(app, poll_s=poll_s, exit_deadline_s=float(sys.argv[2]))
    time.sleep(0.3)
    handler = Handler()
    app.state.engine_client = SimpleNamespace(output_handler=handler)
    time.sleep(0.3)  # alive engine: nothing happens
    print("alive", flush=True)
    # the engine died (the handler returned) or a shutdown was requested (it was cancelled)
    handler.state = "cancelled" if sys.argv[1].startswith("shutdown") else "returned"
    if sys.argv[1].endswith("_stateless"):  # vLLM's shutdown dropped app.state before exit
        del app.state
        sys.exit(0)
    if sys.argv[1] == "returns_now":  # the server's shutdown beats the watchdog's next poll
        sys.exit(0)
    if sys.argv[1] in ("returns", "shutdown"):
        time.sleep(0.5)  # the server's own shutdown finishes; main returns normally
        sys.exit(0)
    threading.Event().wait()  # shutdown hangs: only the deadline ends the process
    """
)


def _run_stand_in(
    mode: str, deadline_s: float, env: dict[str, str] | None = None, poll_s: float = 0.05
):
    return subprocess.run(
        [sys.executable, "-c", _STAND_IN, mode, str(deadline_s), str(poll_s)],
        cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(REPO_DIR), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_watchdog_turns_a_clean_exit_after_engine_death_into_a_failure() -> None:
    out = _run_stand_in("returns", deadline_s=30)
    assert "alive" in out.stdout
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "engine core is dead" in out.stderr


def test_watchdog_exit_status_when_the_shutdown_beats_its_poll() -> None:
    """The server stops (status 0) before the watchdog's next poll has seen the dead engine:
    the exit hook looks once more, and the status is still the failure."""
    out = _run_stand_in("returns_now", deadline_s=30, poll_s=10.0)
    assert "alive" in out.stdout
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "engine core is dead" in out.stderr


def test_watchdog_exit_hook_survives_a_dropped_app_state() -> None:
    """vLLM's shutdown can drop ``app.state`` before the exit hook runs (seen on a SIGTERM'd
    replay server: "Exception ignored in atexit callback ... no attribute 'state'"): a requested
    shutdown still exits 0 without a traceback, and a death the watchdog had not polled yet is
    still found through the engine client it saw while the server ran."""
    out = _run_stand_in("shutdown_stateless", deadline_s=30, poll_s=0.05)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "dead" not in out.stderr, out.stderr
    out = _run_stand_in("returns_stateless", deadline_s=30, poll_s=0.05)
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr


def test_watchdog_ends_a_hung_shutdown_at_its_deadline() -> None:
    t0 = time.monotonic()
    out = _run_stand_in("hangs", deadline_s=1.0)
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert time.monotonic() - t0 < 30
    assert "did not finish" in out.stderr


def test_watchdog_respects_keep_alive() -> None:
    out = _run_stand_in("returns", deadline_s=1.0, env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    assert out.returncode == 0, out.stderr


def test_watchdog_leaves_a_requested_shutdown_alone() -> None:
    """SIGTERM: vLLM cancels the output handler; the exit status stays vLLM's own (0)."""
    out = _run_stand_in("shutdown", deadline_s=1.0)
    assert out.returncode == 0, out.stderr
    assert "dead" not in out.stderr
