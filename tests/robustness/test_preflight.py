"""vllm_overrides.preflight: the static checks catch what sank earlier submissions, the memory
model reproduces the seed's start-ups, and its KV arithmetic is vLLM 0.32.0's own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_overrides import preflight as pf
from vllm_overrides.launcher import (
    DEFAULT_CONFIG,
    REPO_DIR,
    RunConfig,
    load_run_config,
    set_flag,
)

TINY_CONFIG = REPO_DIR / "build" / "tiny-model" / "config.json"


@pytest.fixture(scope="module")
def facts() -> pf.ModelFacts:
    return pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return load_run_config(DEFAULT_CONFIG)


def _yaml(tmp_path: Path, command_tail: list[str], env_value: str = "'1'") -> Path:
    cmd = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/model",
        *command_tail,
    ]
    lines = ["concurrency: 1", "command:"] + [f"  - '{a}'" for a in cmd]
    lines += ["env:", "  - name: MOE_NATIVE", f"    value: {env_value}"]
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# Model facts and the KV layout
# ----------------------------------------------------------------------------------------------


def test_facts_file_holds_the_platform_topology(facts: pf.ModelFacts) -> None:
    assert (facts.attention_layers, facts.gdn_layers) == (10, 30)
    assert (facts.num_q_heads, facts.num_kv_heads, facts.head_dim) == (16, 2, 256)
    assert (facts.gdn_key_heads, facts.gdn_value_heads, facts.gdn_key_head_dim) == (16, 32, 128)
    assert (facts.num_experts, facts.top_k, facts.moe_intermediate) == (256, 8, 512)
    assert facts.vocab_size == 248_320 and facts.max_position_embeddings == 262_144
    # Keys PLATFORM.md does not state are named, not silently invented.
    assert "mamba_ssm_dtype" in facts.assumed


def test_kv_layout_at_tp4(facts: pf.ModelFacts) -> None:
    layout = pf.kv_layout(facts, tp=4)
    assert layout.kv_heads_per_rank == 1  # 2 kv heads over 4 ranks: replicated, 1 per rank
    assert layout.attn_bytes_per_token_layer == 1 * 256 * 2 * 2
    assert layout.kv_bytes_per_token == 10 * 1024  # 10 attention layers
    assert pf.MIB / layout.kv_bytes_per_token == pytest.approx(102.4)
    # GDN state per layer and rank: conv (2048 ch x 3) fp16 + recurrent (8 x 128 x 128) fp32.
    assert layout.mamba_state_bytes_per_layer == 2048 * 3 * 2 + 8 * 128 * 128 * 4
    assert layout.block_size == 528 and layout.page_bytes >= layout.mamba_state_bytes_per_layer
    assert (layout.group_size, layout.attention_groups, layout.mamba_groups) == (10, 1, 3)


def test_kv_arithmetic_matches_vllm(facts: pf.ModelFacts) -> None:
    """Page sizes, grouping and the start-up capacity check, computed by vLLM's own code."""
    torch = pytest.importorskip("torch")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    layout = pf.kv_layout(facts, tp=4)
    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(4, 16, 32, 128, 128, 4)
    mamba = MambaSpec(
        shapes=(conv, ssm),
        dtypes=(torch.float16, torch.float32),
        block_size=layout.block_size,
        page_size_padded=layout.page_bytes,
        mamba_cache_mode="align",
    )
    attn = FullAttentionSpec(
        block_size=layout.block_size, num_kv_heads=1, head_size=256, dtype=torch.float16
    )
    assert mamba.real_page_size_bytes == layout.mamba_state_bytes_per_layer
    assert attn.page_size_bytes == layout.page_bytes == mamba.page_size_bytes
    specs: dict[str, Any] = {
        f"layers.{i}": attn if i % 4 == 3 else mamba for i in range(facts.gdn_layers + 10)
    }
    groups = kcu._get_kv_cache_groups_uniform_page_size(specs)
    assert sorted(len(g.layer_names) for g in groups) == [10, 10, 10, 10]
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=10_000_000),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="align"),
    )
    for max_len in (245_000, 262_144):
        vllm_config.model_config.max_model_len = max_len
        null_block = layout.bytes_per_block
        assert kcu.max_memory_usage_bytes(vllm_config, specs.values()) + null_block == (
            layout.needed_bytes(max_len)
        )
    vllm_config.model_config.max_model_len = 10_000_000
    for kv_gib in (2.25, 2.5, 3.0):
        kv = int(kv_gib * pf.GIB)
        # check_enough_kv_cache_memory holds one block back (the null block) before estimating.
        estimated = kcu.estimate_max_model_len(vllm_config, specs, kv - layout.bytes_per_block)
        assert layout.capacity_tokens(kv) == estimated


