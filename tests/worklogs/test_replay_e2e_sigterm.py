"""worklogs/replay_e2e.py: a SIGTERM ends the replay through its ``finally`` (which stops the
server it started), not at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

WORKLOGS = Path(__file__).resolve().parents[2] / "worklogs"


def test_sigterm_runs_the_finally_block(tmp_path: Path) -> None:
    marker = tmp_path / "finally-ran"
    code = (
        f"import sys, time; sys.path.insert(0, {str(WORKLOGS)!r}); import replay_e2e\n"
        "replay_e2e.exit_on_sigterm()\n"
        "try:\n    print('ready', flush=True); time.sleep(30)\n"
        f"finally:\n    open({str(marker)!r}, 'w').close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(20) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 20 and marker.exists()
    finally:
        child.kill()
