#!/usr/bin/env bash
# Shared-memory bank conflicts of the GDN chunk kernels, fp16 and bf16, 16K tokens (one launch each).
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' > $R/build.log 2>&1 || { tail -5 $R/build.log; exit 1; }
M=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,gpu__time_duration.sum
for d in float16 bfloat16; do
  timeout 100 ncu --kernel-name regex:_mma_kernel --launch-count 3 --metrics $M python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 1 --dtype $d > $R/ncu_gdn_$d.txt 2>&1
  echo "== $d"; grep -E "void|bank|wavefronts|duration" $R/ncu_gdn_$d.txt | sed 's/(const.*//'
done
rm -f $R/build.log
tar -czf $OUT/x.tgz -C $OUT r
