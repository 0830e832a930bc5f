#!/usr/bin/env bash
# The stand-in of the platform's base for development and CI (engines/v0/STANDIN.md):
# a Python 3.10 venv with torch 2.1.2, transformers 4.51.3, vLLM 0.6.3's Python layer and the
# vllm_standin harness (the card's GPU worker on CPU tensors).
#   VENV_V0   where (default .venv-v0)
#   PY310     the Python 3.10 that makes it (default: pyenv's 3.10, else python3.10 on PATH)
# The vLLM wheel is fetched once (pip's cache keeps it) and repacked by repack_vllm.py; the venv
# is rebuilt only when this folder changes (its hash is stamped in the venv).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV_V0=${VENV_V0:-.venv-v0}
PY310=${PY310:-$(ls /root/.pyenv/versions/3.10.*/bin/python3.10 2>/dev/null | tail -n 1)}
PY310=${PY310:-$(command -v python3.10)}
key=$(cat "$here"/build_env.sh "$here"/requirements.txt "$here"/repack_vllm.py \
      "$here"/pyairports/*.py "$here"/vllm_standin/*.py | sha256sum | cut -c1-16)
if [ -f "$VENV_V0/.standin-$key" ]; then
  echo "stand-in venv $VENV_V0 is current ($key)"
  exit 0
fi
echo "building the stand-in venv $VENV_V0 ($key) from $PY310"
rm -rf "$VENV_V0"
"$PY310" -m venv "$VENV_V0"
py="$VENV_V0/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -r "$here/requirements.txt"
# torch 2.1.2 pulls in Triton 2.1; the card has none that works and vLLM 0.6.3 reads its absence
# as HAS_TRITON = False, as on the card.
"$py" -m pip uninstall -q -y triton
# outlines depends on pyairports; PyPI's pyairports 0.0.1 is setuptools' sample project (top-level
# `sample` and `tests` packages, a `byted-wandb` script, no pyairports module). Its `tests`
# package shadows this repository's tests/ (a namespace package), so it goes; our stub below
# provides the module outlines imports.
"$py" -m pip uninstall -q -y pyairports
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --only-binary :all: --python-version 3.10 \
  --platform manylinux1_x86_64 vllm==0.6.3 -d "$work"
"$py" "$here/repack_vllm.py" "$work"/vllm-0.6.3-*.whl "$work/out" >/dev/null
"$py" -m pip install -q --no-deps "$work"/out/vllm-*.whl
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# gguf 0.10 (vLLM 0.6.3's GGUF loader) ships its command-line tools as a top-level `scripts`
# package; a regular package shadows this repository's scripts/ (a namespace package) wherever
# both are on sys.path, so `from scripts.build_context import ...` failed here. The loader needs
# only the `gguf` package: the tools and their gguf-* launchers go.
rm -rf "$site/scripts" "$VENV_V0"/bin/gguf-*
cp -r "$here/pyairports" "$site/"
# The harness that runs the card's GPU worker on CPU tensors (vllm_standin/__init__.py).
rm -rf "$site/vllm_standin"
cp -r "$here/vllm_standin" "$site/"
find "$site/vllm_standin" -name __pycache__ -prune -exec rm -rf {} +
"$py" -c "import torch, vllm, vllm_standin.executor; from vllm.platforms import current_platform as p; \
assert vllm.__version__.startswith('0.6.3') and p.is_cpu(); \
print('stand-in: python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)"
touch "$VENV_V0/.standin-$key"
