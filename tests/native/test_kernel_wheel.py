"""The kernel wheel's packaging: ``scripts/build_kernels_wheel.sh`` builds a wheel that installs
and registers ``torch.ops.vo_kernels``, and ``kernels.py`` finds it the way the image does
(``import vo_native_kernels``).

CPU CI builds the wheel's test flavour (``VO_KERNELS_CPU_EMULATION=1``: the same sources and
packaging, kernels on host threads); the CUDA flavour is built on a GPU machine
(``scripts/gpu_kernel_tests.sh`` covers the kernels there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import torch
from vllm_overrides.native import kernels, rmsnorm
assert kernels.extension_loaded(), kernels._load_error
x, w = torch.randn(3, 256), torch.randn(256) * 0.1
got = torch.ops.vo_kernels.gemma_rms_norm(x, w, 1e-6)
err = float((got - rmsnorm.gemma_rms_norm(x, w, 1e-6)).abs().max())
assert err < 1e-5, err
print("wheel ok", sorted(n for n in dir(torch.ops.vo_kernels) if not n.startswith("_"))[:6])
"""


def test_wheel_builds_installs_and_registers_the_ops(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "VO_KERNELS_CPU_EMULATION": "1"}
    build = subprocess.run(
        ["bash", "scripts/build_kernels_wheel.sh", str(tmp_path / "wh")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    wheels = list((tmp_path / "wh").glob("vo_native_kernels-*.whl"))
    assert len(wheels) == 1
    assert not list((REPO / "vllm_overrides/native/csrc").glob("*.egg-info"))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         str(wheels[0])],
        check=True, timeout=300,
    )  # fmt: skip
    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{site}:{REPO}", "NATIVE_KERNELS_JIT": "0"},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "wheel ok" in probe.stdout
