"""The container's start command, from ``computility-run.yaml`` through the launcher.

    python scripts/container_launch.py [--format nul|json|shell] [LAUNCHER ARGS...]

Runs ``python -m vllm_overrides.launcher --print --workspace /workspace LAUNCHER ARGS`` (the one
launcher; ``/workspace`` exists inside the image, so its paths stay as the file writes them) and
puts the file's own interpreter (``python3``) back as argv[0], where the launcher writes the
interpreter running it. Nothing else changes: the argv and env are the launcher's.

The image is the platform line's (vLLM 0.6.3), so the file is ``computility-run.yaml`` and this
interpreter must have vLLM 0.6.3 installed (the stand-in venv, ``.venv-v0``): the launcher's CPU
settings (``--cpu``) are those of the installed engine generation.

Output ``nul`` (for bash ``mapfile -d ''``): ``E``/``NAME=VALUE`` pairs for the environment, then
``A``/argument pairs for the command, each field NUL-terminated. ``json``: ``{"argv", "env"}``.
``shell``: ``-e NAME=VALUE ... -- ARGV`` quoted for a shell, for display.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_DIR))

from vllm_overrides.launcher import PLATFORM_CONFIG, installed_vllm, load_run_config  # noqa: E402

IMAGE_VLLM = "0.6.3"  # the engine of the image (the platform's base, or its stand-in)


def container_launch(launcher_args: list[str], config: Path = PLATFORM_CONFIG) -> dict:
    """Return {"argv": [...], "env": {...}} for the container from the launcher's --print."""
    if installed_vllm() != IMAGE_VLLM:
        raise SystemExit(
            f"{sys.executable} has vLLM {installed_vllm()}, the image {IMAGE_VLLM}: run this with "
            "the stand-in venv's interpreter (.venv-v0/bin/python), whose CPU settings are the "
            "image's"
        )
    cmd = [sys.executable, "-m", "vllm_overrides.launcher", "--config", str(config), "--print"]
    cmd += ["--workspace", "/workspace", *launcher_args]
    out = subprocess.run(cmd, cwd=REPO_DIR, check=True, capture_output=True, text=True).stdout
    spec = json.loads(out)
    argv: list[str] = spec["argv"]
    yaml_python = load_run_config(config).command[0]
    if argv[0] != sys.executable:
        raise SystemExit(f"launcher argv[0] is {argv[0]!r}, expected this interpreter")
    argv[0] = yaml_python
    return {"argv": argv, "env": spec["env"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["nul", "json", "shell"], default="nul")
    parser.add_argument("--config", type=Path, default=PLATFORM_CONFIG)
    args, launcher_args = parser.parse_known_args()
    spec = container_launch(launcher_args, args.config)
    if args.format == "json":
        print(json.dumps(spec, indent=2))
    elif args.format == "shell":
        env = [f"-e {shlex.quote(f'{k}={v}')}" for k, v in spec["env"].items()]
        print(" ".join([*env, "--", shlex.join(spec["argv"])]))
    else:
        fields = [x for k, v in spec["env"].items() for x in ("E", f"{k}={v}")]
        fields += [x for a in spec["argv"] for x in ("A", a)]
        sys.stdout.write("".join(f + "\0" for f in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
