#!/usr/bin/env python3
"""Registers, spills and stack of every CUDA kernel in ``vllm_overrides/native/csrc``, no GPU.

A kernel's register count decides how many of its blocks an SM holds, and a spill turns
register traffic into local-memory traffic; both are what most of our kernel changes trade
against (worklogs/LEDGER.md). They come from the compiler, not the device, so this tool gets
them on a CPU machine: it fetches NVIDIA's CUDA compiler from PyPI (nvcc, cicc, ptxas and the
runtime headers as wheels, pinned in ``scripts/cuda_toolchain.py``), compiles each source of
one or more trees the way ``kernels.jit_build`` does (torch's nvcc flags, ``-O3``) with
``--resource-usage`` for each ``--arch``, and reports one row per kernel instantiation.
With ``--sass`` it also disassembles each kernel (nvdisasm, also a PyPI wheel) and counts the
instructions of its hot loop by kind: tensor-core MMAs against the shared, global and generic
loads that feed them, the moves and barriers around them (``cuda_toolchain.parse_sass``).

What it is not: a timing, and not the target card's compiler (Iluvatar's CoreX allocates for
64-lane warps; ``scripts/clang_kernels_check.py`` compiles with a clang front end instead).

Usage (CPU machine, the dev venv; the first run downloads ~200 MB into build/cuda-toolchain)::

    make kernel-resources                                     # this tree, sm_90
    python worklogs/kernel_resources.py --tree build/base --tree . --arch sm_90 \\
        --sources moe_grouped_gemm.cu --sass --out build/kernel-resources.json

With two trees the table puts them side by side (registers, spill stores / loads, bytes).

``--smem`` instead reports the shared memory a block of each kernel family asks for at Qwen3.6's
TP4 shapes and the variant picked, on devices granting 227 KB (H100 / H200), 48 KB and 32 KB
(the card) -- the library's own plan ops, through its CPU-emulation build (no GPU, no nvcc)::

    python worklogs/kernel_resources.py --smem
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import cuda_toolchain  # noqa: E402

CSRC = Path("vllm_overrides/native/csrc")


@dataclass
class KernelUsage:
    tree: str
    source: str
    arch: str
    kernel: str  # demangled name, the anonymous namespace dropped
    registers: int
    spill_stores: int  # bytes
    spill_loads: int
    stack: int  # bytes of stack frame
    barriers: int
    sass: dict | None = None  # cuda_toolchain.parse_sass's entry, with --sass


def nvcc_command(
    home: Path, stubs: Path, source: Path, arch: str, obj: Path, cubin: bool = False
) -> list[str]:
    """``cubin``: device code only (what nvdisasm reads) instead of a host object."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    incs = [str(stubs), *cuda_toolchain.torch_includes()]
    return [
        str(home / "bin" / "nvcc"), "-std=c++17", "-O3", f"-arch={arch}", "--resource-usage",
        "-cubin" if cubin else "-c", str(source), "-o", str(obj),
        "-DTORCH_EXTENSION_NAME=vo_resources",
        *COMMON_NVCC_FLAGS, *(f"-I{i}" for i in incs), "-diag-suppress", "3306",
    ]  # fmt: skip


def short_name(demangled: str) -> str:
    """Drop the parameter list; keep the kernel and its template arguments."""
    name = demangled
    depth = 0
    for i, ch in enumerate(name):  # cut at the parameter list: the first '(' outside <...>
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    return name.replace("c10::", "").replace("(bool)1", "true").replace("(bool)0", "false")


def demangle(names: list[str]) -> list[str]:
    return [short_name(n) for n in cuda_toolchain.demangle(names)]


def compile_one(
    home: Path, stubs: Path, tree: Path, source: Path, arch: str, nvdisasm: Path | None = None
) -> list[KernelUsage]:
    sass: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / ("k.cubin" if nvdisasm is not None else "k.o")
        cmd = nvcc_command(home, stubs, source, arch, obj, cubin=nvdisasm is not None)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
        if proc.returncode == 0 and nvdisasm is not None:
            sass = cuda_toolchain.parse_sass(cuda_toolchain.disassemble(nvdisasm, obj))
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {tree}/{source} ({arch}):\n{proc.stderr[-4000:]}")
    rows = cuda_toolchain.parse_ptxas(proc.stdout + proc.stderr)
    names = demangle([r["mangled"] for r in rows])
    return [
        KernelUsage(tree=str(tree), source=source.name, arch=r["arch"], kernel=n,
                    registers=r["registers"], spill_stores=r["spill_stores"],
                    spill_loads=r["spill_loads"], stack=r["stack"], barriers=r["barriers"],
                    sass=sass.get(r["mangled"]))
        for r, n in zip(rows, names, strict=True)
    ]  # fmt: skip


def table(rows: list[KernelUsage], trees: list[str]) -> str:
    """One line per (arch, source, kernel); a column group per tree."""
    by_key: dict[tuple[str, str, str], dict[str, KernelUsage]] = {}
    for r in rows:
        by_key.setdefault((r.arch, r.source, r.kernel), {})[r.tree] = r
    head = "arch   kernel" + "".join(f" | {t[-24:]:>24s}" for t in trees)
    lines = [head, "       " + " " * 6 + " | regs spill st/ld stack" * len(trees)]
    for (arch, _src, kernel), per in sorted(by_key.items()):
        cells = []
        for t in trees:
            u = per.get(t)
            cells.append(
                f" | {u.registers:4d} {u.spill_stores:5d}/{u.spill_loads:<5d} {u.stack:5d}"
                if u else " | " + "-".center(24)
            )  # fmt: skip
        lines.append(f"{arch:6s} {kernel}\n{'':13s}" + "".join(cells))
    return "\n".join(lines)


