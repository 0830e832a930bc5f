#!/usr/bin/env bash
# Final figures: 16K step with our GEMMs, fp16 and bf16, base (HEAD) vs new (A resident, pitch 24), alternating; bf16 probe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait
S=worklogs/decode_step_bench.py
for d in float16 bfloat16; do
  for t in base new; do
    dd=.; c=e0b5685+resA; [ $t = base ] && dd=build/base && c=e0b5685
    (cd $dd && MOE_PREFILL_GEMM=wmma timeout 120 python3 $S --prefill 16384 --prefill-modes fresh --variants cuda --dtype $d --out $R/step_${t}_$d --commit $c --budget-s 40 > $R/step_${t}_$d.log 2>&1)
    echo "$t $d: $(grep -E '^ *16384' $R/step_${t}_$d/prefill_step_bench.txt)"
  done
done
P=worklogs/remote_scripts/moe_gemm_probe.py
(cd build/base && python3 $P --label base-bf16 --json $R/probe_base_bf16.json > $R/probe_base_bf16.txt 2>&1)
python3 $P --label resA-bf16 --json $R/probe_new_bf16.json > $R/probe_new_bf16.txt 2>&1
paste $R/probe_base_bf16.txt $R/probe_new_bf16.txt | grep -E "wmma|grouped"
rm -f $R/*.log
tar -czf $OUT/x.tgz -C $OUT r
