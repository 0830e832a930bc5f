#!/usr/bin/env bash
# On the device tool's GPU machine, from the repo root, with build/hgpu/carry carried (made here
# by worklogs/remote_scripts/v0_gpu_env.sh): vLLM 0.6.3's V0 engine with our overlay on the GPU.
#   setup   install vLLM 0.6.3's Python layer + the carried wheels into /tmp/v0site (--target),
#           hide Triton as the card does (sitecustomize: sys.modules["triton"] = None), deploy the
#           carried tree's overlay with patch_ops.sh apply, JIT-build our extension (background)
#   oracle  build the tiny model with the device's own transformers 5 (no checkpoint travels:
#           132 MB is over the tool's carry limit), its float32 transformers oracle on the CPU,
#           (while the extension builds)
#   tiny    the V0 engine in float32 and float16 against it (and against the carried oracle
#           of the development machine's build, which applies when the weights' hashes agree)
#   real    one TP4 rank at real size through V0 (worklogs/v0_gpu_bench.py real)
#   step032 the 0.32.0 line's step on the same GPU (decode_step_bench.py, cuda, fp16, B = 1)
# Usage: bash worklogs/remote_scripts/v0_gpu_run.sh [STEP...]  (default: all, in order)
# Env: OUT (required), CARRY (default build/hgpu/carry), T_<STEP> limits in seconds.
set -uo pipefail
: "${OUT:?set OUT}"
REPO=$(pwd)
C=${CARRY:-build/hgpu/carry}
SRC=/tmp/v0src SITE=/tmp/v0site TOK=/tmp/v0tok
COMMIT=$(cat "$C/src.commit")
export PYTHONUNBUFFERED=1 USE_FLAX=0 USE_TF=0 USE_JAX=0 TORCH_EXTENSIONS_DIR=/tmp/ext COMMIT
export NATIVE_KERNELS=${NATIVE_KERNELS:-auto} NATIVE_KERNELS_JIT=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
S=$OUT/summary.txt
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(setup oracle real tiny step032)
DEADLINE=${DEADLINE:-570}  # seconds for the whole call: a step gets at most what is left
run() {  # name limit command...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 20 ]; then echo "== $name skipped: ${left} s left" | tee -a "$S"; return 124; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s" | tee -a "$S"
  return $rc
}
# `python3 -c` puts the working directory first on sys.path: run those from /tmp, so they import
# the deployed overlay, not this checkout's.
V0() { (cd /tmp && PYTHONPATH=$SITE "$@"); }
for step in "${steps[@]}"; do
  case $step in
    setup)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"
      python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)' | tee -a "$S"
      echo "tree deployed: $COMMIT" | tee -a "$S"
      rm -rf $SRC $SITE $TOK && mkdir -p $SRC $SITE $TOK && tar -xzf "$C/src.tgz" -C $SRC
      run install 120 bash -c "python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target $SITE $C/wheels/*.whl $C/vllm-*.whl && \
        python3 -m pip install -q --no-index --no-deps --no-cache-dir --target $TOK $C/tok/*.whl && \
        cp -r $C/pyairports $SITE/ && \
        printf 'import sys\nsys.modules[\"triton\"] = None  # the card: no usable Triton\n%s\n' \
          'sys.modules[\"sklearn\"] = None  # device only: its scipy.stats import fails under transformers 4.51' \
          > $SITE/sitecustomize.py"
      (cd $SRC && run deploy 120 env PYTHONPATH=$SITE PYTHON=python3 bash patch_ops.sh apply)
      (cd /tmp && run import 120 env PYTHONPATH=$SITE python3 -c "import vllm, vllm_overrides, transformers; \
from vllm.platforms import current_platform as p; from vllm.attention.selector import get_attn_backend; \
import torch; print('vllm', vllm.__version__, 'platform', type(p).__name__, 'transformers', \
transformers.__version__, vllm_overrides.__file__)")
      tail -2 "$OUT/import.log" | tee -a "$S"
      # Our extension, built once from the deployed copy (the engine then loads it from cache).
      ( V0 timeout 240 python3 -c "from vllm_overrides.native import kernels; kernels.jit_build(); \
assert kernels.extension_loaded(), kernels._load_error; print('extension loaded')" \
        > "$OUT/jit.log" 2>&1; echo "== jit rc=$? (background)" >> "$S" ) &
      JIT_PID=$! ;;
    oracle)
      (cd $SRC && run tiny_build "${T_TINYBUILD:-120}" env PYTHONPATH=$TOK python3 tests/tiny_model.py \
        --out $SRC/build/tiny-model)
      sha256sum $SRC/build/tiny-model/model.safetensors | tee -a "$S"
      if [ -f "$C/hf_oracle_device.json" ]; then  # computed by an earlier call on the device
        cp "$C/hf_oracle_device.json" "$OUT/"
      else
        (cd $SRC && run oracle "${T_ORACLE:-150}" env PYTHONPATH=$TOK python3 \
          tests/native_engine/hf_oracle.py "$OUT/hf_oracle_device.json")
      fi ;;
    tiny)
      [ -n "${JIT_PID:-}" ] && wait "$JIT_PID"
      for dt in float32 float16; do
        run "tiny_$dt" "${T_TINY:-150}" env PYTHONPATH=$SITE python3 worklogs/v0_gpu_bench.py tiny \
          --model $SRC/build/tiny-model --oracle "$OUT/hf_oracle_device.json" \
          --oracle "$C/hf_oracle.json" --dtype $dt --out "$OUT/tiny_$dt.json"
        grep -E "identical|^len|^prefix|^batch" "$OUT/tiny_$dt.txt" | head -12 >> "$S"
      done ;;
    real)
      [ -n "${JIT_PID:-}" ] && wait "$JIT_PID"
      tpl=$SRC/build/tiny-model/config.json
      [ -f "$tpl" ] || tpl=$REPO/$C/tiny_cfg/config.json  # the development machine's tiny config
      V0 python3 "$REPO/worklogs/v0_gpu_bench.py" rank-config --template "$tpl" \
        --out /tmp/rank --tp 4 > "$OUT/rank_config.log" 2>&1
      run real "${T_REAL:-300}" env PYTHONPATH=$SITE python3 worklogs/v0_gpu_bench.py real \
        --model /tmp/rank --out "$OUT/real.json" ${REAL_ARGS:-}
      cat "$OUT/real.txt" >> "$S" ;;
    step032)
      # decode_step_bench imports vllm_overrides from its parent folder: give it the deployed
      # copy, so the extension built above (named by its source path) is the one it loads.
      mkdir -p $SITE/worklogs && cp $SRC/worklogs/{decode_step_bench,kernel_bench,perf_metrics}.py $SITE/worklogs/
      run step032 "${T_STEP032:-150}" env NATIVE_KERNELS=cuda python3 $SITE/worklogs/decode_step_bench.py \
        --out "$OUT/step032" --commit "$COMMIT" --batches 1 --contexts 4096,32768 --variants cuda \
        --dtype float16 --budget-s 100
      grep -E "^ +1 +(4096|32768)" "$OUT/step032/decode_step_bench.txt" >> "$S" ;;
  esac
done
