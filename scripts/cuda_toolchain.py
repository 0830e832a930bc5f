"""NVIDIA's CUDA compiler pieces from PyPI wheels, for kernel checks on a machine without CUDA.

Two users: ``worklogs/kernel_resources.py`` (nvcc 13.0: registers and spills, as the H200's
JIT build compiles) and ``scripts/clang_kernels_check.py`` (clang's own CUDA front end, the
kind of compiler the target's CoreX toolchain is, with CUDA 12.5 headers and libdevice).
Wheels are fetched once into a cache folder and unpacked there; nothing is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

# CUDA 13.0: the H200 machine's torch 2.11 is built against CUDA 13.0 (LEDGER, device recipe).
NVCC_13 = {
    "nvidia-cuda-nvcc": "13.0.88",
    "nvidia-nvvm": "13.0.88",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cuda-cccl": "13.0.85",
}
# nvdisasm (SASS from a cubin) has no 13.0 wheel on PyPI; 13.2's reads sm_90 cubins of 13.0.
NVDISASM = {"nvidia-cuda-nvdisasm": "13.2.51"}
# CUDA 12.5: the newest CUDA clang 19 (Debian 12's clang-19) supports; it still targets sm_70,
# the compute capability the target card reports (PLATFORM.md). Headers, libdevice, ptxas.
HEADERS_12 = {
    "nvidia-cuda-nvcc-cu12": "12.5.82",
    "nvidia-cuda-runtime-cu12": "12.5.82",
    "nvidia-cuda-cccl-cu12": "12.5.39.post1",
}

# Declarations torch's CUDA headers (and clang's CUDA wrapper) need from libraries these
# wheels do not carry (cuBLAS, cuSPARSE, cuSOLVER, cuRAND); device code never touches them.
STUBS = {
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "#include <cublas_v2.h>\ntypedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n"
    "typedef int cusparseStatus_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
    "curand_mtgp32_kernel.h": "",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def fetch(pins: dict[str, str], root: Path) -> Path:
    """Download and unpack ``pins`` into ``root`` once; return the folder holding ``nvidia/``."""
    unpacked = root / "root"
    marker = root / ".unpacked"
    want = " ".join(f"{k}=={v}" for k, v in sorted(pins.items()))
    if marker.exists() and marker.read_text() == want:
        return unpacked
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(wheels), *(f"{k}=={v}" for k, v in pins.items())],
        check=True,
    )  # fmt: skip
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(unpacked)
    for f in unpacked.glob("nvidia/**/bin/*"):
        if f.is_file():
            f.chmod(0o755)  # zip extraction drops the executable bit
    marker.write_text(want)
    return unpacked


def write_stubs(root: Path) -> Path:
    inc = root / "stubinc"
    for name, body in STUBS.items():
        p = inc / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#pragma once\n" + body)
    return inc


def clang_cuda_home(root: Path) -> Path:
    """The CUDA 12 wheels laid out as clang's ``--cuda-path`` expects (include, libdevice)."""
    src = fetch(HEADERS_12, root) / "nvidia"
    home = root / "cuda-home"
    if not (home / "include" / "cuda.h").exists():
        inc = home / "include"
        inc.mkdir(parents=True, exist_ok=True)
        for part in ("cuda_runtime", "cuda_cccl", "cuda_nvcc"):
            for f in (src / part / "include").rglob("*"):
                dst = inc / f.relative_to(src / part / "include")
                if f.is_file() and not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(f.read_bytes())
        (home / "nvvm").mkdir(parents=True, exist_ok=True)
        lib = home / "nvvm" / "libdevice"
        if not lib.exists():
            lib.symlink_to(src / "cuda_nvcc" / "nvvm" / "libdevice")
        (home / "bin").mkdir(exist_ok=True)
        ptxas = home / "bin" / "ptxas"
        if not ptxas.exists():
            ptxas.symlink_to(src / "cuda_nvcc" / "bin" / "ptxas")
    return home


def demangle(names: list[str]) -> list[str]:
    """C++ names through binutils' c++filt, the anonymous namespace our kernels sit in dropped."""
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return [n.replace("(anonymous namespace)::", "") for n in out.stdout.splitlines()]


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")


