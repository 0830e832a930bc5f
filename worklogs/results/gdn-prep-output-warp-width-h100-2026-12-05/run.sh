#!/usr/bin/env bash
# Warp width as a template constant in the GDN chunk prep and output kernels: base = build/base
# (git archive of the commit before), new = this tree. $1 = a: both builds, gdn_chunk_probe.py
# 16K fp16 / bf16 three rounds alternating (errors in the first), registers; then the GDN chunk
# GPU tests of this tree under the time left. $1 = b: the GDN chunk float64 comparisons again
# (when a's limit cut them off).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
P="python3 -m pytest -p no:cacheprovider -o addopts= -v -rA --durations=0"
if [ "$1" = a ]; then
  t0=$(date +%s)
  (cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?" | tee -a $S) &
  python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $S; wait
  for so in ~/.cache/torch_extensions/py*/vo_native_kernels_*/*.so; do
    echo "$so"; /usr/local/cuda/bin/cuobjdump -res-usage "$so" 2>&1 | grep -A1 "prep_mma\|output_mma" | grep -o "Function [^ ]*\|REG:[0-9]*\|STACK:[0-9]*\|LOCAL:[0-9]*" | paste -sd' '
  done > $R/res.txt
  G=worklogs/remote_scripts/gdn_chunk_probe.py
  for i in 1 2 3; do
    for d in float16 bfloat16; do
      for t in base new; do
        dd=.; [ $t = base ] && dd=build/base
        e=""; [ $i = 1 ] && e=--err
        (cd $dd && python3 $G --T 16384 --reps 20 --dtype $d $e --json $R/gdn_${t}_${d}_$i.json > $R/gdn_${t}_${d}_$i.txt 2>&1)
        echo "gdn $t $d $i: $(grep -E ' us |errors' $R/gdn_${t}_${d}_$i.txt | sed 's/void (anonymous namespace):://; s/<.*//' | tr -s ' ' | tr '\n' '|')" | tee -a $S
      done
    done
  done
  timeout 60 $P tests/native/test_gdn_chunk_kernels.py -k "cuda and not vs_reference" > $R/tests_gdn_rest.txt 2>&1
  echo "gdn (not vs_reference) rc=$? $(tail -1 $R/tests_gdn_rest.txt)" | tee -a $S
  left=$(( 540 - ($(date +%s) - t0) ))
  timeout $left $P tests/native/test_gdn_chunk_kernels.py -k "cuda and vs_reference" > $R/tests_gdn_ref_a.txt 2>&1
  echo "gdn vs_reference (limit $left s) rc=$? $(tail -1 $R/tests_gdn_ref_a.txt)" | tee -a $S
else
  python3 -c "$B" > $R/build_b.log 2>&1; echo "build rc=$?" | tee -a $S
  timeout 540 $P tests/native/test_gdn_chunk_kernels.py -k "cuda and vs_reference" > $R/tests_gdn_ref_b.txt 2>&1
  echo "gdn vs_reference rc=$? $(tail -1 $R/tests_gdn_ref_b.txt)" | tee -a $S
fi