def test_kv_layout_of_the_tiny_model_matches_its_cpu_server_log() -> None:
    """The layout model on the CPU test model reproduces what vLLM logged when it started it.

    vLLM's CPU backend aligns attention blocks to 256 (the session server logs "Setting attention
    block size to 256 tokens" and "Padding mamba page size by 95.42%").
    """
    if not TINY_CONFIG.exists():
        pytest.skip("tiny model not built (make setup)")
    tiny = pf.ModelFacts.load(TINY_CONFIG)
    layout = pf.kv_layout(tiny, tp=1, kernel_block_alignment=256)
    assert layout.block_size == 256
    padding = 100 * (layout.page_bytes - layout.mamba_state_bytes_per_layer)
    assert f"{padding / layout.mamba_state_bytes_per_layer:.2f}" == "95.42"
    assert (layout.attention_groups, layout.mamba_groups, layout.group_size) == (1, 3, 1)
    # 4 GiB of CPU KV cache: 8,192 blocks; a 262,144-token request needs 1,024 + 3 x 2 blocks.
    blocks = 4 * pf.GIB // layout.bytes_per_block
    concurrency = blocks / (262_144 // 256 + 3 * 2)
    assert int(concurrency * 262_144) == 2_084_935  # "CPU KV cache size: 2,084,935 tokens"


@pytest.mark.server
def test_kv_layout_matches_the_session_server(server: Any) -> None:
    """Live check: the session server's logged block size and KV token count."""
    log = server.log_text()
    size = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+)", log)
    block = re.search(r"Setting attention block size to (\d+) tokens", log)
    space = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", log)
    if not (size and block and space and TINY_CONFIG.exists()):
        pytest.skip("not a local CPU server on the tiny model")
    tiny = pf.ModelFacts.load(TINY_CONFIG)
    # The session server runs the YAML's env: GDN prefill-checkpoint blocks where it asks.
    ckpt = pf.gdn_checkpoint_blocks(load_run_config(DEFAULT_CONFIG).env, prefix_caching=True)
    layout = pf.kv_layout(
        tiny, tp=1, kernel_block_alignment=int(block.group(1)), checkpoint_blocks=ckpt
    )
    assert layout.block_size == int(block.group(1))
    blocks = int(float(space.group(1)) * pf.GIB) // layout.bytes_per_block
    max_len = int(size.group(2).replace(",", ""))
    per_request = layout.attention_groups * pf.cdiv(max_len, layout.block_size) + (
        layout.mamba_groups * layout.mamba_blocks_per_group
    )
    assert int(blocks / per_request * max_len) == int(size.group(1).replace(",", ""))


# ----------------------------------------------------------------------------------------------
# Calibration on the seed
# ----------------------------------------------------------------------------------------------


