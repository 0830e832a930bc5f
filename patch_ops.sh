#!/usr/bin/env bash
# Deploy our overlay into the vLLM installed for $PYTHON (default python3).
# The installed vLLM's version (a local label such as +corex.3.2.3 or +cpu ignored) picks the
# overlay from one table, OVERLAYS in vllm_overrides/patching.py:
#   0.6.3   the platform line (V0 engine): patches/vllm-0.6.3/*.patch, and our plugin registered
#           as a vllm.general_plugins entry point (a vllm_overrides-<version>.dist-info beside
#           vllm), which vLLM calls in every process it starts
#   0.32.0  the reference line: patches/vllm-0.32.0/*.patch, no plugin
#   other   refused, naming the supported versions (exit 2)
#   patch_ops.sh apply   apply the diffs (a second apply is a no-op), install vllm_overrides
#                        beside vllm, register the plugin, write the sha256 manifest
#   patch_ops.sh verify  every deployed file matches the manifest and byte-compiles; in a fresh
#                        interpreter every overlay module of this generation and every patched
#                        vLLM module imports and the plugin entry point loads; names what is
#                        wrong and exits non-zero otherwise
#   patch_ops.sh status  what is applied / installed / registered
#   patch_ops.sh revert  undo the diffs, remove the overlay, its dist-info and the manifest
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
if [ $# -ne 1 ]; then
  echo "usage: PYTHON=python3 $0 apply|verify|status|revert" >&2
  exit 2
fi
# Run this checkout's copy of the package (not a previously deployed one).
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m vllm_overrides.patching "$1"
