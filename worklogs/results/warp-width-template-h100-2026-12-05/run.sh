#!/usr/bin/env bash
# Warp width as a template constant (GDN state pass, MoE grouped GEMMs): base = e612430 (build/base), new = this tree.
# GDN chunk probe 16K fp16/bf16 two alternating rounds (errors in the first), MoE probe fp16 two alternating rounds,
# registers of both builds, then the GPU tests of both kernels in this tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; S=$OUT/summary.txt
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?" | tee -a $S) &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?" | tee -a $S; tail -3 $R/build_new.log; wait
for so in ~/.cache/torch_extensions/py*/vo_native_kernels_*/*.so; do
  echo "$so"; /usr/local/cuda/bin/cuobjdump -res-usage "$so" 2>&1 | grep -A1 "state_mma\|moe_grouped_gemm" | grep -o "Function [^ ]*\|REG:[0-9]*\|STACK:[0-9]*\|LOCAL:[0-9]*" | paste -sd' '
done > $R/res.txt
G=worklogs/remote_scripts/gdn_chunk_probe.py; P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2; do
  for d in float16 bfloat16; do
    for t in base new; do
      dd=.; [ $t = base ] && dd=build/base
      e=""; [ $i = 1 ] && e=--err
      (cd $dd && python3 $G --T 16384 --reps 20 --dtype $d $e --json $R/gdn_${t}_${d}_$i.json > $R/gdn_${t}_${d}_$i.txt 2>&1)
      echo "gdn $t $d $i: $(grep -E 'state|total|errors' $R/gdn_${t}_${d}_$i.txt | tr '\n' ' ')" | tee -a $S
    done
  done
  for t in base new; do
    dd=.; [ $t = base ] && dd=build/base
    (cd $dd && python3 $P --dtype float16 --label $t-fp16 --json $R/moe_${t}_$i.json > $R/moe_${t}_$i.txt 2>&1)
    echo "moe $t fp16 $i: $(grep -E 'wmma' $R/moe_${t}_$i.txt | tr '\n' ' ')" | tee -a $S
  done
done
tar -czf $OUT/x.tgz -C $OUT r
timeout 170 python3 -m pytest tests/native/test_gdn_chunk_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests_gdn.txt 2>&1; echo "gdn chunk tests: $(tail -1 $R/tests_gdn.txt)" | tee -a $S
timeout 100 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests_moe.txt 2>&1; echo "moe tests: $(tail -1 $R/tests_moe.txt)" | tee -a $S
rm -f $R/build_base.log
tar -czf $OUT/x.tgz -C $OUT r