def test_calibration_reproduces_the_seed(facts: pf.ModelFacts) -> None:
    cal = pf.calibrate(facts)
    # 23,760 tokens of KV lost for 8,192 more batched tokens, at 102.4 tokens per MiB.
    assert cal.activation_bytes_per_batched_token == pytest.approx(23_760 * 10_240 / 8_192)
    assert all(c["consistent"] for c in cal.checks), cal.checks
    # The weight estimate from the config agrees with the observed 16.2 GiB within 3 %.
    assert cal.weights_scale == pytest.approx(1.0, abs=0.03)
    # TP2 does not fit (PLATFORM.md).
    plan = pf.memory_plan(
        facts,
        tp=2,
        mem_per_card_gib=32,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=16_384,
        max_model_len=262_144,
    )
    assert not plan.starts and plan.weights_gib > 30


@pytest.mark.parametrize(
    ("mnbt", "starts", "observed"),
    [(16_384, True, None), (24_576, False, 233_056), (32_768, False, 209_296)],
)
def test_seed_configurations(facts: pf.ModelFacts, mnbt: int, starts: bool, observed: Any) -> None:
    plan = pf.memory_plan(
        facts,
        tp=4,
        mem_per_card_gib=32,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=mnbt,
        max_model_len=245_000,
    )
    assert plan.starts is starts
    if observed is not None:
        assert abs(plan.kv_capacity_tokens - observed) <= plan.block_size


def test_memory_check_fails_when_capacity_is_short(facts: pf.ModelFacts) -> None:
    plan = pf.memory_plan(
        facts,
        tp=4,
        mem_per_card_gib=32,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=32_768,
        max_model_len=262_144,
    )
    check = pf.check_memory(plan)
    assert check.status == pf.NO_GO and "<" in check.detail


def test_the_shipped_yaml_is_go_with_margin() -> None:
    """`make preflight` on computility-run.yaml must stay GO: users' servers must start.

    Not merely above the line: the KV capacity must clear max_model_len by more than the
    calibration's own error (4 blocks, else WARN) and by the GDN checkpoint blocks patch 0006
    may reserve, whatever the env says about GDN_NATIVE.
    """
    checks, extra = pf.run_preflight(pf.parse_args(["--patches", "skip"]))
    status = {c.name: c.status for c in checks}
    assert all(s != pf.NO_GO for s in status.values()), checks
    assert status["KV capacity"] == pf.GO and status["context length"] == pf.GO, checks
    mem = extra["memory"]
    assert mem["max_model_len"] >= pf.REQUIRED_CONTEXT
    assert mem["gpu_memory_utilization"] < pf.UTIL_OBSERVED_OOM
    # Worst case: one checkpoint block more per GDN group than the env asks for.
    layout = pf.kv_layout(pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG), mem["tp"])
    extra_blocks = (1 - extra["gdn_prefill_checkpoint_blocks"]) * layout.mamba_groups
    spare = mem["margin_tokens"] - extra_blocks * layout.block_size
    assert spare >= pf.UNCERTAINTY_BLOCKS * layout.block_size, mem


def test_checkpoint_blocks_cost_capacity(facts: pf.ModelFacts) -> None:
    """One prefill-checkpoint block per GDN group is 3 blocks (1,584 tokens at TP4) less."""
    kw = dict(tp=4, mem_per_card_gib=32, gpu_memory_utilization=0.9,
              max_num_batched_tokens=8_192, max_model_len=262_144)  # fmt: skip
    plain = pf.memory_plan(facts, **kw)
    ckpt = pf.memory_plan(facts, checkpoint_blocks=1, **kw)
    assert plain.kv_capacity_tokens - ckpt.kv_capacity_tokens == 3 * plain.block_size
    assert pf.gdn_checkpoint_blocks({"GDN_NATIVE": "1"}, True) == 1
    assert pf.gdn_checkpoint_blocks({"GDN_NATIVE": "1", "GDN_PREFILL_CHECKPOINT": "0"}, True) == 0
    assert pf.gdn_checkpoint_blocks({"GDN_NATIVE": "1"}, False) == 0
    assert pf.gdn_checkpoint_blocks({}, True) == 0


