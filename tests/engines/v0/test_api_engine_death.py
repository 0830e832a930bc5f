"""Engine death on V0 (engines/v0/api.py): the server exits with status 3, a requested stop
with 0. Each case runs the watchdog in a child interpreter against a stand-in engine client."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import signal, sys, time, types
from vllm_overrides.engines.v0 import api

client = types.SimpleNamespace(errored=False)
app = types.SimpleNamespace(state=types.SimpleNamespace(engine_client=client))
MODE = sys.argv[1]
if MODE == "graceful":  # vLLM's SIGTERM handler shuts the server down and returns
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
elif MODE == "hung":  # a shutdown that never finishes
    signal.signal(signal.SIGTERM, lambda *_: None)
api.install_engine_watchdog(app, poll_s=0.05, exit_deadline_s=1.0)
time.sleep(0.3)
if MODE == "stop":  # a requested stop: vLLM drops app.state, then stops the engine
    del app.state
    client.errored = True
    time.sleep(0.5)
    sys.exit(0)
client.errored = True
time.sleep(10)
sys.exit(0)
"""


@pytest.mark.parametrize(("mode", "status"), [("graceful", 3), ("hung", 3), ("stop", 0)])
def test_exit_status(mode: str, status: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), mode],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]
