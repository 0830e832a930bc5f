#!/usr/bin/env bash
# fp16 A/B of the down GEMM (base = HEAD, new = A resident), runs sweep, step fp16 wmma, ncu of down.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2; do
  (cd build/base && python3 $P --dtype float16 --runs 1,2,4,8,16 --label base-fp16 --json $R/base_fp16_$i.json > $R/base_fp16_$i.txt 2>&1)
  python3 $P --dtype float16 --runs 1,2,4,8,16 --label resA-fp16 --json $R/new_fp16_$i.json > $R/new_fp16_$i.txt 2>&1
  echo "== fp16 run $i (base, new)"; paste $R/base_fp16_$i.txt $R/new_fp16_$i.txt | grep "wmma"
done
S=worklogs/decode_step_bench.py
(cd build/base && MOE_PREFILL_GEMM=wmma timeout 150 python3 $S --prefill 16384 --prefill-modes fresh --variants cuda --dtype float16 --out $R/step_base --commit e0b5685 --budget-s 50 > $R/step_base.txt 2>&1)
MOE_PREFILL_GEMM=wmma timeout 150 python3 $S --prefill 16384 --prefill-modes fresh --variants cuda --dtype float16 --out $R/step_new --commit e0b5685+resA --budget-s 50 > $R/step_new.txt 2>&1
tail -4 $R/step_base.txt $R/step_new.txt
timeout 120 ncu --kernel-name regex:moe_grouped_gemm --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis python3 $P --dtype float16 --once > $R/ncu_down_new.txt 2>&1; grep -E "Throughput|Registers|Achieved Occ|Stall|L2 Hit|Duration" $R/ncu_down_new.txt | head -20
tar -czf $OUT/x.tgz -C $OUT r
