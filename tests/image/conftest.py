"""The image tests: they need rootful podman and the image that ``scripts/image_test.sh`` built.

Tests marked ``image`` run only with ``IMAGE_TESTS=1`` (``make image-test`` sets it, with
``IMAGE_UNDER_TEST``, ``IMAGE_BUILD_ARGS`` and, while the container runs,
``IMAGE_TEST_CONTAINER``); a plain ``make test`` reports them as skipped. With ``IMAGE_TESTS=1``
nothing is skipped: a missing podman, image or container is an error, so CI cannot pass without
running them. Unmarked tests here (the remote script's dry run) need neither and always run.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from tests.image.image_support import podman

ENABLED = os.environ.get("IMAGE_TESTS") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "image: needs podman and the built image; runs with IMAGE_TESTS=1 (make image-test)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="image test: runs in `make image-test` (IMAGE_TESTS=1)")
    for item in items:
        if item.get_closest_marker("image") is not None:
            item.add_marker(skip)


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run through scripts/image_test.sh (make image-test)")
    return value


@pytest.fixture(scope="session")
def podman_ok() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed (scripts/podman_setup.sh)")


@pytest.fixture(scope="session")
def image(podman_ok: None) -> str:
    name = _required_env("IMAGE_UNDER_TEST")
    if podman("image", "exists", name).returncode != 0:
        pytest.fail(f"image {name} does not exist: build it first (scripts/image_test.sh)")
    return name


@pytest.fixture(scope="session")
def image_id(image: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", image, check=True).stdout.strip()


@pytest.fixture(scope="session")
def build_args() -> list[str]:
    """The --build-arg list the image was built with (the layer cache only hits with it)."""
    return shlex.split(_required_env("IMAGE_BUILD_ARGS"))


@pytest.fixture(scope="session")
def container(image: str) -> str:
    name = _required_env("IMAGE_TEST_CONTAINER")
    state = podman("inspect", "--format", "{{.State.Running}}", name)
    if state.stdout.strip() != "true":
        pytest.fail(f"container {name} is not running: {state.stdout.strip()}")
    return name


@pytest.fixture(scope="session")
def build_context() -> Path:
    """The snapshot of the context the image was built from (scripts/build_context.py)."""
    path = Path(_required_env("IMAGE_BUILD_CONTEXT"))
    if not (path / "Dockerfile").is_file():
        pytest.fail(f"IMAGE_BUILD_CONTEXT={path} holds no Dockerfile")
    return path
