#!/usr/bin/env bash
# A/B: down GEMM with A streamed (build/base = HEAD) vs A resident (this tree); fp16 (target) and bf16.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2; do
  for d in float16 bfloat16; do
    [ $i = 2 ] && [ $d = bfloat16 ] && continue
    (cd build/base && python3 $P --dtype $d --label base-$d --json $R/base_${d}_$i.json > $R/base_${d}_$i.txt 2>&1)
    python3 $P --dtype $d --label resA-$d --json $R/new_${d}_$i.json > $R/new_${d}_$i.txt 2>&1
    echo "== $d run $i (base, new)"; grep -h "^wmma_\|moe_prefill_wmma" $R/base_${d}_$i.txt $R/new_${d}_$i.txt
  done
done
timeout 200 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k "cuda" > $R/tests.txt 2>&1; tail -3 $R/tests.txt
tar -czf $OUT/x.tgz -C $OUT r
