"""Helpers of the image tests (podman calls, paths)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[2]


def podman(*args: str, timeout: float = 900, check: bool = False) -> subprocess.CompletedProcess:
    """Run podman; stdout and stderr together in ``.stdout``."""
    proc = subprocess.run(
        ["podman", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"podman {shlex.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc
