#!/usr/bin/env bash
# fp16/bf16 A/B of the down GEMM epilogue read order: base = 214e75f + the read order, new = + stage stores on rows r and r + 4.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2 3; do
  for t in base new; do
    d=.; [ $t = base ] && d=build/base
    (cd $d && python3 $P --dtype float16 --label $t-fp16 --json $R/${t}_$i.json > $R/${t}_$i.txt 2>&1)
  done
  echo "== fp16 run $i (base, new)"; paste $R/base_$i.txt $R/new_$i.txt | grep "wmma"
done
(cd build/base && python3 $P --label base-bf16 --json $R/base_bf16.json > $R/base_bf16.txt 2>&1)
python3 $P --label new-bf16 --json $R/new_bf16.json > $R/new_bf16.txt 2>&1
echo "== bf16 (base, new)"; paste $R/base_bf16.txt $R/new_bf16.txt | grep "wmma"
M=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,gpu__time_duration.sum
for t in base new; do
  d=.; [ $t = base ] && d=build/base
  (cd $d && timeout 100 ncu --kernel-name regex:moe_grouped_gemm --launch-count 2 --metrics $M python3 $P --dtype float16 --once > $R/ncu_$t.txt 2>&1)
  echo "== ncu $t"; grep -E "bank|wavefronts|duration" $R/ncu_$t.txt
done
timeout 150 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k "cuda" > $R/tests.txt 2>&1; tail -1 $R/tests.txt
rm -f $R/*.log
tar -czf $OUT/x.tgz -C $OUT r
