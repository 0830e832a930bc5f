#!/usr/bin/env bash
# One H200 session's kernel run (issues 14 and 15), in the device tool's time budget: JIT build,
# GPU tests of the kernels, kernel_bench groups, the decode step (A/B of the MoE routing launch)
# and the whole prefill step. Every step has its own time limit, so a slow or failing step
# leaves the rest their time; results land in $OUT/<step>/ and each step's log in $OUT/.
#
#   COMMIT=<sha> bash worklogs/remote_scripts/h200_kernels_run.sh [STEP...]
#
# Steps (default: all, in this order): build tests kb decode prefill. Needs torch with CUDA,
# nvcc, and (for the FLA rows) fla-core on PYTHONPATH; the device tool's recipe is in
# worklogs/LEDGER.md ("Fused decode kernels on the H200").
#
# Environment: OUT (required), COMMIT (recorded in the results), TESTS (pytest selection, default
# the three kernel test files), TEST_K (a -k expression), KB_GROUPS (default
# tp4_moe,tp4_gdn_prefill), PREFILL (default 16384,65536), and T_<STEP> time limits in seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT}"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# GDN_CHUNK_KERNEL=fused is the YAML's setting: without it the prefill step's `cuda` variant runs
# the PyTorch chunk path (a run of 2026-12-03 measured 228 ms instead of ~116 that way).
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1
export GDN_CHUNK_KERNEL=${GDN_CHUNK_KERNEL:-fused}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests kb decode prefill)

run() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s"
}

for step in "${steps[@]}"; do
  case $step in
    build)
      run build "${T_BUILD:-150}" python3 -c "from vllm_overrides.native import kernels; \
kernels.jit_build(); assert kernels.extension_loaded(), kernels._load_error" ;;
    tests)
      # shellcheck disable=SC2086
      run tests "${T_TESTS:-150}" python3 -m pytest ${TESTS:-tests/native/test_cuda_kernels.py \
        tests/native/test_moe_prefill_kernels.py tests/native/test_gdn_chunk_kernels.py \
        tests/native/test_gdn_conv_kernels.py} \
        ${TEST_K:+-k "$TEST_K"} -p no:cacheprovider -o addopts="" -q -rs --tb=short --durations=5
      grep -E "passed|failed" "$OUT/tests.log" | tail -1
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 ;;
    kb)
      run kb "${T_KB:-150}" python3 worklogs/kernel_bench.py --out "$OUT/kb" --commit "$COMMIT" \
        --groups "${KB_GROUPS:-tp4_moe,tp4_gdn_prefill}" --budget-s "$((${T_KB:-150} - 20))" ;;
    decode)
      for mode in routed separate; do
        run "decode-$mode" "${T_DECODE:-60}" python3 worklogs/decode_step_bench.py \
          --out "$OUT/decode-$mode" --commit "$COMMIT" --batches 1,32 --contexts 4096 \
          --variants cuda --moe-decode "$mode" --budget-s "$((${T_DECODE:-60} - 15))"
        grep -E "^ +(1|32) +4096" "$OUT/decode-$mode/decode_step_bench.txt"
      done ;;
    prefill)
      run prefill "${T_PREFILL:-240}" python3 worklogs/decode_step_bench.py --prefill \
        "${PREFILL:-16384,65536}" --out "$OUT/prefill" --commit "$COMMIT" \
        --budget-s "$((${T_PREFILL:-240} - 30))" ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
