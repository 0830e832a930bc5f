"""`make preflight` on the platform line: the V0 memory model of a BI-V100 at TP4 says GO for the
shipped computility-run.yaml with margin, NO-GO when the budget cannot hold a full-context prompt
above the block manager's watermark, and its arithmetic is vLLM 0.6.3's own (block bytes from
``CacheEngine.get_cache_block_size``, the never-schedulable rule from ``BlockSpaceManagerV2``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_overrides import preflight as pf
from vllm_overrides.launcher import PLATFORM_CONFIG, REPO_DIR, load_run_config


@pytest.fixture(scope="module")
def facts() -> pf.ModelFacts:
    return pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)


def _run(*extra: str) -> tuple[dict[str, pf.Check], dict]:
    args = pf.parse_args(["--config", str(PLATFORM_CONFIG), "--patches", "skip", *extra])
    checks, data = pf.run_preflight(args)
    return {c.name: c for c in checks}, data


def test_the_shipped_yaml_is_go_with_margin_on_v0() -> None:
    checks, data = _run()
    assert data["engine"] == "0.6.3"
    assert all(c.status != pf.NO_GO for c in checks.values()), checks
    mem = checks["KV capacity (V0)"]
    assert mem.status == pf.GO, mem.detail
    plan = data["v0_memory"]
    assert plan["max_model_len"] >= pf.REQUIRED_CONTEXT
    required = plan["needed_blocks"] + plan["watermark_blocks"]
    assert plan["num_gpu_blocks"] >= required * (1 + pf.V0_MARGIN)
    # The YAML's own settings went in: TP4, its chunk, its --max-num-seqs, the IPC region.
    config = load_run_config(PLATFORM_CONFIG)
    assert plan["tp"] == 4 and plan["ipc"] is (config.env.get("ENABLE_CUSTOM_IPC") == "1")
    assert str(plan["max_num_batched_tokens"]) in config.command
    assert str(plan["max_num_seqs"]) in config.command
    # The budget rows add up to the KV pool.
    assert sum(r["bytes"] for r in plan["rows"][:-1]) == plan["kv_bytes"]
    assert plan["rows"][-1]["bytes"] == plan["kv_bytes"]
    # The 0.6.3 parser judged the argv (this venv has 0.6.3).
    assert checks["vLLM parser"].status == pf.GO, checks["vLLM parser"].detail


@pytest.mark.parametrize("util", ["0.6", "0.62"])
def test_low_utilisation_is_no_go(util: str) -> None:
    """At 0.6-0.62 of the card, weights + states + activations leave fewer KV blocks than a
    262,144-token prompt needs above the 1 % watermark: V0 would never schedule it."""
    checks, data = _run("--gpu-mem-util", util)
    mem = checks["KV capacity (V0)"]
    plan = data["v0_memory"]
    assert mem.status == pf.NO_GO, mem.detail
    assert plan["num_gpu_blocks"] - plan["needed_blocks"] < plan["watermark_blocks"]
    assert "never scheduled" in mem.detail


def test_margin_band_is_a_warning(facts: pf.ModelFacts) -> None:
    """Between the line and 10 % above it: WARN (the assumed terms are inside 10 %)."""
    kw = dict(tp=4, max_num_batched_tokens=8192, max_num_seqs=16, max_model_len=262_144)
    statuses = {}
    for util in [u / 1000 for u in range(600, 760)]:
        plan = pf.v0_memory_plan(facts, gpu_memory_utilization=util, **kw)
        statuses.setdefault(pf.check_v0_memory(plan).status, util)
    assert statuses[pf.NO_GO] < statuses[pf.WARN] < statuses[pf.GO]


def test_budget_terms_move_the_pool(facts: pf.ModelFacts) -> None:
    kw = dict(tp=4, gpu_memory_utilization=0.9, max_num_seqs=16, max_model_len=262_144)
    base = pf.v0_memory_plan(facts, max_num_batched_tokens=8192, **kw)
    state = pf.gdn_state_bytes(facts, 4)
    # One GDN state per rank: conv 2,048 ch x 3 fp16 + recurrent 8 x 128 x 128 fp32, 30 layers.
    assert state == 30 * (2048 * 3 * 2 + 8 * 128 * 128 * 4)
    more = pf.v0_memory_plan(facts, max_num_batched_tokens=8192, gdn_checkpoints=96, **kw)
    assert base.kv_bytes - more.kv_bytes == (96 - base.gdn_checkpoints) * state
    bigger = pf.v0_memory_plan(facts, max_num_batched_tokens=16384, **kw)
    assert bigger.kv_bytes < base.kv_bytes  # a larger chunk, a larger profile peak
    no_ipc = pf.v0_memory_plan(facts, max_num_batched_tokens=8192, ipc=False, **kw)
    assert no_ipc.kv_bytes - base.kv_bytes == pf.IPC_REGION_BYTES
    # The profile encodes one step's image: the (replicated) vision tower sets the peak; an
    # image larger than the step comes out of the memory outside the utilisation.
    act = pf.v0_activation_bytes(facts, 8192, 16)
    assert act["largest_family"] == "vision" and act["largest_image_excess"] > 0
    text = pf.v0_activation_bytes(facts, 8192, 16, images=False)
    assert text["largest_family"] == "moe" and text["largest_image_excess"] == 0
    no_images = pf.v0_memory_plan(facts, max_num_batched_tokens=8192, images=False, **kw)
    assert no_images.kv_bytes > base.kv_bytes
    assert no_images.headroom_bytes - base.headroom_bytes == act["largest_image_excess"]
    assert base.weights_estimate_gib > pf.weights_estimate_gib(facts, 4)  # tower replicated


def test_checkpoint_pool_is_the_engines_and_the_yamls(tmp_path: Path) -> None:
    """The pool size the budget charges: the YAML's VO_GDN_CHECKPOINTS, else the engine's
    default; each checkpoint is the engine's own per-checkpoint size."""
    prefix_cache = pytest.importorskip("vllm_overrides.engines.v0.prefix_cache")
    assert pf.V0_GDN_CHECKPOINTS == prefix_cache.DEFAULT_POOL
    assert pf.V0_GDN_CHECKPOINTS_ENV == prefix_cache.ENV_POOL
    facts = pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)
    assert pf.gdn_state_bytes(facts, 4) == prefix_cache.checkpoint_bytes(
        30, 2048, 4, 8, 128, 128, 2
    )
    # The shipped YAML names a pool of its own: the test's value takes its place.
    text = re.sub(
        rf"  - name: {pf.V0_GDN_CHECKPOINTS_ENV}\n    value: '\d+'\n",
        "",
        PLATFORM_CONFIG.read_text(encoding="utf-8"),
    )
    text = text.replace("env:\n", f"env:\n  - name: {pf.V0_GDN_CHECKPOINTS_ENV}\n    value: '77'\n")
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(text, encoding="utf-8")
    args = pf.parse_args(["--config", str(yaml_path), "--patches", "skip", "--engine", "0.6.3"])
    _, data = pf.run_preflight(args)
    assert data["v0_memory"]["gdn_checkpoints"] == 77


