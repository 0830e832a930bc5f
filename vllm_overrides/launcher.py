"""Start the server from ``computility-run.yaml``, the one source of truth for launch arguments.

The platform runs the file's ``command`` with its ``env``. Every local use (``make serve``, the
test fixture, the container test) goes through this module, which takes that same command and
changes only what a local machine must change. Each engine generation has its launch file:
``computility-run.yaml`` (the platform's: vLLM 0.6.3, the V0 engine) and
``vllm_overrides/engines/v1_0_32/computility-run.yaml`` (the 0.32.0 reference line); the default
is the one for the vLLM installed beside this module (``COMPUTILITY_RUN_YAML`` overrides it).

    python -m vllm_overrides.launcher [--model PATH] [--tp N] [--max-model-len N] [--port N]
                                      [--host H] [--cpu] [--print] [-- EXTRA VLLM ARGS...]

``--cpu`` applies the CPU settings: the dtype of the engine's CPU path (0.32.0: ``bfloat16``,
vLLM's CPU Gated-DeltaNet kernel only runs in bf16; 0.6.3: ``float32``, our ops in exact
arithmetic, as the oracle tests run them; ``--swap-space 1``, see ``CPU_V0_SWAP_GIB``; and a
largest image of ``CPU_V0_MAX_IMAGE_PIXELS``), tensor
parallel 1 unless ``--tp`` says otherwise,
and, unless the caller set them, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM otherwise reserves
one of two cores, doubling prefill time), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and a
long ``VLLM_RPC_TIMEOUT`` (the V0 engine's heartbeat; see ``CPU_ENV_DEFAULTS``).
Paths under ``/workspace/`` (where the image keeps the overlay) resolve to this checkout when the
directory does not exist. Environment variables set by the caller win over the file's ``env``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_DIR = Path(__file__).resolve().parent.parent
PLATFORM_CONFIG = REPO_DIR / "computility-run.yaml"
V1_0_32_CONFIG = Path(__file__).resolve().parent / "engines" / "v1_0_32" / "computility-run.yaml"


def installed_vllm() -> str | None:
    """The installed vLLM's version without its local label (``0.6.3+corex.3.2.3`` -> 0.6.3),
    read as ``patch_ops.sh`` reads it (no vLLM import: the launcher starts in a blink)."""
    from vllm_overrides.patching import PatchError, find_vllm_site, installed_vllm_version

    try:
        return installed_vllm_version(find_vllm_site()).split("+")[0]
    except (PatchError, OSError):
        return None


def default_config() -> Path:
    """The launch file of the installed engine generation (the platform's when in doubt)."""
    if "COMPUTILITY_RUN_YAML" in os.environ:
        return Path(os.environ["COMPUTILITY_RUN_YAML"])
    return V1_0_32_CONFIG if installed_vllm() == "0.32.0" else PLATFORM_CONFIG


DEFAULT_CONFIG = default_config()
# The dtype of each engine's CPU path (module docstring).
CPU_DTYPE = {"0.32.0": "bfloat16"}
CPU_DTYPE_DEFAULT = "float32"
# V0 keeps --swap-space GiB of host memory for preempted sequences' KV (4 by default, per rank).
# On a CPU machine that is RAM on top of the KV "device" pool: a 6.3 GB engine process for the
# tiny model, and the out-of-memory killer took it while the tests ran beside other work.
CPU_V0_SWAP_GIB = "1"
# The largest image (pixels) on the V0 CPU stand-in, through the model's own operator knob
# (--mm-processor-kwargs, see engines/v0/qwen3_5_mm.py): the start-up profile encodes an image
# as large as one prefill chunk holds, which on two CPU cores took minutes at the checkpoint's
# 16,777,216 pixels; 1024 x 1024 pixels is 1,024 tokens.
CPU_V0_MAX_IMAGE_PIXELS = 1024 * 1024
# V0's block manager never schedules a prompt that needs more than its KV blocks less a 1 %
# watermark: it answers 200 with no tokens. 1 GiB holds exactly 262,144 of the tiny model's
# float32 tokens, so a prompt near the context got nothing; 2 GiB leaves the headroom.
CPU_V0_KVCACHE_GIB = "2"
WORKSPACE = "/workspace/"
# VLLM_RPC_TIMEOUT (ms): V0's engine reports itself dead when one engine step outlasts 3x this,
# and its API server exits when the engine's heartbeat is silent 1x this. Two shared CPU cores
# run a step ~100x slower than the card; a dead engine is still found within two minutes.
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_RPC_TIMEOUT": "120000",
}
# Flags that name the same option; the first spelling is the one we write.
ALIASES = {"--tensor-parallel-size": ("--tensor-parallel-size", "-tp")}


@dataclass
class RunConfig:
    concurrency: int
    command: list[str]
    env: dict[str, str]