# ----------------------------------------------------------------------------------------------
# Static checks
# ----------------------------------------------------------------------------------------------


def test_the_repository_yaml_passes_the_static_checks(config: RunConfig) -> None:
    schema, loaded = pf.check_yaml_schema(DEFAULT_CONFIG)
    assert schema.status == pf.GO and loaded is not None
    assert pf.check_vllm_parser(config).status == pf.GO
    assert pf.check_workspace_files(config, REPO_DIR / "Dockerfile").status == pf.GO
    assert pf.check_crlf(pf.crlf_candidates(DEFAULT_CONFIG, config)).status == pf.GO
    facts = pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)
    assert pf.check_context(config, pf.REQUIRED_CONTEXT, facts).status == pf.GO


def test_unknown_flag_is_no_go(tmp_path: Path) -> None:
    config = load_run_config(_yaml(tmp_path, ["--bogus-flag", "1"]))
    check = pf.check_vllm_parser(config)
    assert check.status == pf.NO_GO and "bogus" in check.detail


def test_invalid_tool_parser_is_no_go(tmp_path: Path) -> None:
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "nope"]
    check = pf.check_vllm_parser(load_run_config(_yaml(tmp_path, args)))
    assert check.status == pf.NO_GO and "nope" in check.detail


def test_template_the_image_lacks_is_no_go(tmp_path: Path, config: RunConfig) -> None:
    missing = load_run_config(_yaml(tmp_path, ["--chat-template", "/workspace/nope.jinja"]))
    assert pf.check_workspace_files(missing, REPO_DIR / "Dockerfile").status == pf.NO_GO
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nCOPY patch_ops.sh computility-run.yaml /workspace/\n")
    check = pf.check_workspace_files(config, dockerfile)
    assert check.status == pf.NO_GO and "does not COPY" in check.detail


def test_crlf_is_no_go(tmp_path: Path) -> None:
    path = _yaml(tmp_path, [])
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert pf.check_crlf([path]).status == pf.NO_GO


def test_non_string_env_and_short_context_are_no_go(tmp_path: Path, facts: Any) -> None:
    schema, _ = pf.check_yaml_schema(_yaml(tmp_path, [], env_value="1"))
    assert schema.status == pf.NO_GO and "string" in schema.detail
    short = load_run_config(_yaml(tmp_path, ["--max-model-len", "131072"]))
    assert pf.check_context(short, pf.REQUIRED_CONTEXT, facts).status == pf.NO_GO
    assert pf.check_context(short, 131_072, facts).status == pf.GO  # an explicit override
    assert pf.check_utilization(0.95).status == pf.NO_GO


