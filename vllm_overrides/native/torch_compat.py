"""The few torch APIs newer than the card's torch 2.1 that the native ops use, each behind a
feature check with a fallback (the platform's vendor torch is 2.1.0; ``.venv`` runs a current
one). ``tests/engines/v0/test_torch21_floor.py`` runs the fallbacks under torch 2.1.

* :data:`is_compiling` -- ``torch.compiler.is_compiling`` (2.3+), else
  ``torch._dynamo.is_compiling`` (2.1, 2.2), else a function returning ``False``.
* :func:`register_fake` -- ``torch.library.register_fake`` (2.4+), else
  ``torch.library.impl_abstract`` (2.2, 2.3), else nothing: torch 2.1 has no Python API for an
  op's meta function, and fakes only matter to tracing / ``torch.compile`` / CUDA graphs, which
  the card's engine (eager, vLLM 0.6.3) never runs. The ops themselves are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _resolve_is_compiling() -> Callable[[], bool]:
    public = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if public is not None:
        return public
    try:
        # Older torch: Dynamo's own flag, imported here (~1 s on torch 2.1 in a bare process;
        # vLLM 0.6.3's engine imports Dynamo anyway) so that traced code can call it.
        import torch._dynamo as dynamo

        return dynamo.is_compiling
    except Exception:  # noqa: BLE001 - a torch without Dynamo never compiles
        return lambda: False


# Whether Dynamo is tracing the caller: torch's own function itself, which Dynamo recognises.
is_compiling: Callable[[], bool] = _resolve_is_compiling()


# The API that registers a Python meta ("fake") implementation for an existing operator.
_fake_api: Callable[..., Any] | None = getattr(torch.library, "register_fake", None) or getattr(
    torch.library, "impl_abstract", None
)
FAKE_API = "none" if _fake_api is None else _fake_api.__name__


def register_fake(qualname: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` becomes the fake implementation of ``qualname`` where torch has an API
    for it (see :data:`FAKE_API`); elsewhere ``fn`` is returned unregistered."""
    if _fake_api is None:
        return lambda fn: fn
    return _fake_api(qualname)
