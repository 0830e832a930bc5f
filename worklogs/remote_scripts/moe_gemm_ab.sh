#!/usr/bin/env bash
# Device A/B of the MoE grouped GEMMs (kernels.moe_prefill, method "wmma"): build/base (e.g.
# `git archive <commit> | tar -x -C build/base`) against this tree, fp16 (the target's dtype)
# three rounds alternating, bf16 once each, registers of both builds, the MoE GPU tests of this
# tree, and one 16K fp16 prefill step each with our GEMMs. Run through the device tool with
# carry=[".whl", "build/base"] (.whl: fla-core, for the step bench); results under $OUT/r, a
# tarball $OUT/x.tgz. Takes ~8 minutes on an H200 with both JIT builds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; wait
for so in ~/.cache/torch_extensions/py*/vo_native_kernels_*/*.so; do
  echo "$so"; /usr/local/cuda/bin/cuobjdump -res-usage "$so" 2>&1 | grep -A1 moe_grouped_gemm | grep -o "REG:[0-9]*\|STACK:[0-9]*\|LOCAL:[0-9]*" | paste -sd' '
done > $R/res.txt
P=worklogs/remote_scripts/moe_gemm_probe.py
for i in 1 2 3; do
  for t in base new; do
    d=.; [ $t = base ] && d=build/base
    (cd $d && python3 $P --dtype float16 --label $t-fp16 --json $R/${t}_$i.json > $R/${t}_$i.txt 2>&1)
  done
  echo "== fp16 run $i (base, new)"; paste $R/base_$i.txt $R/new_$i.txt | grep "wmma"
done
for t in base new; do d=.; [ $t = base ] && d=build/base
  (cd $d && python3 $P --label $t-bf16 --json $R/${t}_bf16.json > $R/${t}_bf16.txt 2>&1); done
echo "== bf16 (base, new)"; paste $R/base_bf16.txt $R/new_bf16.txt | grep "wmma"
timeout 150 python3 -m pytest tests/native/test_moe_prefill_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests.txt 2>&1; tail -1 $R/tests.txt
for t in base new; do d=.; [ $t = base ] && d=build/base
  (cd $d && MOE_PREFILL_GEMM=wmma timeout 120 python3 worklogs/decode_step_bench.py --prefill 16384 --prefill-modes fresh \
     --variants cuda --dtype float16 --out $R/step_$t --commit $t --budget-s 40 > $R/step_$t.txt 2>&1)
  echo "== step $t"; tail -4 $R/step_$t.txt
done
rm -f $R/*.log
tar -czf $OUT/x.tgz -C $OUT r
