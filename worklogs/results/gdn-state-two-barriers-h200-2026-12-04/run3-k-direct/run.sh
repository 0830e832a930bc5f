python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; NEW=$PWD
build() { (cd $1 && python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' 2>&1 | tail -3); }
build build/base & build $NEW; wait
for so in ~/.cache/torch_extensions/py312_cu130/vo_native_kernels_*/*.so; do echo $so; /usr/local/cuda/bin/cuobjdump -res-usage $so 2>&1 | grep -A1 "state_mma.*HalfELi128"; done > $R/res.txt
dir() { case $1 in base) echo $NEW/build/base;; new) echo $NEW;; esac; }
for s in 1 4 16; do for t in base new; do
  (cd $(dir $t) && python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --seqs $s --reps 20 --dtype float16 $([ $s = 1 ] && echo --err) --json $R/${t}_fp16_s$s.json > $R/${t}_fp16_s$s.txt 2>&1)
done; done
python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 20 --dtype bfloat16 --err --json $R/new_bf16.json > $R/new_bf16.txt 2>&1
grep -H "state_mma\|total\|err" $R/*.txt > $OUT/summary.txt; grep REG $R/res.txt >> $OUT/summary.txt
tar -czf $OUT/x.tgz -C $OUT r; rm -rf $R
