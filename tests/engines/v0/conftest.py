"""The platform line's tests run on the stand-in (``make test-v0``: ``.venv-v0``, vLLM 0.6.3).

Under any other vLLM (the 0.32.0 line's ``.venv``, which ``make test`` runs with
``--ignore=tests/engines/v0``) collecting them would import 0.6.3 internals that are not there,
so this folder is left out, and the session header says so.
"""

from __future__ import annotations

import importlib.metadata

import pytest


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


VLLM_VERSION = _vllm_version()
ON_V0 = VLLM_VERSION is not None and VLLM_VERSION.split("+")[0] == "0.6.3"

if not ON_V0:
    collect_ignore_glob = ["*.py"]


def pytest_report_header(config: pytest.Config) -> str:
    if ON_V0:
        return f"platform line: vLLM {VLLM_VERSION}"
    return f"tests/engines/v0 not collected: vLLM {VLLM_VERSION} is not 0.6.3 (make test-v0)"
