python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; NEW=$PWD
build() { (cd $1 && python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' 2>&1 | tail -3); }
build build/base; build $NEW
for so in ~/.cache/torch_extensions/py312_cu130/vo_native_kernels_*/*.so; do echo $so; /usr/local/cuda/bin/cuobjdump -res-usage $so 2>&1 | grep -A1 state_mma; done > $R/res.txt
for i in 1 2; do for t in base new; do
  d=$NEW; [ $t = base ] && d=$NEW/build/base
  (cd $d && python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 20 --dtype float16 $([ $i = 1 ] && echo --err) --json $R/${t}_fp16_$i.json > $R/${t}_fp16_$i.txt 2>&1)
done; done
for t in base new; do d=$NEW; [ $t = base ] && d=$NEW/build/base
  (cd $d && python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 20 --dtype bfloat16 --err --json $R/${t}_bf16.json > $R/${t}_bf16.txt 2>&1); done
grep -H "state_mma\|total\|err" $R/*.txt > $OUT/summary.txt
timeout 330 python3 -m pytest tests/native/test_gdn_chunk_kernels.py -p no:cacheprovider -o addopts="" -q -k cuda > $R/tests.txt 2>&1
tail -3 $R/tests.txt >> $OUT/summary.txt
tar -czf $OUT/x.tgz -C $OUT r
