"""The image build's kernels step: ``vo_native_kernels`` for the base's torch, or a reason why not.

    python3 scripts/image_kernels.py CSRC WHEEL_DIR TIMEOUT_S [--dest DIR] [--report FILE]

In order, the first that applies:

1. a prebuilt ``vo_native_kernels-*.whl`` in WHEEL_DIR (``scripts/build_kernels_wheel.sh`` on a
   machine with the card's stack): installed with ``pip --no-index --no-deps``;
2. the base's CoreX clang (``COREX_CLANG``, default ``/usr/local/corex-3.2.3/bin/clang++``) is
   there: every ``CSRC/*.cu`` and ``module.cpp`` compiled with it (``--cuda-gpu-arch=ivcore10
   --cuda-path=/usr/local/corex-3.2.3 --no-cuda-version-check``, PLATFORM.md) in parallel, then
   linked into ``DEST/vo_native_kernels.so`` (DEST: the folder holding torch). Direct clang
   calls, not torch's ``cpp_extension``: it wants ninja (absent) or nvcc (a stub on the base).
   All of it under one TIMEOUT_S deadline; 0 skips it;
3. neither: nothing is installed.

A result counts only if ``import vo_native_kernels`` then registers ``torch.ops.vo_kernels`` in
a fresh interpreter with no GPU visible (``CUDA_VISIBLE_DEVICES=""``); otherwise it is removed.
Never fails (exit 0): without the kernels the server runs the PyTorch ops and
``vllm_overrides/native/kernels.py`` logs that. The outcome is one line (``kernels: ...``) on
stdout and in the report file (``/workspace/kernels-build.txt``), the compiler output after it.

Knobs for other toolchains (the CI test drives this step with upstream clang and CUDA headers):
``COREX_CUDA_PATH``, ``COREX_GPU_ARCH``, ``VO_NVCC_FLAGS`` (extra compile flags, space
separated), ``VO_KERNELS_LDFLAGS`` (replaces ``-L<cuda>/lib64 -lcudart``), ``KERNELS_JOBS``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAME = "vo_native_kernels"
# The macros torch's nvcc flags define (cpp_extension.COMMON_NVCC_FLAGS): our sources are
# written against them, so clang gets the same.
TORCH_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
TORCH_OPS = "the server runs the PyTorch ops"


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.0)


def run(
    cmd: list[str], deadline: Deadline, log: list[str], env: dict[str, str] | None = None
) -> bool:
    """Run ``cmd`` within what is left of ``deadline``; its output goes to ``log``. On timeout
    its whole process group is killed (a compiler driver's children too) and TimeoutExpired
    raised."""
    log.append("$ " + shlex.join(cmd))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or NO_GPU,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=deadline.left() or 0.001)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        log.append("(timed out)")
        raise
    log.append(out[-20000:])
    return proc.returncode == 0


def torch_facts() -> dict:
    """Include paths, C++ ABI and library folder of this interpreter's torch (no GPU touched)."""
    code = (
        "import json, os, torch\n"
        "from torch.utils.cpp_extension import include_paths\n"
        "print(json.dumps({'includes': include_paths(),"
        " 'abi': int(torch._C._GLIBCXX_USE_CXX11_ABI),"
        " 'lib': os.path.join(os.path.dirname(torch.__file__), 'lib'),"
        " 'site': os.path.dirname(os.path.dirname(torch.__file__))}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=NO_GPU, check=True,
        timeout=300,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def compile_with_clang(
    clang: str, csrc: Path, dest: Path, deadline: Deadline, log: list[str]
) -> Path | None:
    """Compile and link the extension into ``dest``; None if any step fails."""
    facts = torch_facts()
    cuda = os.environ.get("COREX_CUDA_PATH", "/usr/local/corex-3.2.3")
    arch = os.environ.get("COREX_GPU_ARCH", "ivcore10")
    common = [
        "-std=c++17", "-O3", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={facts['abi']}",
        f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{i}" for i in facts["includes"]), f"-I{sysconfig.get_paths()['include']}",
        f"-I{csrc}",
    ]  # fmt: skip
    device = [
        "-x", "cuda", f"--cuda-gpu-arch={arch}", f"--cuda-path={cuda}", "--no-cuda-version-check",
        *TORCH_DEFINES,
    ]  # fmt: skip
    extra = os.environ.get("VO_NVCC_FLAGS", "").split()  # last: they override ours
    sources = sorted(csrc.glob("*.cu"))
    if not sources or not (csrc / "module.cpp").is_file():
        log.append(f"no kernel sources in {csrc}")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [
            [clang, *device, *common, *extra, "-c", str(s), "-o", f"{tmp}/{s.stem}.o"]
            for s in sources
        ]
        jobs.append([clang, "-x", "c++", *common, "-c", str(csrc / "module.cpp"), "-o",
                     f"{tmp}/module.o"])  # fmt: skip
        logs: list[list[str]] = [[] for _ in jobs]
        workers = int(os.environ.get("KERNELS_JOBS", "0")) or os.cpu_count() or 1
        with ThreadPoolExecutor(workers) as pool:
            ok = list(pool.map(lambda i: run(jobs[i], deadline, logs[i]), range(len(jobs))))
        for part in logs:
            log.extend(part)
        if not all(ok):
            return None
        ldflags = os.environ.get("VO_KERNELS_LDFLAGS", f"-L{cuda}/lib64 -L{cuda}/lib -lcudart")
        out = dest / f"{NAME}.so"
        link = [
            clang, "-shared", "-o", f"{tmp}/{NAME}.so", *sorted(glob.glob(f"{tmp}/*.o")),
            f"-L{facts['lib']}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
            "-lc10_cuda", "-ltorch_cuda", *ldflags.split(),
        ]  # fmt: skip
        if not run(link, deadline, log):
            return None
        shutil.copy2(f"{tmp}/{NAME}.so", out)
        return out


def import_check(deadline: Deadline, log: list[str], where: Path | None = None) -> bool:
    """The ops register in a fresh interpreter (with no GPU visible); ``where``: a folder to
    import from first (a build's destination off the default path)."""
    code = (
        f"import torch, {NAME}\n"
        "assert hasattr(torch.ops.vo_kernels, 'gdn_decode'), 'no vo_kernels ops registered'\n"
        f"print('{NAME} imports:', {NAME}.__file__)\n"
    )
    env = dict(NO_GPU)
    if where is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), env.get("PYTHONPATH")]))
    return run([sys.executable, "-c", code], deadline, log, env)


