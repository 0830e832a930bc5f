#!/usr/bin/env python3
"""Compile ``vllm_overrides/native/csrc`` with clang's CUDA front end, as the target will.

The target card's wheel is built by Iluvatar's CoreX toolchain, a clang (``--cuda-gpu-arch=
ivcore10``; the card reports compute capability 7.0, PLATFORM.md); our kernels are developed
with nvcc. This builds every ``.cu`` with upstream clang (Debian 12's ``clang-19``) and the
CUDA 12.5 headers and libdevice from PyPI (``scripts/cuda_toolchain.py``), in two halves:

* the device side for ``--arch`` (default ``sm_70``) to PTX, then ptxas 12.5 on that PTX
  (the PTX is valid for the architecture; registers and spill bytes reported);
* the host side (``--cuda-host-only -c``): torch's headers and our wrappers through clang.

It also reads each kernel's PTX: the tensor-core kernels must contain ``wmma.mma`` and no
``trap`` where their type has fragments on the architecture (fp16 from 7.0, bf16 from 8.0),
and trap where it does not (``mma_arch_ok`` in ``csrc/common.cuh``). It is a front-end and
architecture check, not CoreX itself: that compiler and its 64-lane register allocation are
only on the target.

Usage::

    apt-get install -y clang-19         # once
    python scripts/clang_kernels_check.py [--arch sm_70 sm_90] [--out build/clang-check.json]

Exits 1 when a source fails any step; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import cuda_toolchain  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "vllm_overrides" / "native" / "csrc"
CLANGS = ("clang++-19", "clang++")


def defines() -> list[str]:
    """The macros of torch's nvcc flags, as jit_build and setup.py compile with them (the rest,
    ``--expt-relaxed-constexpr``, is nvcc's own: clang allows constexpr calls on the device)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return [f for f in COMMON_NVCC_FLAGS if f.startswith("-D")] + [
        "-DTORCH_EXTENSION_NAME=vo_clang_check"
    ]


def find_clang() -> str | None:
    """A clang++ of major version >= 19 (CUDA 12.5 headers), or None."""
    for name in CLANGS:
        path = shutil.which(name)
        if path is None:
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"clang version (\d+)", out)
        if m and int(m.group(1)) >= 19:
            return path
    return None


