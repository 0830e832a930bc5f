"""What the Dockerfile says, read without building it (the build itself: ``make image-test``).

Its default ``FROM`` is the platform's base image, it sets the CoreX environment PLATFORM.md
lists, and none of its steps reaches for a network (the CI build with ``--network=none`` proves
the last one for the stand-in base; this names the offending step on any base).
"""

from __future__ import annotations

import re

from scripts.build_context import dockerfile_sources
from tests.image.image_support import REPO_DIR

DOCKERFILE = REPO_DIR / "Dockerfile"
PLATFORM_BASE = "harbor.4pd.io/modelhubxc/enginex-iluvatar/bi100-3.2.3-x86-ubuntu20.04-py3.10-poc-llm-infer:v1.2.3"
COREX_ENV = {
    "PATH": ["/usr/local/corex/bin", "/usr/local/corex-3.2.3/bin", "/usr/local/openmpi/bin"],
    "PYTHONPATH": [
        "/usr/local/corex/lib64/python3/dist-packages",
        "/usr/local/corex/lib/python3/dist-packages",
    ],
    "LD_LIBRARY_PATH": [
        "/usr/local/corex/lib",
        "/usr/local/corex/lib64",
        "/usr/local/corex-3.2.3/lib",
        "/usr/local/corex-3.2.3/lib64",
        "/usr/local/openmpi/lib",
    ],
}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_default_base_is_the_platforms_image() -> None:
    steps = instructions()
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    assert args["BASE_IMAGE"] == PLATFORM_BASE
    froms = [rest for word, rest in steps if word == "FROM"]
    assert froms == ["${BASE_IMAGE}"]  # one stage, and the build arg decides it


def test_corex_environment_is_set_before_any_step_runs() -> None:
    steps = instructions()
    env = " ".join(rest for word, rest in steps if word == "ENV")
    first_run = next(i for i, (word, _) in enumerate(steps) if word == "RUN")
    first_env = next(i for i, (word, _) in enumerate(steps) if word == "ENV")
    assert first_env < first_run
    for name, paths in COREX_ENV.items():
        m = re.search(rf"\b{name}=(\S+)", env)
        assert m, name
        # what the base set stays after ours: ${NAME:+:${NAME}} (or :${PATH})
        value = re.sub(r"\$\{\w+:\+:\$\{\w+\}\}$", "", m.group(1)).split(":")
        assert value[: len(paths)] == paths, (name, value)


def test_no_step_reaches_for_the_network() -> None:
    offending = re.compile(
        r"\b(curl|wget|git clone|apt-get|apt |pip3? install(?![^;&|]*--no-index)|"
        r"python3? -m pip install(?![^;&|]*--no-index))"
    )
    for word, rest in instructions():
        if word == "RUN":
            assert not offending.search(rest), rest
        if word == "ADD":
            assert "://" not in rest, rest


def test_build_context_holds_what_the_steps_read() -> None:
    sources = dockerfile_sources(DOCKERFILE)
    for must in (
        "patch_ops.sh",
        "patches",
        "vllm_overrides",
        "computility-run.yaml",
        "scripts/image_kernels.py",
        "build-inputs/kernels",
    ):
        assert must in sources, sources
    for path in sources:
        assert (REPO_DIR / path).exists(), path
