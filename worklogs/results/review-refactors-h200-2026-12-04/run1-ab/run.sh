#!/usr/bin/env bash
# Verify the review refactors (f8d90a8 one VO_SMEM_OPT_IN, e7f2227 frag_out8 in common.cuh) on the GPU: base = 8051dd6 (last GPU-run commit), new = 8444fcc.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; tail -5 $R/build_new.log; wait
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2; do
  for t in base new; do
    d=.; [ $t = base ] && d=build/base
    (cd $d && python3 $P --dtype float16 --label $t-fp16 --json $R/moe_${t}_fp16_$i.json > $R/moe_${t}_fp16_$i.txt 2>&1)
  done
  echo "== moe fp16 run $i (base, new)" | tee -a $OUT/summary.txt; paste $R/moe_base_fp16_$i.txt $R/moe_new_fp16_$i.txt | grep "wmma" | tee -a $OUT/summary.txt
done
for t in base new; do
  d=.; [ $t = base ] && d=build/base
  (cd $d && python3 $P --label $t-bf16 --json $R/moe_${t}_bf16.json > $R/moe_${t}_bf16.txt 2>&1)
done
echo "== moe bf16 (base, new)" | tee -a $OUT/summary.txt; paste $R/moe_base_bf16.txt $R/moe_new_bf16.txt | grep -E "wmma|grouped" | tee -a $OUT/summary.txt
G=worklogs/remote_scripts/gdn_chunk_probe.py
for d in float16 bfloat16; do
  for t in base new; do
    dd=.; [ $t = base ] && dd=build/base
    (cd $dd && python3 $G --T 16384 --reps 20 --dtype $d --err --json $R/gdn_${t}_$d.json > $R/gdn_${t}_$d.txt 2>&1)
    echo "gdn $t $d: $(grep -E 'total|errors' $R/gdn_${t}_$d.txt | tr '\n' ' ')" | tee -a $OUT/summary.txt
  done
done
timeout 200 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests_moe.txt 2>&1; echo "moe tests: $(tail -1 $R/tests_moe.txt)" | tee -a $OUT/summary.txt
rm -f $R/build_base.log
tar -czf $OUT/x.tgz -C $OUT r