def load_run_config(path: Path = DEFAULT_CONFIG) -> RunConfig:
    """Read and check the platform's schema: concurrency, command (argv), env [{name, value}]."""
    raw: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a mapping")
    command = raw.get("command")
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise ValueError(f"{path}: command must be a list of strings")
    env: dict[str, str] = {}
    for item in raw.get("env") or []:
        if not isinstance(item, dict) or set(item) != {"name", "value"}:
            raise ValueError(f"{path}: env items must be {{name, value}}: {item!r}")
        if not isinstance(item["value"], str):
            raise ValueError(f"{path}: env {item['name']} value must be a string")
        env[item["name"]] = item["value"]
    concurrency = raw.get("concurrency")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"{path}: concurrency must be a positive integer")
    return RunConfig(concurrency, command, env)


def _spellings(flag: str) -> tuple[str, ...]:
    for names in ALIASES.values():
        if flag in names:
            return names
    return (flag,)


def get_flag(argv: list[str], flag: str) -> str | None:
    names = _spellings(flag)
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def set_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """Replace (or append) ``flag value``; ``value=None`` removes the flag and its value."""
    names = _spellings(flag)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in names:
            i += 2
            continue
        if any(arg.startswith(n + "=") for n in names):
            i += 1
            continue
        out.append(arg)
        i += 1
    if value is not None:
        out += [names[0], value]
    return out


def server_args(command: list[str]) -> list[str]:
    """The vLLM arguments of the command (what follows ``-m vllm.entrypoints...``)."""
    for i, arg in enumerate(command):
        if arg == "-m" and i + 1 < len(command):
            return command[i + 2 :]
    raise ValueError("command does not run a Python module with -m")


def build_launch(
    config: RunConfig,
    *,
    model: str | None = None,
    tp: int | None = None,
    max_model_len: int | None = None,
    port: int | None = None,
    host: str | None = None,
    cpu: bool = False,
    workspace: Path | None = None,
    extra: list[str] | None = None,
    python: str = sys.executable,
    base_env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Return (argv, env) for a local start; nothing beyond the documented overrides changes.

    ``env`` holds only the variables the launch sets (the file's and the CPU defaults), each
    with the caller's value where the caller set it; the process inherits everything else.
    """
    argv = list(config.command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python
    for flag, value in (
        ("--model", model),
        ("--tensor-parallel-size", None if tp is None else str(tp)),
        ("--max-model-len", None if max_model_len is None else str(max_model_len)),
        ("--port", None if port is None else str(port)),
        ("--host", host),
    ):
        if value is not None:
            argv = set_flag(argv, flag, value)
    if workspace is None and not Path(WORKSPACE).is_dir():
        workspace = REPO_DIR
    if workspace is not None:
        argv = [
            str(workspace / a[len(WORKSPACE) :]) if a.startswith(WORKSPACE) else a for a in argv
        ]
    if cpu:
        engine = installed_vllm() or ""
        argv = set_flag(argv, "--dtype", CPU_DTYPE.get(engine, CPU_DTYPE_DEFAULT))
        if engine == "0.6.3":
            argv = set_flag(argv, "--swap-space", CPU_V0_SWAP_GIB)
            argv = set_flag(
                argv,
                "--mm-processor-kwargs",
                json.dumps({"max_pixels": CPU_V0_MAX_IMAGE_PIXELS}),
            )
        if tp is None:  # one CPU process; -tp N would ask for N workers
            argv = set_flag(argv, "--tensor-parallel-size", "1")
    argv += extra or []
    caller = os.environ if base_env is None else base_env
    cpu_env = dict(CPU_ENV_DEFAULTS)
    if cpu and installed_vllm() == "0.6.3":
        cpu_env["VLLM_CPU_KVCACHE_SPACE"] = CPU_V0_KVCACHE_GIB
    wanted = {**config.env, **(cpu_env if cpu else {})}
    # The caller's variables win over the file's (and over the CPU defaults).
    return argv, {k: caller.get(k, v) for k, v in wanted.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--model")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument(
        "--port", type=int, default=int(os.environ["PORT"]) if "PORT" in os.environ else None
    )
    parser.add_argument("--host")
    parser.add_argument("--cpu", action="store_true", help="CPU settings (see module doc)")
    parser.add_argument("--workspace", type=Path, help="directory standing in for /workspace")
    parser.add_argument("--print", action="store_true", help="print argv, env as JSON")
    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    config = load_run_config(args.config)
    cmd, env = build_launch(
        config,
        model=args.model,
        tp=args.tp,
        max_model_len=args.max_model_len,
        port=args.port,
        host=args.host,
        cpu=args.cpu,
        workspace=args.workspace,
        extra=extra,
    )
    if args.print:
        print(json.dumps({"argv": cmd, "env": env}, indent=2))
        return 0
    print("launch:", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
