set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
# -lineinfo for this profile only (source-line attribution; same code otherwise)
sed -i 's/extra_cuda_cflags=\["-O3"\]/extra_cuda_cflags=["-O3", "-lineinfo"]/' vllm_overrides/native/kernels.py
grep -n lineinfo vllm_overrides/native/kernels.py
python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' 2>&1 | tail -3
/usr/local/cuda/bin/cuobjdump -res-usage ~/.cache/torch_extensions/py312_cu130/vo_native_kernels*/*.so > $R/res.txt 2>&1
python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 20 --dtype float16 --json $R/probe_fp16.json > $R/probe_fp16.txt 2>&1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --kernel-name regex:state_mma --launch-skip 1 --launch-count 1 --set full --import-source yes -o $R/state \
  python3 worklogs/remote_scripts/gdn_chunk_probe.py --T 16384 --reps 1 --dtype float16 > $R/ncu_state.log 2>&1
$NCU -i $R/state.ncu-rep --page details > $R/state_details.txt 2>&1
$NCU -i $R/state.ncu-rep --page source --csv --print-source cuda > $R/state_cuda.csv 2>&1
$NCU -i $R/state.ncu-rep --page source --csv --print-source sass > $R/state_sass.csv 2>&1
$NCU -i $R/state.ncu-rep --page raw --csv > $R/state_raw.csv 2>&1
$NCU --kernel-name regex:moe_grouped_gemm --launch-count 2 --set full --import-source yes -o $R/gemm \
  python3 worklogs/remote_scripts/moe_gemm_probe.py --dtype float16 --once > $R/ncu_gemm.log 2>&1
$NCU -i $R/gemm.ncu-rep --page details > $R/gemm_details.txt 2>&1
$NCU -i $R/gemm.ncu-rep --page source --csv --print-source cuda > $R/gemm_cuda.csv 2>&1
ls -la $R/*.ncu-rep > $R/reps.txt; rm -f $R/*.ncu-rep
ls -la $R > $OUT/summary.txt
tail -5 $R/probe_fp16.txt >> $OUT/summary.txt
tar -czf $OUT/x.tgz -C $OUT r && rm -rf $R
