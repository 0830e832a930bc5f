"""The loops of gemv_kernel<Half, 1> and <Half, 8> as clang builds them, sm_90 (a record).

clang 19 -> PTX -> ptxas 12.5 -> nvdisasm 13.2, the toolchains of scripts/clang_kernels_check.py
and worklogs/kernel_resources.py (both fetched into build/ by those tools first). Per loop (a
backward branch's range, outermost first): instructions, LDGs, FMAs.

Usage, from the repository root: python <this file> <tree whose csrc to build>
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
from scripts import clang_kernels_check as cc  # noqa: E402
from scripts import cuda_toolchain as ct  # noqa: E402


def loops(part: str) -> list[tuple[int, int, int]]:
    labels: dict[str, int] = {}
    pending: list[str] = []
    insns: list[tuple[int, str, str | None]] = []
    for line in part.splitlines():
        if m := ct._LABEL.match(line):
            pending.append(m.group(1))
        elif m := ct._INSN.match(line):
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            t = ct._TARGET.search(m.group(3)) if m.group(2).startswith("BRA") else None
            insns.append((addr, m.group(2), t.group(1) if t else None))
    spans: dict[int, int] = {}
    for addr, _, target in insns:
        if target and labels.get(target, addr + 1) <= addr:
            spans[labels[target]] = max(spans.get(labels[target], addr), addr)
    out = []
    for head, end in sorted(spans.items()):
        ops = [op for a, op, _ in insns if head <= a <= end]
        ldg = sum(o.startswith("LDG") for o in ops)
        fma = sum(o.startswith(("FFMA", "HFMA2")) for o in ops)
        out.append((len(ops), ldg, fma))
    return out


def main() -> None:
    tree = Path(sys.argv[1])
    cache = ROOT / "build" / "cuda12-clang"
    home, stubs = ct.clang_cuda_home(cache), ct.write_stubs(cache)
    nvdisasm = ROOT / "build/cuda-toolchain/nvdisasm/root/nvidia/cu13/bin/nvdisasm"
    base = [
        cc.find_clang(), "-x", "cuda", f"--cuda-path={home}", "--cuda-gpu-arch=sm_90",
        "-Wno-unknown-cuda-version", "-Wno-c++20-extensions", "-std=c++17", "-O3", "-fPIC",
        *cc.defines(), f"-I{stubs}", *(f"-I{i}" for i in ct.torch_includes()),
    ]  # fmt: skip
    src = tree / "vllm_overrides/native/csrc/native_kernels.cu"
    subprocess.run([*base, "--cuda-device-only", "-S", "-o", "/tmp/nk.ptx", str(src)],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([str(home / "bin/ptxas"), "-arch=sm_90", "-o", "/tmp/nk.cubin", "/tmp/nk.ptx"],
                   check=True)  # fmt: skip
    text = subprocess.run([str(nvdisasm), "-c", "/tmp/nk.cubin"], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    for part in re.split(r"\n(?=\.text\.)", text):
        head = part.split("\n", 1)[0]
        if "gemv_kernelIN3c104HalfELi1E" in head or "gemv_kernelIN3c104HalfELi8E" in head:
            print(head[:60], "loops (instr, LDG, FMA):", loops(part))


if __name__ == "__main__":
    main()
