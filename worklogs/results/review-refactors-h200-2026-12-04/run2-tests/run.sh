#!/usr/bin/env bash
# Second batch at 8444fcc: every GPU case of the GDN chunk tests (the 70K and 64-sequence varlen ones too), the other native kernel tests, and two more bf16 MoE A/B runs against 8051dd6.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > /dev/null 2>&1; echo "base build rc=$?") &
python3 -c "$B" > /dev/null 2>&1; echo "new build rc=$?"; wait
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 2 3; do
  for t in base new; do
    d=.; [ $t = base ] && d=build/base
    (cd $d && python3 $P --label $t-bf16 --json $R/moe_${t}_bf16_$i.json > $R/moe_${t}_bf16_$i.txt 2>&1)
  done
  echo "== moe bf16 run $i (base, new)" | tee -a $OUT/summary.txt; paste $R/moe_base_bf16_$i.txt $R/moe_new_bf16_$i.txt | grep -E "wmma" | tee -a $OUT/summary.txt
done
timeout 240 python3 -m pytest tests/native/test_gdn_chunk_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests_gdn_chunk.txt 2>&1; echo "gdn chunk tests: $(tail -1 $R/tests_gdn_chunk.txt)" | tee -a $OUT/summary.txt
timeout 200 python3 -m pytest tests/native -p no:cacheprovider -o addopts="" -q -k cuda --deselect tests/native/test_gdn_chunk_kernels.py --deselect tests/native/test_moe_prefill_kernels.py > $R/tests_native_other.txt 2>&1; echo "other native tests: $(tail -1 $R/tests_native_other.txt)" | tee -a $OUT/summary.txt
tar -czf $OUT/x.tgz -C $OUT r
