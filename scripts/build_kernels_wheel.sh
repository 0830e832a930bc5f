#!/usr/bin/env bash
# Build the vo_native_kernels wheel (fused decode kernels) for the torch of $PYTHON's
# environment and put it in build-inputs/kernels/ (default OUT_DIR), where the Dockerfile installs it
# from in a layer of its own (the wheelhouse feeds the vLLM layer; a new kernels wheel must not
# redo that one).
# Build on a machine with that torch and its toolchain (never inside the image build: compiling
# there sank earlier submissions); knobs: vllm_overrides/native/csrc/setup.py.
#
#   PYTHON=/path/to/python TORCH_CUDA_ARCH_LIST=9.0 bash scripts/build_kernels_wheel.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${1:-build-inputs/kernels}
mkdir -p "$out"
# Build from a copy, so no build folders or egg-info land in the package.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r vllm_overrides/native/csrc/. "$src"/
VO_KERNELS_VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' vllm_overrides/__init__.py) \
  "$PY" -m pip wheel --no-deps --no-build-isolation -w "$out" "$src"
ls -l "$out"/vo_native_kernels-*.whl
