#!/usr/bin/env bash
# Deploy our overlay into the vLLM installed for $PYTHON (default python3).
#   patch_ops.sh apply   apply patches/vllm-0.32.0/*.patch (a second apply is a no-op), install
#                        vllm_overrides beside vllm, write the sha256 manifest
#   patch_ops.sh verify  every deployed file matches the manifest, byte-compiles and imports;
#                        names the file that is wrong and exits non-zero otherwise
#   patch_ops.sh status  what is applied / installed
#   patch_ops.sh revert  undo the patches, remove the overlay and the manifest
# Refuses any vLLM other than the version the patches target. Logic: vllm_overrides/patching.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
if [ $# -ne 1 ]; then
  echo "usage: PYTHON=python3 $0 apply|verify|status|revert" >&2
  exit 2
fi
# Run this checkout's copy of the package (not a previously deployed one).
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m vllm_overrides.patching "$1"
