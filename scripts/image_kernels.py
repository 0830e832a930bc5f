"""The image build's kernels step: ``vo_native_kernels`` for the base's torch, or a reason why not.

    python3 scripts/image_kernels.py CSRC WHEEL_DIR TIMEOUT_S [--dest DIR] [--report FILE]

In order, the first that applies:

1. a prebuilt ``vo_native_kernels-*.whl`` in WHEEL_DIR (``scripts/build_kernels_wheel.sh`` on a
   machine with the card's stack): installed with ``pip --no-index --no-deps``;
2. the base's CoreX clang (``COREX_CLANG``, default ``/usr/local/corex-3.2.3/bin/clang++``) is
   there: every ``CSRC/*.cu`` and ``module.cpp`` compiled with it (``--cuda-gpu-arch=ivcore10
   --cuda-path=/usr/local/corex-3.2.3 --no-cuda-version-check``, PLATFORM.md) in parallel, then
   the objects that compiled linked into ``DEST/vo_native_kernels.so`` (DEST: the folder
   holding torch). Direct clang calls, not torch's ``cpp_extension``: it wants ninja (absent)
   or nvcc (a stub on the base). All of it under one TIMEOUT_S deadline; 0 skips it;
3. neither: nothing is installed.

Each ``.cu`` is one op family (its ``TORCH_LIBRARY_FRAGMENT`` registers that family's ops;
``module.cpp`` only makes the library a Python module), so a source the compiler refuses or
does not finish in time is left out and the other families still ship: the server runs that
family's PyTorch ops (``kernels.py`` logs it per family). If the library then does not link or
import, each family is tried left out once more (a link and an import each: cheap).

A result counts only if ``import vo_native_kernels`` then registers the ops of every family
built (the names each ``.cu`` passes to ``m.def``) in a fresh interpreter with no GPU visible
(``CUDA_VISIBLE_DEVICES=""``); otherwise it is removed. Never fails (exit 0): without the
kernels the server runs the PyTorch ops and ``vllm_overrides/native/kernels.py`` logs that.
The outcome is one line (``kernels: ...``: the families built and those left out, and why) on
stdout and in the report file (``/workspace/kernels-build.txt``), the compiler output after it.

Knobs for other toolchains (the CI test drives this step with upstream clang and CUDA headers):
``COREX_CUDA_PATH``, ``COREX_GPU_ARCH``, ``VO_NVCC_FLAGS`` (extra compile flags, space
separated), ``VO_KERNELS_LDFLAGS`` (replaces ``-L<cuda>/lib64 -lcudart``), ``KERNELS_JOBS``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def family_ops(source: Path) -> list[str]:
    """The ops a kernel source registers (its ``m.def("name(...``): what the import check asks
    of its family."""
    return re.findall(r'm\.def\(\s*"(\w+)\(', source.read_text(encoding="utf-8", errors="replace"))


class Build:
    """What a clang build produced: the library (None: nothing usable), the families in it and
    those left out with why."""

    def __init__(self) -> None:
        self.library: Path | None = None
        self.built: list[str] = []
        self.left_out: dict[str, str] = {}
        self.timed_out = False  # every failure was the deadline (nothing else went wrong)

    def summary(self) -> str:
        text = ", ".join(self.built) or "no family"
        if self.left_out:
            out = ", ".join(f"{f} ({why})" for f, why in self.left_out.items())
            text += f"; left out (their PyTorch ops serve): {out}"
        return text


def compile_with_clang(
    clang: str, csrc: Path, dest: Path, deadline: Deadline, log: list[str]
) -> Build:
    """Compile each kernel source on its own, link those that compiled into ``dest`` and check
    that the library imports with their ops (leaving out one more family at a time if not)."""
    build = Build()
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
        return build
    # Compiles stop early enough to leave time for the link and import checks of what did
    # compile: a source that outlives them is left out, not the whole step.
    compile_deadline = Deadline(deadline.left() - min(90.0, deadline.left() / 4))
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [
            [clang, *device, *common, *extra, "-c", str(s), "-o", f"{tmp}/{s.stem}.o"]
            for s in sources
        ]
        jobs.append([clang, "-x", "c++", *common, "-c", str(csrc / "module.cpp"), "-o",
                     f"{tmp}/module.o"])  # fmt: skip
        logs: list[list[str]] = [[] for _ in jobs]

        def compile_one(i: int) -> str:
            try:
                return "" if run(jobs[i], compile_deadline, logs[i]) else "compile error"
            except subprocess.TimeoutExpired:
                return "timeout"

        workers = int(os.environ.get("KERNELS_JOBS", "0")) or os.cpu_count() or 1
        with ThreadPoolExecutor(workers) as pool:
            failed = list(pool.map(compile_one, range(len(jobs))))
        for part in logs:
            log.extend(part)
        build.timed_out = all(f in ("", "timeout") for f in failed)
        for name, why in zip([s.stem for s in sources] + ["module.cpp"], failed, strict=True):
            if why:
                build.left_out[name] = why
        if failed[-1]:  # module.cpp: no library without it
            return build
        families = {s.stem: family_ops(s) for s, why in zip(sources, failed, strict=False)
                    if not why}  # fmt: skip
        if not families:
            return build
        build.timed_out = False
        # All that compiled; if that does not link or import, each one left out in turn.
        tries = [list(families)] + [[f for f in families if f != drop] for drop in families]
        if len(families) == 1:
            tries = tries[:1]
        for names in tries:  # past the deadline, run() raises TimeoutExpired
            if try_library(clang, tmp, names, families, facts, cuda, dest, deadline, log):
                build.library, build.built = dest / f"{NAME}.so", names
                for f in families:
                    if f not in names:
                        build.left_out[f] = "link or import failed"
                return build
        build.left_out.update(dict.fromkeys(families, "link or import failed"))
        return build


def try_library(
    clang: str, tmp: str, names: list[str], families: dict[str, list[str]], facts: dict,
    cuda: str, dest: Path, deadline: Deadline, log: list[str],
) -> bool:  # fmt: skip
    """Link ``names``' objects with module.o into ``dest`` and check that it imports with
    their ops; a library that does not is removed."""
    ldflags = os.environ.get("VO_KERNELS_LDFLAGS", f"-L{cuda}/lib64 -L{cuda}/lib -lcudart")
    out = dest / f"{NAME}.so"
    link = [
        clang, "-shared", "-o", f"{tmp}/{NAME}.so", *(f"{tmp}/{n}.o" for n in names),
        f"{tmp}/module.o", f"-L{facts['lib']}", "-lc10", "-ltorch", "-ltorch_cpu",
        "-ltorch_python", "-lc10_cuda", "-ltorch_cuda", *ldflags.split(),
    ]  # fmt: skip
    if not run(link, deadline, log):
        return False
    shutil.copy2(f"{tmp}/{NAME}.so", out)
    ops = [op for n in names for op in families[n]]
    if set(import_check(ops, deadline, log, dest)) == set(ops):
        return True
    out.unlink(missing_ok=True)
    return False


def import_check(
    ops: list[str], deadline: Deadline, log: list[str], where: Path | None = None
) -> list[str]:
    """Which of ``ops`` the library registers when imported in a fresh interpreter (with no GPU
    visible); [] if it does not import. ``where``: a folder to import from first (a build's
    destination off the default path)."""
    code = (
        f"import sys, torch, {NAME}\n"
        "print('registered:', *[n for n in sys.argv[1:] if hasattr(torch.ops.vo_kernels, n)])\n"
        f"print('{NAME} imports:', {NAME}.__file__)\n"
    )
    env = dict(NO_GPU)
    if where is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), env.get("PYTHONPATH")]))
    if not run([sys.executable, "-c", code, *ops], deadline, log, env):
        return []
    line = next((x for x in log[-1].splitlines() if x.startswith("registered:")), "registered:")
    return line.split()[1:]


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
            ops = {s.stem: family_ops(s) for s in sorted(csrc.glob("*.cu"))}
            got = set(import_check([o for v in ops.values() for o in v], deadline, log)) if run(
                cmd, deadline, log) else set()  # fmt: skip
            if got:
                missing = [f for f, v in ops.items() if not set(v) <= got]
                tail = f"; without {', '.join(missing)}: their PyTorch ops" if missing else ""
                return f"kernels: prebuilt {wheels[-1].name} installed and imports{tail}"
            run([*pip, "uninstall", "-y", "vo-native-kernels"], deadline, log)
            return f"kernels: prebuilt {wheels[-1].name} did not install or import: {TORCH_OPS}"
        if not (os.path.isfile(clang) and os.access(clang, os.X_OK)):
            return f"kernels: no CoreX clang at {clang}: {TORCH_OPS}"
        dest = dest or Path(torch_facts()["site"])
        build = compile_with_clang(clang, csrc, dest, deadline, log)
        if build.library is not None:
            where = f"built with {clang} into {build.library}"
            return f"kernels: {where} and imports: {build.summary()}"
        if build.timed_out:
            raise subprocess.TimeoutExpired(clang, timeout)
        return f"kernels: the CoreX clang build failed ({build.summary()}): {TORCH_OPS}"
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
