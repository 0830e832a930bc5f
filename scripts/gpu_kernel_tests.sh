#!/usr/bin/env bash
# On a CUDA machine (the device tool's H200, or any box with nvcc + a CUDA torch): build the
# fused kernels (JIT, torch.utils.cpp_extension) and run their tests against the float64
# references and the PyTorch path. CPU CI skips these tests; this script is where they run.
#
#   bash scripts/gpu_kernel_tests.sh [PYTEST_ARGS...]
#
# Env: PYTHON (default python3); TORCH_CUDA_ARCH_LIST (default: the visible GPU's arch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export NATIVE_KERNELS=cuda NATIVE_KERNELS_JIT=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
"$PY" -c "from vllm_overrides.native import kernels; kernels.jit_build(verbose=False); \
assert kernels.extension_loaded(), kernels._load_error; print('vo_native_kernels built and loaded')"
echo "build: $(( $(date +%s) - t0 )) s"
"$PY" -m pytest tests/native/test_cuda_kernels.py tests/native/test_moe_prefill_kernels.py \
  tests/native/test_gdn_chunk_kernels.py tests/native/test_gdn_conv_kernels.py \
  tests/native/test_paged_attention_kernels.py \
  -p no:cacheprovider -o addopts="" -q -rs "$@"
