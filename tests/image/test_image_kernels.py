"""The image build's kernels step (``scripts/image_kernels.py``) outside an image.

It must never fail the build and must say in one line what the server will run: no CoreX clang,
a compiler that fails, or one that outlives the time limit all leave no library behind and name
the PyTorch ops. With a working clang (upstream clang-19 with CUDA 12.5 headers standing in for
CoreX's clang, at compute capability 7.0, what the card reports) it builds a library that loads
and registers ``torch.ops.vo_kernels``. The compile needs clang++ >= 19 and a torch with CUDA
libraries (the stand-in venv's 2.1.2); CI installs clang and sets ``VO_REQUIRE_CLANG=1``, which
turns a missing one into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.image.image_support import REPO_DIR

SCRIPT = REPO_DIR / "scripts" / "image_kernels.py"
CSRC = REPO_DIR / "vllm_overrides" / "native" / "csrc"
PYTORCH_OPS = "the server runs the PyTorch ops"


def torch_python() -> str | None:
    """An interpreter whose torch has CUDA libraries to link against (the image's kind)."""
    code = "import torch, os, sys; sys.exit(not os.path.exists(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cuda.so')))"  # noqa: E501
    candidates = [sys.executable, str(REPO_DIR / ".venv-v0" / "bin" / "python")]
    # the stand-in base's own venv (scripts/make_base_image.sh), where the image test built it
    candidates.append(str(REPO_DIR / "build" / "standin-base" / "venv" / "bin" / "python"))
    for py in candidates:
        if (
            os.path.exists(py)
            and subprocess.run([py, "-c", code], capture_output=True).returncode == 0
        ):
            return py
    return None


def kernels_step(
    tmp: Path, timeout: float, env: dict[str, str], python: str = sys.executable,
    csrc: Path = CSRC,
) -> tuple[subprocess.CompletedProcess, str]:  # fmt: skip
    report = tmp / "kernels-build.txt"
    dest = tmp / "dest"
    dest.mkdir(exist_ok=True)
    proc = subprocess.run(
        [python, str(SCRIPT), str(csrc), str(tmp / "no-wheels"), str(timeout),
         "--dest", str(dest), "--report", str(report)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr  # never fails the build
    first = proc.stdout.splitlines()[0]
    assert report.read_text().splitlines()[0] == first
    return proc, first


def fake_clang(tmp: Path, body: str) -> str:
    path = tmp / "clang++"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_without_corex_clang_the_pytorch_ops_serve(tmp_path: Path) -> None:
    _, line = kernels_step(tmp_path, 60, {"COREX_CLANG": str(tmp_path / "absent" / "clang++")})
    assert line.startswith("kernels: no CoreX clang at ") and PYTORCH_OPS in line
    assert not list((tmp_path / "dest").iterdir())


def test_timeout_zero_skips(tmp_path: Path) -> None:
    _, line = kernels_step(tmp_path, 0, {"COREX_CLANG": fake_clang(tmp_path, "exit 0")})
    assert line.startswith("kernels: skipped") and PYTORCH_OPS in line


def test_a_failing_compiler_leaves_nothing(tmp_path: Path) -> None:
    clang = fake_clang(tmp_path, 'echo "error: ivcore10 says no" >&2; exit 1')
    proc, line = kernels_step(tmp_path, 120, {"COREX_CLANG": clang})
    assert line.startswith("kernels: the CoreX clang build failed") and PYTORCH_OPS in line
    assert "ivcore10 says no" in proc.stdout  # the compiler's own words reach the build log
    assert not list((tmp_path / "dest").iterdir())


def test_a_slow_compiler_is_cut_off_at_the_limit(tmp_path: Path) -> None:
    clang = fake_clang(tmp_path, "sleep 600")
    start = time.monotonic()
    _, line = kernels_step(tmp_path, 15, {"COREX_CLANG": clang})
    assert time.monotonic() - start < 60  # the limit (plus start-up), not the compiler's 600 s
    assert line.startswith("kernels: not done within 15 s") and PYTORCH_OPS in line
    assert not list((tmp_path / "dest").iterdir())


def test_each_source_is_judged_on_its_own(tmp_path: Path) -> None:
    """One source refused, one outliving the limit: each is named with its own reason (the
    slow one cut off early enough for a link), and with no family left nothing is installed."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in ("module.cpp", "refused.cu", "slow.cu"):
        (csrc / name).write_text("")
    clang = fake_clang(
        tmp_path,
        'case "$*" in *slow.cu*) sleep 600 ;; *module.cpp*) exit 0 ;; *) exit 1 ;; esac',
    )
    start = time.monotonic()
    _, line = kernels_step(tmp_path, 20, {"COREX_CLANG": clang}, csrc=csrc)
    assert time.monotonic() - start < 60
    assert line.startswith("kernels: the CoreX clang build failed (no family; left out"), line
    assert "refused (compile error), slow (timeout)" in line and PYTORCH_OPS in line, line
    assert not list((tmp_path / "dest").iterdir())


def cuda_home_for_clang(tmp: Path, fatbinary: str) -> Path:
    """The CUDA 12.5 headers and ptxas (``cuda_toolchain``) plus a ``fatbinary`` that speaks
    clang 19's ``--image=profile=...`` to a CUDA >= 12.4 fatbinary (``--image3=kind=...``)."""
    from scripts import cuda_toolchain

    shared = cuda_toolchain.clang_cuda_home(REPO_DIR / "build" / "cuda12-clang")
    home = tmp / "cuda-home"
    (home / "bin").mkdir(parents=True)
    for part in ("include", "nvvm"):
        (home / part).symlink_to(shared / part)
    (home / "bin" / "ptxas").symlink_to(shared / "bin" / "ptxas")
    wrapper = home / "bin" / "fatbinary"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do\n'
        "  case $a in\n"
        "    --image=profile=sm_*) a=$(echo \"$a\" | sed 's/--image=profile=sm_/--image3=kind=elf,sm=/') ;;\n"
        "    --image=profile=compute_*) a=$(echo \"$a\" | sed 's/--image=profile=compute_/--image3=kind=ptx,sm=/') ;;\n"
        "  esac\n"
        '  set -- "$@" "$a"; shift\n'
        "done\n"
        f'exec {fatbinary} "$@"\n'
    )  # fmt: skip
    wrapper.chmod(0o755)
    return home


def clang_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    """The step's environment for upstream clang-19 at sm_70 and an interpreter whose torch
    (2.1, CUDA build) it links against; skips (or fails under VO_REQUIRE_CLANG=1) without."""
    from scripts import clang_kernels_check as cc
    from scripts import cuda_toolchain

    clang, python, fatbinary = cc.find_clang(), torch_python(), shutil.which("fatbinary")
    if clang is None or python is None or fatbinary is None:
        if os.environ.get("VO_REQUIRE_CLANG") == "1":
            pytest.fail(
                f"VO_REQUIRE_CLANG=1 but clang++ >= 19: {clang}, CUDA torch: {python}, "
                f"fatbinary: {fatbinary}"
            )
        pytest.skip("needs clang++ >= 19, fatbinary and a torch with CUDA libraries (.venv-v0)")
    home = cuda_home_for_clang(tmp_path, fatbinary)
    stubs = cuda_toolchain.write_stubs(REPO_DIR / "build" / "cuda12-clang")
    cudart = subprocess.run(
        [python, "-c", "import nvidia.cuda_runtime as m; print(m.__path__[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip() + "/lib"  # fmt: skip
    env = {
        "COREX_CLANG": clang,
        "COREX_CUDA_PATH": str(home),
        "COREX_GPU_ARCH": "sm_70",
        # upstream clang instead of CoreX's: CUDA 12.5 is newer than it knows, and the stubs
        # stand for the cuBLAS/cuSPARSE headers torch's CUDA headers include. -O0: this checks
        # the build's plumbing (flags, link, load, registration), not the code, at a third of
        # the compile time.
        "VO_NVCC_FLAGS": f"-O0 -Wno-unknown-cuda-version -Wno-c++20-extensions -I{stubs}",
        "VO_KERNELS_LDFLAGS": f"-L{cudart} -l:libcudart.so.12",
    }
    return env, python


def registered(tmp_path: Path, python: str, ops: list[str]) -> dict[str, bool]:
    """Which of ``ops`` the built library registers, imported in a fresh interpreter."""
    code = (
        "import sys, json, torch, vo_native_kernels\n"
        "print(json.dumps({n: hasattr(torch.ops.vo_kernels, n) for n in sys.argv[1:]}))"
    )
    check = subprocess.run(
        [python, "-c", code, *ops],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "dest"), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    return json.loads(check.stdout.splitlines()[-1])


def test_clang_builds_a_library_that_registers_the_ops(tmp_path: Path) -> None:
    env, python = clang_env(tmp_path)
    clang = env["COREX_CLANG"]
    proc, line = kernels_step(tmp_path, 1500, env, python)
    assert line.startswith(f"kernels: built with {clang}") and "and imports" in line, proc.stdout
    families = sorted(p.stem for p in CSRC.glob("*.cu"))
    assert f"and imports: {', '.join(families)} (" in line and "left out" not in line, line
    ops = ["gdn_decode", "gdn_conv_prep", "gdn_chunk_prefill", "moe_route", "moe_grouped_gemm",
           "paged_decode", "paged_prefill", "paged_write_kv", "qk_norm_rope_gate"]  # fmt: skip
    assert all(registered(tmp_path, python, ops).values())


def test_a_source_that_does_not_compile_leaves_the_other_families_in(tmp_path: Path) -> None:
    """One family's source broken (a syntax error, as a compiler that refuses it would leave
    it): the library ships with the others' ops and the line names the one left out. Two
    small families keep the compile short; the full set builds in the test above."""
    env, python = clang_env(tmp_path)
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in ("module.cpp", "common.cuh", "cpu_emulation.h", "gdn_conv.cu"):
        shutil.copy2(CSRC / name, csrc / name)
    source = (CSRC / "moe_prefill.cu").read_text()
    broken = source.replace('#include "common.cuh"', '#include "common.cuh"\nthis is not C++;', 1)
    (csrc / "moe_prefill.cu").write_text(broken)
    proc, line = kernels_step(tmp_path, 1500, env, python, csrc)
    assert line.startswith(f"kernels: built with {env['COREX_CLANG']}"), proc.stdout
    left_out = "left out (their PyTorch ops serve): moe_prefill (compile error)"
    assert f"and imports: gdn_conv; {left_out} (" in line, line
    # the compiler's complaint reaches the report
    assert "this is not C++" in (tmp_path / "kernels-build.txt").read_text()
    got = registered(tmp_path, python, ["gdn_conv_prep", "moe_route", "moe_permute"])
    assert got == {"gdn_conv_prep": True, "moe_route": False, "moe_permute": False}
