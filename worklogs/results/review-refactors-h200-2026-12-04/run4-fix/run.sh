#!/usr/bin/env bash
# The committed fix: moe_grouped_gemm.cu's down epilogue back inline (as at 8051dd6), frag_out8 kept for the GDN chunk kernels. new = this tree, base = 8051dd6.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; tail -3 $R/build_new.log
P=worklogs/remote_scripts/moe_gemm_probe.py
for d in bfloat16 float16; do
  for t in base new; do
    dd=.; [ $t = base ] && dd=build/base
    (cd $dd && python3 $P --dtype $d --label $t-$d --json $R/${t}_$d.json > $R/${t}_$d.txt 2>&1)
  done
  echo "== $d (base, new)" | tee -a $OUT/summary.txt; paste $R/base_$d.txt $R/new_$d.txt | grep -E "wmma" | tee -a $OUT/summary.txt
done
timeout 200 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests_moe.txt 2>&1; echo "moe tests: $(tail -1 $R/tests_moe.txt)" | tee -a $OUT/summary.txt
tar -czf $OUT/x.tgz -C $OUT r