def test_cli_json_and_exit_status() -> None:
    """One run of the real command line: a configuration that fits is GO, with JSON output."""
    cmd = [sys.executable, "-m", "vllm_overrides.preflight", "--json", "--patches", "manifest"]
    good = subprocess.run(
        [*cmd, "--max-num-batched-tokens", "8192"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=300,
        check=False,
    )
    report = json.loads(good.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["KV capacity"] == pf.GO, report["checks"]
    assert (good.returncode == 0) == report["ok"]
    assert report["memory"]["max_num_batched_tokens"] == 8192
    assert report["calibration"]["tokens_per_mib"] == pytest.approx(102.4)


def test_no_go_exit_status(tmp_path: Path) -> None:
    out = pf.main(["--patches", "skip", "--gpu-mem-util", "0.95", "--json"])
    assert out == 1


def test_small_margin_is_a_warning_and_no_go_names_the_fix(facts: pf.ModelFacts) -> None:
    def plan(mnbt: int) -> pf.MemoryPlan:
        return pf.memory_plan(
            facts,
            tp=4,
            mem_per_card_gib=32,
            gpu_memory_utilization=0.9,
            max_num_batched_tokens=mnbt,
            max_model_len=262_144,
        )

    refused = plan(16_384)
    check = pf.check_memory(refused)
    assert check.status == pf.NO_GO
    fit = refused.max_batched_tokens_that_fit
    assert fit is not None and f"{fit:,}" in check.detail
    # At the limit the margin is under 4 blocks (the calibration's error): WARN; ~2.9 KV tokens
    # per batched token, so 1,000 fewer batched tokens clear it.
    assert pf.check_memory(plan(fit)).status == pf.WARN
    assert pf.check_memory(plan(fit - 1_000)).status == pf.GO
    assert refused.min_util_that_fits is not None
    util = pf.memory_plan(
        facts,
        tp=4,
        mem_per_card_gib=32,
        gpu_memory_utilization=refused.min_util_that_fits,
        max_num_batched_tokens=16_384,
        max_model_len=262_144,
    )
    assert util.starts


def test_max_num_seqs_is_reported_capacity_never_counted_towards_go(
    facts: pf.ModelFacts, config: RunConfig
) -> None:
    """A --max-num-seqs below the seed's (vLLM's default 256) shrinks the profile's dummy
    sampler buffers in proportion; the plan reports the KV it may free as an upper bound and
    keeps the GO capacity where the seed's calibration puts it."""
    kw: dict[str, Any] = dict(
        tp=4, mem_per_card_gib=32, gpu_memory_utilization=0.9,
        max_num_batched_tokens=8192, max_model_len=262_144,
    )  # fmt: skip
    base = pf.memory_plan(facts, **kw)
    assert base.sampler_saving_gib == 0 and base.kv_capacity_tokens_upper is None
    assert pf.memory_plan(facts, max_num_seqs=256, **kw).kv_capacity_tokens_upper is None
    small = pf.memory_plan(facts, max_num_seqs=16, **kw)
    tiny = pf.memory_plan(facts, max_num_seqs=1, **kw)
    assert small.kv_capacity_tokens == base.kv_capacity_tokens  # GO is unchanged
    per_seq_gib = pf.SAMPLER_MIB_PER_SEQ_PER_VOCAB * facts.vocab_size / 1024
    assert small.sampler_saving_gib == pytest.approx(per_seq_gib * 240)
    assert tiny.sampler_saving_gib > small.sampler_saving_gib
    assert base.kv_capacity_tokens < small.kv_capacity_tokens_upper < tiny.kv_capacity_tokens_upper
    # The shipped launch sets it: at most what the platform drives, at least the checks' n = 2.
    seqs = int(pf.get_flag(config.command, "--max-num-seqs") or 256)
    assert 2 <= seqs < 256
    check = pf.check_memory(pf.memory_plan(facts, max_num_seqs=seqs, **kw))
    assert check.status == pf.GO and f"--max-num-seqs {seqs} may free" in check.detail


@pytest.mark.parametrize(
    ("size", "status", "tokens"),
    [(None, pf.GO, None), ("128", pf.GO, "838,464"), ("32", pf.WARN, "209,616")],
)
def test_kv_offload_row_says_what_the_tier_holds(
    facts: pf.ModelFacts, config: RunConfig, size: str | None, status: str, tokens: str | None
) -> None:
    """The CPU tier's chunk is all four KV cache groups' pages of a block (20.6 MiB per rank at
    TP4, what vLLM's CPU offloading spec allocates): 128 GiB hold 1,588 blocks per rank; a tier
    no larger than the GPU pool adds no hits (worklogs/cache_sim.py) and is a warning."""
    run = RunConfig(config.concurrency, set_flag(config.command, "--kv-offloading-size", size),
                    config.env)  # fmt: skip
    check = pf.check_kv_offload(run, 4, pf.kv_layout(facts, 4, checkpoint_blocks=1), 278_784)
    assert check.status == status, check
    if tokens is None:
        assert check.detail.startswith("off"), check
    else:
        assert f"= {tokens} tokens per rank" in check.detail, check
