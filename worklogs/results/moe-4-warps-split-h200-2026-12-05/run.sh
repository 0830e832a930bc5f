#!/usr/bin/env bash
# 2026-12-05 10:33-10:38 UTC, device tool on nvidia-h200, carry=[".whl", "build/base"], limit 570 s.
# build/base = `git archive 6066c08` plus this session's moe_gemm_probe.py (--split; the
# kernels are 6066c08's = 0cb0011's); the tree = the same plus moe_gemm_4_warps.patch (here).
# The split probe came first (base tree); moe_gemm_ab.sh then ran under a 400 s limit and wrote
# everything else here (its step rows: step_base/, step_new/).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
nvidia-smi --query-gpu=name --format=csv,noheader; mkdir -p $OUT/r
(cd build/base && export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 && python3 -c 'from vllm_overrides.native import kernels; kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error' && timeout 100 python3 worklogs/remote_scripts/moe_gemm_probe.py --split 2,4 --label split-6066c08 --json $OUT/r/split.json > $OUT/r/split.txt 2>&1; echo split rc=$?); tail -25 $OUT/r/split.txt
timeout 400 bash worklogs/remote_scripts/moe_gemm_ab.sh 2>&1 | tail -40