def test_block_bytes_are_vllm_063s(facts: pf.ModelFacts, tmp_path: Path) -> None:
    """V0's own ``get_cache_block_size`` on the real model's config through our config class
    (``layers_block_type``: only the 10 attention layers get KV) at TP4, fp16."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig
    from vllm.worker.cache_engine import CacheEngine

    from vllm_overrides.engines.v0 import register

    register()
    (tmp_path / "config.json").write_text(
        pf.DEFAULT_MODEL_CONFIG.read_text(encoding="utf-8"), encoding="utf-8"
    )
    model = ModelConfig(
        model=str(tmp_path), tokenizer=str(tmp_path), tokenizer_mode="auto",
        trust_remote_code=False, dtype="half", seed=0, max_model_len=262_144,
        enforce_eager=True, skip_tokenizer_init=True,
    )  # fmt: skip
    parallel = ParallelConfig(pipeline_parallel_size=1, tensor_parallel_size=4,
                              worker_use_ray=False, distributed_executor_backend="mp")  # fmt: skip
    cache = CacheConfig(block_size=pf.V0_BLOCK_SIZE, gpu_memory_utilization=0.9, swap_space=1,
                        cache_dtype="auto")  # fmt: skip
    assert model.get_num_attention_layers(parallel) == facts.attention_layers == 10
    assert CacheEngine.get_cache_block_size(cache, model, parallel) == pf.v0_block_bytes(facts, 4)
    assert pf.v0_block_bytes(facts, 4) == 16 * 10 * 1 * 256 * 2 * 2


@pytest.mark.parametrize("blocks", [1_000, 16_968, 58_487])
def test_watermark_rule_is_the_block_managers(blocks: int) -> None:
    """The preflight's "never scheduled" line is BlockSpaceManagerV2.can_allocate's NEVER."""
    from vllm.core.block_manager_v2 import BlockSpaceManagerV2
    from vllm.core.interfaces import AllocStatus
    from vllm.inputs import LLMInputs
    from vllm.sequence import Sequence, SequenceGroup

    manager = BlockSpaceManagerV2(
        block_size=pf.V0_BLOCK_SIZE, num_gpu_blocks=blocks, num_cpu_blocks=0,
        watermark=pf.V0_WATERMARK, enable_caching=True,
    )  # fmt: skip
    limit = blocks - int(pf.V0_WATERMARK * blocks)  # blocks a prompt may need
    for n_tokens in (limit * 16, limit * 16 + 1):
        seq = Sequence(0, LLMInputs(prompt_token_ids=list(range(n_tokens))), block_size=16)
        group = SequenceGroup("r", [seq], arrival_time=0.0)
        never = manager.can_allocate(group) == AllocStatus.NEVER
        assert never is (pf.cdiv(n_tokens, 16) > limit), n_tokens


def test_cli_prints_the_budget_table_and_json() -> None:
    base = [sys.executable, "-m", "vllm_overrides.preflight", "--config", str(PLATFORM_CONFIG),
            "--patches", "skip"]  # fmt: skip
    text = subprocess.run(base, capture_output=True, text=True, cwd=REPO_DIR, timeout=300)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "KV capacity (V0)" in text.stdout and "= KV cache" in text.stdout
    js = subprocess.run([*base, "--json", "--gpu-mem-util", "0.6"], capture_output=True,
                        text=True, cwd=REPO_DIR, timeout=300)  # fmt: skip
    # vLLM's own logger writes to stdout too: the report starts at the first '{' line.
    report = json.loads(js.stdout[js.stdout.index("\n{") + 1 :])
    assert js.returncode == 1 and report["ok"] is False
    assert report["v0_memory"]["gpu_memory_utilization"] == 0.6