SASS_COLUMNS = (
    "instructions", "mma", "ld_shared", "ld_global", "ld_generic", "movm", "local", "int_alu",
)  # fmt: skip


def sass_table(rows: list[KernelUsage], trees: list[str]) -> str:
    """The hot loop's instruction counts (one iteration, static), a column group per tree."""
    by_key: dict[tuple[str, str], dict[str, KernelUsage]] = {}
    for r in rows:
        by_key.setdefault((r.arch, r.kernel), {})[r.tree] = r
    heads = ("instr", "mma", "ld.s", "ld.g", "ld", "movm", "local", "int")
    cell_w = sum(len(h) + 1 for h in heads)
    lines = [
        "hot loop, one iteration (static): arch kernel" + " " * 2 + "".join(
            f" | {t[-cell_w:]:>{cell_w}s}" for t in trees),
        " " * 47 + (" | " + " ".join(heads) + " ") * len(trees),
    ]  # fmt: skip
    for (arch, kernel), per in sorted(by_key.items()):
        cells = []
        for t in trees:
            loop = (per[t].sass or {}).get("hot_loop") if t in per else None
            if loop is None:
                cells.append(" | " + "-".center(cell_w))
            else:
                cells.append(" | " + " ".join(
                    f"{loop[c]:{len(h)}d}" for c, h in zip(SASS_COLUMNS, heads, strict=True)
                ) + " ")  # fmt: skip
        lines.append(f"{arch:6s} {kernel}\n{'':47s}" + "".join(cells))
    return "\n".join(lines)


def smem_table() -> str:
    """The plan ops of csrc/ (the choice each host wrapper makes from the device's opt-in shared
    memory per block) at three limits. Emulated: blocks of 128 threads, so the tensor-core GDN
    kernels' per-warp scratch is half the device's (256 threads: +6 KB each); every other
    figure is the device's."""
    import torch

    from vllm_overrides.native import kernels

    kernels.enable_cpu_emulation(64)
    ops = torch.ops.vo_kernels
    x = torch.zeros(1, 2048, dtype=torch.float16)
    q = torch.zeros(1, 4, 128, dtype=torch.float16)
    lines = []
    try:
        for limit in (227 * 1024, 48 * 1024, 32 * 1024):
            ops.emu_set_smem_optin(limit)
            lines.append(f"device grants {limit // 1024} KB a block:")
            for name, plan in (
                ("GDN chunk prefill (K = V = 128)", ops.gdn_chunk_plan(q, 128, 128)),
                ("MoE gate/up grouped GEMM (K = 2048)", ops.moe_grouped_gemm_plan(x, 2048, True)),
                ("MoE down grouped GEMM (K = 128)", ops.moe_grouped_gemm_plan(x, 128, False)),
                ("paged attention, 4K context",
                 ops.paged_attention_plan(x, 4, 256, 4096, 1)),
                ("paged attention, 256K context",
                 ops.paged_attention_plan(x, 4, 256, 262144, 1)),
            ):  # fmt: skip
                lines.append(f"  {name}: {plan}")
    finally:
        ops.emu_set_smem_optin(227 * 1024)
    return "\n".join(lines)


def main() -> None:
    if "--smem" in sys.argv:
        print(smem_table())
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        type=Path,
        help="checkout whose csrc/ to compile (repeatable; default: this one)",
    )
    ap.add_argument("--arch", nargs="+", default=["sm_90"], help="nvcc -arch values")
    ap.add_argument("--sources", nargs="+", help="file names under csrc/ (default: every .cu)")
    ap.add_argument("--sass", action="store_true",
                    help="also count each kernel's hot-loop instructions (nvdisasm)")  # fmt: skip
    ap.add_argument("--toolchain", type=Path, default=Path("build/cuda-toolchain"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("build/kernel-resources.json"))
    args = ap.parse_args()
    from tqdm import tqdm

    trees = [t.resolve() for t in (args.tree or [Path(".")])]
    home = cuda_toolchain.fetch(cuda_toolchain.NVCC_13, args.toolchain.resolve()) / "nvidia/cu13"
    stubs = cuda_toolchain.write_stubs(args.toolchain.resolve())
    nvdisasm = None
    if args.sass:
        nvdisasm = cuda_toolchain.nvdisasm_path(args.toolchain.resolve() / "nvdisasm")
    jobs = []
    for tree in trees:
        names = args.sources or sorted(p.name for p in (tree / CSRC).glob("*.cu"))
        jobs += [(tree, CSRC / n, a) for n in names for a in args.arch]
    rows: list[KernelUsage] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(compile_one, home, stubs, *j, nvdisasm) for j in jobs]
        for f in tqdm(futures, desc="nvcc", unit="file"):
            rows += f.result()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pins = cuda_toolchain.NVCC_13 | (cuda_toolchain.NVDISASM if args.sass else {})
    args.out.write_text(json.dumps({
        "commit": commit, "toolchain": pins, "arch": args.arch,
        "trees": [str(t) for t in trees], "kernels": [asdict(r) for r in rows],
    }, indent=1))  # fmt: skip
    print(table(rows, [str(t) for t in trees]))
    if args.sass:
        print("\n" + sass_table(rows, [str(t) for t in trees]))
    print(f"\n{len(rows)} kernel instantiations -> {args.out}")


if __name__ == "__main__":
    main()
