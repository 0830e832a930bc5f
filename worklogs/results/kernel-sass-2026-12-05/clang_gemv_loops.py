"""The loops of gemv_kernel<Half, 1> and <Half, 8> as clang builds them, sm_90 (a record).

clang 19 -> PTX -> ptxas 12.5 -> nvdisasm 13.2, the toolchains of scripts/clang_kernels_check.py
and worklogs/kernel_resources.py (both fetched into build/ by those tools first). Per loop (a
backward branch's range, outermost first): instructions, LDGs, FMAs.

Usage, from the repository root: python <this file> <tree whose csrc to build>
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
from scripts import clang_kernels_check as cc  # noqa: E402
from scripts import cuda_toolchain as ct  # noqa: E402


def counts(loops: list[list[str]]) -> list[tuple[int, int, int]]:
    return [
        (len(ops), sum(o.startswith("LDG") for o in ops),
         sum(o.startswith(("FFMA", "HFMA2")) for o in ops))
        for ops in loops
    ]  # fmt: skip


def main() -> None:
    tree = Path(sys.argv[1])
    clang = cc.find_clang()
    if clang is None:
        raise SystemExit("clang_gemv_loops: needs clang++ >= 19 (apt-get install clang-19)")
    cache = ROOT / "build" / "cuda12-clang"
    home, stubs = ct.clang_cuda_home(cache), ct.write_stubs(cache)
    nvdisasm = ct.nvdisasm_path(ROOT / "build/cuda-toolchain/nvdisasm")
    base = cc.clang_command(clang, home, stubs, "sm_90")
    src = tree / "vllm_overrides/native/csrc/native_kernels.cu"
    subprocess.run([*base, "--cuda-device-only", "-S", "-o", "/tmp/nk.ptx", str(src)],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([str(home / "bin/ptxas"), "-arch=sm_90", "-o", "/tmp/nk.cubin", "/tmp/nk.ptx"],
                   check=True)  # fmt: skip
    for name, f in ct.sass_loops(ct.disassemble(nvdisasm, Path("/tmp/nk.cubin"))).items():
        if "gemv_kernelIN3c104HalfELi1E" in name or "gemv_kernelIN3c104HalfELi8E" in name:
            print(f".text.{name}:"[:60], "loops (instr, LDG, FMA):", counts(f["loops"]))


if __name__ == "__main__":
    main()
