#!/usr/bin/env bash
# The state space of every wmma load in our kernels' PTX, and the load instructions of the
# micro file wmma_load_space.cu and of the GDN state pass in SASS (sm_90). Needs nvcc and
# cuobjdump (/usr/local/cuda/bin) and torch's headers; run from the repository root:
#   OUT=/tmp/x bash worklogs/remote_scripts/wmma_load_sass.sh
set -eu
R=${OUT:?}/wmma-load-sass; mkdir -p "$R"; export PATH=/usr/local/cuda/bin:$PATH
TI=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths('cuda')))")
F="-arch=sm_90 -O3 -std=c++17"
# Load instructions by kernel: LDSM (ldmatrix), LDS (shared), LD.E (generic), MOVM (transpose).
loads() { cuobjdump -sass "$1" | awk '/Function :/{f=$3} /\/\*[0-9a-f]+\*\//{ if (match($0,/(LDSM|LDS|LD\.E|MOVM|HMMA)[.A-Z0-9]*/)) c[f" "substr($0,RSTART,RLENGTH)]++} END{for(k in c) print c[k], k}' | sort -k2; }
nvcc $F -cubin worklogs/remote_scripts/wmma_load_space.cu -o "$R/micro.cubin"
loads "$R/micro.cubin" > "$R/micro_loads.txt"
for f in gdn_chunk moe_grouped_gemm; do
  nvcc $F -ptx $TI -I vllm_overrides/native/csrc "vllm_overrides/native/csrc/$f.cu" -o "$R/$f.ptx"
  grep "wmma.load" "$R/$f.ptx" | awk '{print $1}' | sort | uniq -c > "$R/${f}_ptx_wmma_loads.txt"
done
nvcc $F -cubin $TI -I vllm_overrides/native/csrc vllm_overrides/native/csrc/gdn_chunk.cu -o "$R/gdn_chunk.cubin"
loads "$R/gdn_chunk.cubin" | grep state_mma > "$R/state_kernel_loads.txt"
rm -f "$R"/*.cubin "$R"/*.ptx
head -50 "$R"/*.txt
