"""worklogs/replay_e2e.py: the memory series is written as it is sampled, so a replay that is cut
short (hours on the dev VM) still shows whether the server's memory stayed flat."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import replay_e2e  # noqa: E402


def test_memory_samples_are_appended_as_taken(tmp_path: Path) -> None:
    # A parent with a child, like the launcher and vLLM's engine core.
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
         "time.sleep(30)"]
    )  # fmt: skip
    log = tmp_path / "run.memory.jsonl"
    try:
        time.sleep(1.0)  # the child has started
        sampler = replay_e2e.MemorySampler(parent.pid, every=0.05, log=log)
        sampler.start()
        deadline = time.time() + 10
        while time.time() < deadline and len(sampler.samples) < 3:
            time.sleep(0.05)
        # Before the sampler stops: the file already holds what was sampled.
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert len(lines) >= 3
        sampler.stop_event.set()
        sampler.join(5)
    finally:
        for p in replay_e2e.psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
    first = lines[0]
    assert first["rss"] == sum(first["by_process"].values()) > 0
    assert len(first["by_process"]) == 2  # the parent and its child
    assert [x["t_s"] for x in lines] == sorted(x["t_s"] for x in lines)
    assert [(x["t_s"], x["rss"]) for x in lines] == sampler.samples[: len(lines)]
