#!/usr/bin/env bash
# GDN state pass with W and K~ double-buffered by chunk parity (two barriers a chunk instead of three): base = ed65ec5, new = that + the change. Two alternating rounds per dtype, then every GPU case of the chunk tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
B='from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error'
(cd build/base && python3 -c "$B" > $R/build_base.log 2>&1; echo "base build rc=$?") &
python3 -c "$B" > $R/build_new.log 2>&1; echo "new build rc=$?"; tail -3 $R/build_new.log; wait
G=worklogs/remote_scripts/gdn_chunk_probe.py
for i in 1 2; do
  for d in float16 bfloat16; do
    for t in base new; do
      dd=.; [ $t = base ] && dd=build/base
      e=""; [ $i = 1 ] && e=--err
      (cd $dd && python3 $G --T 16384 --reps 20 --dtype $d $e --json $R/${t}_${d}_$i.json > $R/${t}_${d}_$i.txt 2>&1)
      echo "$t $d $i: $(grep -E 'state|total|errors' $R/${t}_${d}_$i.txt | tr '\n' ' ')" | tee -a $OUT/summary.txt
    done
  done
done
timeout 230 python3 -m pytest tests/native/test_gdn_chunk_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests.txt 2>&1; echo "gdn chunk tests: $(tail -1 $R/tests.txt)" | tee -a $OUT/summary.txt
rm -f $R/build_base.log
tar -czf $OUT/x.tgz -C $OUT r
