#!/usr/bin/env bash
# GPU tests of the warp-width template change (be735c3 + 923f65f) that the last session's call cut off.
# $1 = part: a = build + MoE prefill cuda tests + GDN chunk cuda tests other than vs_reference;
#            b = build (cached when warm) + GDN chunk vs_reference cuda tests.
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 GDN_CHUNK_KERNEL=fused PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/ext
R=$OUT/r; mkdir -p $R; S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
git log --oneline -1 2>/dev/null | tee -a $S
t0=$(date +%s)
python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' > $R/build_$1.log 2>&1
echo "build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $S
P="python3 -m pytest -p no:cacheprovider -o addopts= -v -rA --durations=0"
if [ "$1" = a ]; then
  timeout 200 $P tests/native/test_moe_prefill_kernels.py -k cuda --junitxml=$R/moe.xml > $R/tests_moe.txt 2>&1
  echo "moe rc=$? $(tail -1 $R/tests_moe.txt)" | tee -a $S
  timeout 230 $P tests/native/test_gdn_chunk_kernels.py -k "cuda and not vs_reference" --junitxml=$R/gdn_rest.xml > $R/tests_gdn_rest.txt 2>&1
  echo "gdn (not vs_reference) rc=$? $(tail -1 $R/tests_gdn_rest.txt)" | tee -a $S
else
  timeout 520 $P tests/native/test_gdn_chunk_kernels.py -k "cuda and vs_reference" --junitxml=$R/gdn_ref.xml > $R/tests_gdn_ref.txt 2>&1
  echo "gdn vs_reference rc=$? $(tail -1 $R/tests_gdn_ref.txt)" | tee -a $S
fi
