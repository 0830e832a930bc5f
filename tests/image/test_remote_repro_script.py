"""worklogs/remote_scripts/start_platform_245k_repro.sh, checked without a GPU host.

``bash -n`` and its ``DRY_RUN=1`` mode: the printed command must be the engine's run with the
YAML's command and env verbatim, the model read-only at /model and the GPU flags of the engine.
Needs neither podman nor the image, so it runs in every test run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.image.image_support import REPO_DIR
from vllm_overrides.launcher import load_run_config

SCRIPT = REPO_DIR / "worklogs" / "remote_scripts" / "start_platform_245k_repro.sh"
YAML = REPO_DIR / "computility-run.yaml"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    return tmp_path


def dry_run(model_dir: Path, image: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), str(model_dir), image],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def printed_command(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, proc.stdout
    return shlex.split(lines[0][2:])


def test_bash_syntax_and_lf_endings() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert b"\r" not in SCRIPT.read_bytes()
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.parametrize(
    ("engine", "gpu"),
    [("docker", ["--gpus", "all"]), ("podman", ["--device", "nvidia.com/gpu=all"])],
)
def test_dry_run_prints_the_platform_command(model_dir: Path, engine: str, gpu: list[str]) -> None:
    config = load_run_config(YAML)
    argv = printed_command(dry_run(model_dir, "registry.example/vllm:gpu", ENGINE=engine))
    image_at = argv.index("registry.example/vllm:gpu")
    assert argv[:3] == [engine, "run", "-d"]
    assert argv[image_at + 1 :] == config.command, "the YAML's command must run verbatim"
    assert "262144" in config.command  # the context the repro is about
    flags = argv[3:image_at]
    for name, value in config.env.items():
        assert f"{name}={value}" in flags
    env_flags = [flags[i + 1] for i, f in enumerate(flags) if f == "-e"]
    assert len(env_flags) == len(config.env), "no environment beyond the YAML's"
    assert f"{model_dir}:/model:ro" in flags
    assert any(flags[i : i + len(gpu)] == gpu for i in range(len(flags)))
    assert "--ipc=host" in flags
    assert "127.0.0.1:8000:8000" in flags  # published on loopback only


def test_dry_run_overrides(model_dir: Path) -> None:
    argv = printed_command(
        dry_run(
            model_dir,
            "img:1",
            ENGINE="docker",
            GPU_ARGS="--device /dev/iluvatar0 --device /dev/iluvatar1",
            NETWORK="host",
        )
    )
    assert "--gpus" not in argv
    assert argv.count("--device") == 2 and "--network" in argv and "-p" not in argv


def test_refuses_a_model_dir_without_config(tmp_path: Path) -> None:
    proc = dry_run(tmp_path, "img:1")
    assert proc.returncode == 2
    assert "config.json not found" in proc.stderr