def kernels_step(
    csrc: Path, wheel_dir: Path, timeout: float, dest: Path | None, log: list[str]
) -> str:
    """Do the step; return its one-line outcome."""
    wheels = sorted(wheel_dir.glob(f"{NAME}-*.whl")) if wheel_dir.is_dir() else []
    clang = os.environ.get("COREX_CLANG", "/usr/local/corex-3.2.3/bin/clang++")
    if timeout <= 0:
        return f"kernels: skipped (KERNELS_BUILD_TIMEOUT=0): {TORCH_OPS}"
    deadline = Deadline(timeout)
    try:
        if wheels:
            pip = [sys.executable, "-m", "pip"]
            cmd = [*pip, "install", "--no-index", "--no-deps", str(wheels[-1])]
            if run(cmd, deadline, log) and import_check(deadline, log):
                return f"kernels: prebuilt {wheels[-1].name} installed and imports"
            run([*pip, "uninstall", "-y", "vo-native-kernels"], deadline, log)
            return f"kernels: prebuilt {wheels[-1].name} did not install or import: {TORCH_OPS}"
        if not (os.path.isfile(clang) and os.access(clang, os.X_OK)):
            return f"kernels: no CoreX clang at {clang}: {TORCH_OPS}"
        dest = dest or Path(torch_facts()["site"])
        built = compile_with_clang(clang, csrc, dest, deadline, log)
        if built is None:
            return f"kernels: the CoreX clang build failed: {TORCH_OPS}"
        if import_check(deadline, log, dest):
            return f"kernels: built with {clang} into {built} and imports"
        built.unlink(missing_ok=True)
        return f"kernels: built but does not import: {TORCH_OPS}"
    except subprocess.TimeoutExpired:
        if dest is not None:
            (dest / f"{NAME}.so").unlink(missing_ok=True)
        return f"kernels: not done within {timeout:.0f} s: {TORCH_OPS}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csrc", type=Path)
    ap.add_argument("wheel_dir", type=Path)
    ap.add_argument("timeout", type=float)
    ap.add_argument("--dest", type=Path, default=None, help="default: the folder holding torch")
    ap.add_argument("--report", type=Path, default=Path("/workspace/kernels-build.txt"))
    args = ap.parse_args()
    log: list[str] = []
    start = time.monotonic()
    try:
        outcome = kernels_step(args.csrc, args.wheel_dir, args.timeout, args.dest, log)
    except Exception as e:  # noqa: BLE001 - the step must never fail the image build
        outcome = f"kernels: step error {type(e).__name__}: {e}: {TORCH_OPS}"
    outcome += f" ({time.monotonic() - start:.0f} s)"
    print(outcome, flush=True)
    if log:
        print("\n".join(log)[-8000:])
    try:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(outcome + "\n" + "\n".join(log) + "\n", encoding="utf-8")
    except OSError as e:
        print(f"kernels: report not written: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
