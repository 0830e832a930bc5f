"""In the stand-in venv, ``import scripts`` finds this repository's ``scripts/``.

gguf 0.10 (a vLLM 0.6.3 requirement) installs its command-line tools as a top-level ``scripts``
package. A regular package wins over a namespace package (our ``scripts/`` has no
``__init__.py``) wherever both are on ``sys.path``, so ``from scripts.build_context import ...``
failed under ``.venv-v0``. ``scripts/standin_v0/build_env.sh`` removes gguf's copy.
"""

from __future__ import annotations

import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_scripts_is_the_repository_folder() -> None:
    scripts = importlib.import_module("scripts")
    # (the repository may be on sys.path twice: pytest's rootdir and pyproject's pythonpath)
    assert {Path(p).resolve() for p in scripts.__path__} == {REPO / "scripts"}
    build_context = importlib.import_module("scripts.build_context")
    assert Path(build_context.__file__).resolve() == REPO / "scripts" / "build_context.py"
