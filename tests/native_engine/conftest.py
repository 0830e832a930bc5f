"""The transformers oracle, shared by the TP1 and TP2 engine checks (computed once, cached in
build/ by the tiny model's build hash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.native_engine import hf_oracle
from tests.serverlib import REPO_DIR


def _oracle_cache() -> Path:
    info = json.loads((hf_oracle.TINY_MODEL / "tiny_model_build.json").read_text())
    key = str(info.get("hash", info.get("spec_hash", "x")))[:16]
    return REPO_DIR / "build" / f"hf_oracle_{key}.json"


@pytest.fixture(scope="session")
def oracle() -> dict[str, Any]:
    path = _oracle_cache()
    if path.exists():
        return json.loads(path.read_text())
    data = hf_oracle.compute_all()
    path.write_text(json.dumps(data))
    return data
