"""The running container is started the way the platform starts it.

It runs the command of ``computility-run.yaml`` with the file's ``env`` (plus only the launcher's
documented CPU overrides), the model read-only at ``/model``, and the overlay deployed in the
image verifies. Run by ``scripts/image_test.sh`` while the container serves (with the ``server``
tests from the rest of the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.image.image_support import podman
from vllm_overrides.launcher import CPU_ENV_DEFAULTS, RunConfig, get_flag, load_run_config

pytestmark = [pytest.mark.server, pytest.mark.image]

# The launcher's documented CPU overrides (vllm_overrides/launcher.py --cpu, --model, and
# --host/--port with NETWORK=host); every other flag must be exactly the file's.
OVERRIDDEN = {"--model", "--dtype", "--tensor-parallel-size", "-tp", "--max-model-len"}


@pytest.fixture(scope="module")
def run_yaml(build_context: Path) -> RunConfig:
    """The launch file the image was built with (its copy in the build snapshot)."""
    return load_run_config(build_context / "computility-run.yaml")


def _exec(container: str, *cmd: str) -> subprocess.CompletedProcess:
    return podman("exec", "-w", "/", container, *cmd, timeout=300)


def _proc1(container: str, what: str) -> list[str]:
    out = podman("exec", container, "cat", f"/proc/1/{what}", check=True).stdout
    return [x for x in out.split("\0") if x]


def test_process_is_the_yaml_command(container: str, run_yaml: RunConfig) -> None:
    yaml_cmd = run_yaml.command
    running = _proc1(container, "cmdline")
    configured = json.loads(
        podman("inspect", "--format", "{{json .Config.Cmd}}", container, check=True).stdout
    )
    assert running == configured, "PID 1 is not the command the container was given"
    assert running[:3] == yaml_cmd[:3], running  # python3 -m vllm.entrypoints.openai.api_server
    overridden = set(OVERRIDDEN)
    if os.environ.get("IMAGE_TEST_NETWORK", "bridge") == "host":
        overridden |= {"--host", "--port"}
    for i, arg in enumerate(yaml_cmd):
        if not arg.startswith("-") or arg in overridden:
            continue
        has_value = i + 1 < len(yaml_cmd) and not yaml_cmd[i + 1].startswith("-")
        if has_value:
            assert get_flag(running, arg) == yaml_cmd[i + 1], arg
        else:
            assert arg in running, arg
    assert get_flag(running, "--model") == "/model"
    assert get_flag(running, "--chat-template") == get_flag(yaml_cmd, "--chat-template")


def test_process_env_has_the_yaml_env(container: str, run_yaml: RunConfig) -> None:
    env = dict(x.split("=", 1) for x in _proc1(container, "environ") if "=" in x)
    for name, value in run_yaml.env.items():
        # the launcher's documented CPU settings (--cpu) win over the file's, nothing else does
        assert env.get(name) == CPU_ENV_DEFAULTS.get(name, value), name


def test_model_is_mounted_read_only(container: str) -> None:
    mounts = json.loads(
        podman("inspect", "--format", "{{json .Mounts}}", container, check=True).stdout
    )
    model = [m for m in mounts if m["Destination"] == "/model"]
    assert len(model) == 1 and model[0]["RW"] is False, mounts
    assert _exec(container, "touch", "/model/written").returncode != 0


def test_port_is_published_on_loopback_only(container: str) -> None:
    if os.environ.get("IMAGE_TEST_NETWORK", "bridge") == "host":
        pytest.skip("host networking: the server itself binds 127.0.0.1 (--host)")
    ports = json.loads(
        podman("inspect", "--format", "{{json .HostConfig.PortBindings}}", container).stdout
    )
    bindings = [b for spec in ports.values() for b in (spec or [])]
    assert bindings and all(b["HostIp"] == "127.0.0.1" for b in bindings), ports


def test_overlay_verifies_inside_the_image(container: str) -> None:
    proc = _exec(container, "env", "PYTHON=python3", "bash", "/workspace/patch_ops.sh", "verify")
    assert proc.returncode == 0, proc.stdout
    assert "verify: OK" in proc.stdout


def test_image_runs_the_platforms_stack(container: str) -> None:
    """Python 3.10 and vLLM 0.6.3 / torch from the base's CoreX path (not a venv of ours)."""
    code = "import sys, torch, vllm; print(sys.version_info[1], vllm.__version__, vllm.__file__)"
    proc = _exec(container, "python3", "-c", code)
    assert proc.returncode == 0, proc.stdout
    minor, version, where = proc.stdout.split()[-3:]
    assert minor == "10" and version.split("+")[0] == "0.6.3", proc.stdout
    assert where.startswith("/usr/local/corex/lib64/python3/dist-packages/vllm/"), where
