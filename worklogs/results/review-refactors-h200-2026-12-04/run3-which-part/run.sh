#!/usr/bin/env bash
# Which part of e7f2227 slowed the bf16 grouped GEMMs: base = 8051dd6, new = 8444fcc, varc = 8444fcc with moe_grouped_gemm.cu's epilogue as at 8051dd6 (only VO_SMEM_OPT_IN kept). Registers and spills per kernel from cuobjdump.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
for t in base varc; do (cd build/$t && python3 -c "$B" > $R/build_$t.log 2>&1; echo "$t build rc=$?") & done
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait; tail -3 $R/build_varc.log
for so in $(find ~/.cache/torch_extensions -name "vo_native_kernels_*.so"); do
  echo "== $so" >> $R/res.txt; /usr/local/cuda/bin/cuobjdump -res-usage $so 2>&1 | grep -A1 moe_grouped_gemm | grep -oE "_Z[^ ]*|REG:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+" | paste - - - - >> $R/res.txt
done
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2; do
  for t in base new varc; do
    d=.; [ $t != new ] && d=build/$t
    (cd $d && python3 $P --label $t-bf16 --json $R/${t}_bf16_$i.json > $R/${t}_bf16_$i.txt 2>&1)
  done
  echo "== bf16 run $i (base, new, varc)" | tee -a $OUT/summary.txt; paste $R/base_bf16_$i.txt $R/new_bf16_$i.txt $R/varc_bf16_$i.txt | grep -E "wmma" | tee -a $OUT/summary.txt
done
for t in base new varc; do
  d=.; [ $t != new ] && d=build/$t
  (cd $d && python3 $P --dtype float16 --label $t-fp16 --json $R/${t}_fp16.json > $R/${t}_fp16.txt 2>&1)
done
echo "== fp16 (base, new, varc)" | tee -a $OUT/summary.txt; paste $R/base_fp16.txt $R/new_fp16.txt $R/varc_fp16.txt | grep -E "wmma" | tee -a $OUT/summary.txt
rm -f $R/build_base.log $R/build_new.log
tar -czf $OUT/x.tgz -C $OUT r