def ptx_kernels(ptx: str) -> dict[str, dict[str, int]]:
    """Per ``.entry`` of a PTX module: its ``wmma.mma`` and ``trap`` instruction counts, and its
    fragment loads by state space: ``.shared`` ones become ldmatrix, generic ones (no state
    space: what clang emits for every wmma load, nvcc for bf16; LEDGER) 4-byte loads."""
    out: dict[str, dict[str, int]] = {}
    parts = re.split(r"^(?:\.(?:visible|weak)\s+)?\.entry\s+(\S+?)\s*\(", ptx, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        loads = [set(q.split(".")) for q in re.findall(r"\bwmma\.load\.[abc]\.sync\.(\S+)", body)]
        out[name] = {
            "wmma": len(re.findall(r"\bwmma\.mma", body)),
            "trap": len(re.findall(r"\btrap;", body)),
            "wmma_load_shared": sum("shared" in q for q in loads),
            "wmma_load_generic": sum(not q & {"shared", "global", "local"} for q in loads),
        }
    return out


def tensor_core_kind(demangled: str) -> str | None:
    """'half' / 'bf16' for our tensor-core kernels (by name), else None."""
    if not re.search(r"(_mma_kernel|moe_grouped_gemm_kernel)<", demangled):
        return None
    if "BFloat16" in demangled:
        return "bf16"
    return "half" if "Half" in demangled else None


def mma_expected(kind: str, arch: str) -> bool:
    """Whether ``kind``'s wmma fragments exist on ``arch`` (CUDA: half 7.0, bf16 8.0)."""
    return int(arch.removeprefix("sm_")) >= (80 if kind == "bf16" else 70)


def _run(cmd: list[str]) -> tuple[bool, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def clang_command(clang: str, home: Path, stubs: Path, arch: str) -> list[str]:
    """clang's CUDA command line for one architecture, without the mode (``--cuda-device-only
    -S`` or ``--cuda-host-only -c``), output and source; ``home`` and ``stubs`` as
    ``cuda_toolchain.clang_cuda_home`` and ``write_stubs`` give them."""
    return [
        clang, "-x", "cuda", f"--cuda-path={home}", f"--cuda-gpu-arch={arch}",
        "-Wno-unknown-cuda-version", "-Wno-c++20-extensions", "-std=c++17", "-O3", "-fPIC",
        *defines(), f"-I{stubs}", *(f"-I{i}" for i in cuda_toolchain.torch_includes()),
    ]  # fmt: skip


def check_source(
    clang: str, home: Path, stubs: Path, src: Path, arch: str, nvdisasm: Path | None = None
) -> dict:
    """``nvdisasm``: also each kernel's hot loop (``cuda_toolchain.parse_sass``) where the
    disassembler reads the architecture (CUDA 13's: sm_75 and later)."""
    base = clang_command(clang, home, stubs, arch)
    res: dict = {"source": src.name, "arch": arch}
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ok, log = _run([*base, "--cuda-device-only", "-S", "-o", str(ptx), str(src)])
        res["device_ok"], res["device_log"] = ok, log[-3000:]
        res["kernels"] = {}
        if ok:
            text = ptx.read_text()
            ok, log = _run([str(home / "bin" / "ptxas"), f"-arch={arch}", "-v", "-o",
                            str(Path(tmp) / "k.cubin"), str(ptx)])  # fmt: skip
            res["ptxas_ok"], res["ptxas_log"] = ok, log[-3000:]
            usage = {r["mangled"]: r for r in cuda_toolchain.parse_ptxas(log)}
            sass: dict[str, dict] = {}
            if ok and nvdisasm is not None and int(arch.removeprefix("sm_")) >= 75:
                sass = cuda_toolchain.parse_sass(
                    cuda_toolchain.disassemble(nvdisasm, Path(tmp) / "k.cubin")
                )
            counts = ptx_kernels(text)
            names = cuda_toolchain.demangle(list(counts))
            for (mangled, c), name in zip(counts.items(), names, strict=True):
                u = usage.get(mangled, {})
                res["kernels"][name] = {
                    **c, "registers": u.get("registers"),
                    "spill_stores": u.get("spill_stores"), "spill_loads": u.get("spill_loads"),
                    "hot_loop": sass.get(mangled, {}).get("hot_loop"),
                }  # fmt: skip
        else:
            res["ptxas_ok"], res["ptxas_log"] = False, "(no PTX)"
        ok, log = _run([*base, "--cuda-host-only", "-c", "-o", str(Path(tmp) / "h.o"), str(src)])
        res["host_ok"], res["host_log"] = ok, log[-3000:]
    res["mma_mismatch"] = [
        n for n, c in res["kernels"].items()
        if (kind := tensor_core_kind(n)) is not None
        and (c["wmma"] > 0 and c["trap"] == 0) != mma_expected(kind, arch)
    ]  # fmt: skip
    res["ok"] = res["device_ok"] and res["ptxas_ok"] and res["host_ok"] and not res["mma_mismatch"]
    return res


def run(
    archs: list[str], sources: list[Path], cache: Path, jobs: int, nvdisasm: Path | None = None
) -> list[dict]:
    clang = find_clang()
    if clang is None:
        raise SystemExit("clang_kernels_check: needs clang++ >= 19 (apt-get install clang-19)")
    home = cuda_toolchain.clang_cuda_home(cache)
    stubs = cuda_toolchain.write_stubs(cache)
    from tqdm import tqdm

    with ThreadPoolExecutor(jobs) as pool:
        futures = [
            pool.submit(check_source, clang, home, stubs, s, a, nvdisasm)
            for s in sources
            for a in archs
        ]
        return [f.result() for f in tqdm(futures, desc="clang", unit="file")]


HOT_LOOP_KEYS = ("instructions", "mma", "ld_shared", "ld_generic", "movm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["sm_70"])
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "cuda12-clang")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "clang-check.json")
    ap.add_argument(
        "--sass",
        action="store_true",
        help="also the tensor-core kernels' hot loops (nvdisasm; sm_75 and later)",
    )
    args = ap.parse_args()
    nvdisasm = None
    if args.sass:
        # the same folder as kernel_resources.py's, so one fetch serves both
        nvdisasm = cuda_toolchain.nvdisasm_path(ROOT / "build" / "cuda-toolchain" / "nvdisasm")
    results = run(args.arch, sorted(CSRC.glob("*.cu")), args.cache.resolve(), args.jobs, nvdisasm)
    print(f"{'source':22s} {'arch':6s} device ptxas host  kernels  wmma  max-regs  spilling"
          "  frag-loads generic/shared")  # fmt: skip
    for r in results:
        k = r["kernels"].values()
        regs = max((c["registers"] or 0 for c in k), default=0)
        mma = sum(c["wmma"] > 0 for c in k)
        spill = sum((c["spill_stores"] or 0) > 0 for c in k)
        gen = sum(c["wmma_load_generic"] for c in k)
        shr = sum(c["wmma_load_shared"] for c in k)
        print(f"{r['source']:22s} {r['arch']:6s} {r['device_ok']!s:6s} {r['ptxas_ok']!s:5s} "
              f"{r['host_ok']!s:5s} {len(k):7d}  {mma:4d}  {regs:8d}  {spill:8d}"
              f"  {gen:10d}/{shr:<6d}")  # fmt: skip
        for n in r["mma_mismatch"]:
            print(f"  tensor cores not as the architecture allows: {n}")
        for n, c in sorted(r["kernels"].items()):
            if (loop := c.get("hot_loop")) is not None:
                mix = ", ".join(f"{key} {loop[key]}" for key in HOT_LOOP_KEYS)
                print(f"  hot loop {n.split('(')[0].removeprefix('void ')}: {mix}")
        for step in ("device", "ptxas", "host"):
            if not r[f"{step}_ok"]:
                print(f"  {step} failed:\n{r[f'{step}_log']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
