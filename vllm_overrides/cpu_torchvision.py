"""Make PyPI's torchvision importable beside a CPU-only torch (development and CPU images only).

Why: vLLM's Qwen3-VL/Qwen3.5 processor imports transformers' torchvision-backed Qwen2-VL image
processor unconditionally. PyPI's x86-64 torchvision wheels are CUDA builds; beside
``torch==2.13.0+cpu`` their compiled ``_C.so`` cannot load (it links libtorch_cuda), which
torchvision tolerates, except that ``torchvision/_meta_registrations.py`` registers fake kernels
for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the ops exist, so
``import torchvision`` raises ``operator torchvision::nms does not exist``.

How: declare the schemas of exactly those two operators (no kernels). The import then succeeds and
the pure-PyTorch transforms the image processor uses work; calling ``torchvision.ops.nms`` still
fails loudly, as it must, since no kernel exists. Nothing is declared when ``_C.so`` loads.

``python -m vllm_overrides.cpu_torchvision install`` writes a ``.pth`` file into site-packages that
adds an import hook: the first ``import torchvision`` runs :func:`declare_missing_ops` first (so
interpreters that never import torchvision never import torch for it). A no-op on GPU torch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "vllm_overrides_cpu_torchvision.pth"
HOOK_MODULE = "_vllm_overrides_cpu_torchvision"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # kept alive: dropping a torch.library.Library removes its definitions


def _torchvision_ops_load() -> bool:
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torchvision: nothing to repair
    lib = Path(list(spec.submodule_search_locations)[0]) / "_C.so"
    if not lib.exists():
        return False
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError):
        return False
    return True


def declare_missing_ops() -> bool:
    """Declare torchvision's two fake-registered op schemas if its C++ ops cannot load."""
    global _LIBRARY
    try:
        import torch
    except ImportError:
        return False
    if torch.version.cuda is not None or _LIBRARY is not None:
        return False
    if _torchvision_ops_load():
        return False
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)
    return True


class _BeforeTorchvision:
    """A meta-path finder that finds nothing; it only runs the repair before torchvision loads."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            declare_missing_ops()
        return None


def add_import_hook() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


def install(site_packages: Path) -> Path:
    # A standalone copy of this module, so that interpreter start-up does not import (and pin)
    # the vllm_overrides package: patch_ops.sh must be able to run a checkout's newer copy.
    shutil.copyfile(__file__, site_packages / f"{HOOK_MODULE}.py")
    pth = site_packages / PTH_NAME
    pth.write_text(f"import {HOOK_MODULE} as m; m.add_import_hook()\n", encoding="utf-8")
    return pth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "check"])
    args = parser.parse_args()
    if args.action == "install":
        print(f"wrote {install(Path(sysconfig.get_paths()['purelib']))}")
        return 0
    import torchvision  # noqa: F401  (raises if the repair is missing)

    print(f"torchvision {torchvision.__version__} imports beside torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