def parse_ptxas(text: str) -> list[dict]:
    """ptxas ``-v`` (nvcc ``--resource-usage``) output -> one dict per entry (mangled name)."""
    rows: list[dict] = []
    cur: dict | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            cur = {"mangled": m.group(1), "arch": m.group(2), "stack": 0,
                   "spill_stores": 0, "spill_loads": 0}  # fmt: skip
        elif cur is not None and (m := _SPILL.search(line)):
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        elif cur is not None and (m := _USED.search(line)):
            cur["registers"] = int(m.group(1))
            cur["barriers"] = int(m.group(2) or 0)
            rows.append(cur)
            cur = None
    return rows


def torch_includes() -> list[str]:
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    return [*include_paths(), sysconfig.get_paths()["include"]]


# What a SASS opcode is, for counting: tensor-core MMA, shared / global / generic / local memory,
# integer and float32 arithmetic.
SASS_CLASSES = {
    "mma": ("HMMA", "IMMA", "HGMMA"),
    "ld_shared": ("LDS", "LDSM"),
    "st_shared": ("STS",),
    "ld_global": ("LDG",),
    "ld_generic": ("LD",),  # a load nvcc could not place in a state space (bf16 wmma, LEDGER)
    "st_global": ("STG", "ST"),  # generic stores with the global ones
    "movm": ("MOVM",),  # the transposing move generic wmma loads need
    "local": ("LDL", "STL"),
    "barrier": ("BAR",),
    "int_alu": ("IMAD", "IADD3", "VIADD", "LEA", "SHF", "LOP3", "IABS"),  # mostly addresses
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "MUFU"),
}
_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_FUNC = re.compile(r"^\.text\.(\S+):$")
_LABEL = re.compile(r"^(\.L_x_\d+):$")


def sass_class_counts(opcodes: list[str]) -> dict[str, int]:
    counts = {"instructions": len(opcodes)} | {c: 0 for c in SASS_CLASSES}
    for op in opcodes:
        base = op.split(".")[0]
        for cls, bases in SASS_CLASSES.items():
            if base in bases:
                counts[cls] += 1
    return counts


def nvdisasm_path(root: Path) -> Path:
    """The pinned nvdisasm, fetched into ``root`` the first time."""
    return fetch(NVDISASM, root) / "nvidia/cu13/bin/nvdisasm"


def disassemble(nvdisasm: Path, cubin: Path) -> str:
    return subprocess.run(
        [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def sass_loops(text: str) -> dict[str, dict[str, list]]:
    """nvdisasm output -> per function (mangled name): its ``opcodes`` and its ``loops``, the
    opcodes of each backward branch's range (head to the last branch back to it), by head
    address: an outer loop before the loops it holds."""
    funcs: dict[str, list[tuple[int, str, str | None]]] = {}
    labels: dict[str, dict[str, int]] = {}
    cur: str | None = None
    pending: list[str] = []
    for line in text.splitlines():
        if m := _FUNC.match(line):
            cur = m.group(1)
            funcs[cur], labels[cur], pending = [], {}, []
        elif cur is None:
            continue
        elif m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSN.match(line):
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[cur][lab] = addr
            pending = []
            t = _TARGET.search(m.group(3)) if m.group(2).startswith("BRA") else None
            funcs[cur].append((addr, m.group(2), t.group(1) if t else None))
    out: dict[str, dict[str, list]] = {}
    for name, insns in funcs.items():
        spans: dict[int, int] = {}  # loop head address -> last backward branch's address
        for addr, _, target in insns:
            head = labels[name].get(target, addr + 1) if target else addr + 1
            if head <= addr:
                spans[head] = max(spans.get(head, addr), addr)
        out[name] = {
            "opcodes": [op for _, op, _ in insns],
            "loops": [
                [op for addr, op, _ in insns if head <= addr <= end]
                for head, end in sorted(spans.items())
            ],
        }
    return out


def parse_sass(text: str) -> dict[str, dict]:
    """nvdisasm output -> per function (mangled name): class counts of the whole function and
    of its hot loop.

    The hot loop is the smallest loop (a backward branch's range) holding the most MMA
    instructions: in a GEMM the k-loop, in the GDN state pass the chunk loop. Its counts are
    what one iteration executes, where whole-function counts weigh prologue and epilogue code
    as much as the loop. None for a kernel without MMAs in a loop. Static counts, not a
    profile: no trip counts (an inner loop counts once), no stalls.
    """
    out: dict[str, dict] = {}
    for name, f in sass_loops(text).items():
        best = max(
            (c for c in map(sass_class_counts, f["loops"]) if c["mma"]),
            key=lambda c: (c["mma"], -c["instructions"]),  # most MMAs, then the smallest
            default=None,
        )
        out[name] = {"function": sass_class_counts(f["opcodes"]), "hot_loop": best}
    return out
