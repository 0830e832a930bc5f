import sys, subprocess, re
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import scripts.clang_kernels_check as c
from scripts import cuda_toolchain as ct
clang = c.find_clang(); cache = Path("/work/main/build/cuda12-clang")
home = ct.clang_cuda_home(cache); stubs = ct.write_stubs(cache)
nvd = Path("/work/main/build/cuda-toolchain/nvdisasm/root/nvidia/cu13/bin/nvdisasm")
base = [clang, "-x", "cuda", f"--cuda-path={home}", "--cuda-gpu-arch=sm_90", "-Wno-unknown-cuda-version", "-Wno-c++20-extensions", "-std=c++17", "-O3", "-fPIC", *c.defines(), f"-I{stubs}", *(f"-I{i}" for i in ct.torch_includes())]
subprocess.run([*base, "--cuda-device-only", "-S", "-o", "/tmp/nk.ptx", sys.argv[1] + "/vllm_overrides/native/csrc/native_kernels.cu"], check=True, capture_output=True)
subprocess.run([str(home/"bin"/"ptxas"), "-arch=sm_90", "-o", "/tmp/nk.cubin", "/tmp/nk.ptx"], check=True)
t = subprocess.run([str(nvd), "-c", "/tmp/nk.cubin"], capture_output=True, text=True, check=True).stdout
for part in re.split(r"\n(?=\.text\.)", t):
    h = part.split("\n", 1)[0]
    if "gemv_kernelIN3c104HalfELi1E" in h or "gemv_kernelIN3c104HalfELi8E" in h:
        lines = part.splitlines(); labels = {}; pend = []; ins = []
        for l in lines:
            m = ct._LABEL.match(l)
            if m: pend.append(m.group(1)); continue
            m = ct._INSN.match(l)
            if m:
                a = int(m.group(1), 16)
                for p in pend: labels[p] = a
                pend = []
                tg = ct._TARGET.search(m.group(3)) if m.group(2).startswith("BRA") else None
                ins.append((a, m.group(2), tg.group(1) if tg else None))
        loops = {}
        for a, op, tg in ins:
            if tg and labels.get(tg, a + 1) <= a: loops[labels[tg]] = max(loops.get(labels[tg], a), a)
        desc = []
        for hd, e in sorted(loops.items()):
            ops = [op for a, op, _ in ins if hd <= a <= e]
            desc.append((len(ops), sum(o.startswith("LDG") for o in ops), sum(o.startswith("FFMA") or o.startswith("HFMA2") for o in ops)))
        print(h[:60], "loops (instr, LDG, FMA):", desc)
