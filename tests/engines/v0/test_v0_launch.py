"""computility-run.yaml, the platform's launch, read by vLLM 0.6.3's own parser (the V0 engine)."""

from __future__ import annotations

import pytest

from vllm_overrides import preflight
from vllm_overrides.launcher import (
    DEFAULT_CONFIG,
    PLATFORM_CONFIG,
    REPO_DIR,
    build_launch,
    get_flag,
    installed_vllm,
    load_run_config,
    server_args,
)


@pytest.fixture(scope="module")
def config():
    return load_run_config(PLATFORM_CONFIG)


def test_the_platform_yaml_is_the_default_on_v0() -> None:
    assert installed_vllm() == "0.6.3"
    assert DEFAULT_CONFIG == PLATFORM_CONFIG
    assert b"\r" not in PLATFORM_CONFIG.read_bytes()


def test_vllm_063_parser_accepts_and_validates_every_flag(config) -> None:
    check = preflight.check_vllm_parser(config)
    assert check.status == preflight.GO, check.detail


def test_the_platform_settings(config) -> None:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(server_args(config.command))
    assert config.concurrency == 1
    assert args.model == "/model" and args.served_model_name == ["llm"]
    assert args.tensor_parallel_size == 4
    assert args.max_model_len == 262144  # PLATFORM.md: a 131,072 context scored 0
    assert args.dtype == "half"  # bf16 on the card cut Output TPS P10 to 0.37
    assert args.enforce_eager is True
    assert args.enable_chunked_prefill is True and args.enable_prefix_caching is True
    assert args.tool_call_parser == "qwen3_coder" and args.enable_auto_tool_choice is True
    assert args.chat_template == "/workspace/chat_template_multi_system.jinja"
    assert args.gpu_memory_utilization < 0.95  # 0.95 ran out of memory at start-up
    assert config.env["ENABLE_CUSTOM_IPC"] == "1"
    # The engine's heartbeat outlasts a long prefill chunk (VLLM_RPC_TIMEOUT, ms).
    assert int(config.env["VLLM_RPC_TIMEOUT"]) >= 60000


def test_every_workspace_file_the_launch_names_is_in_the_image(config) -> None:
    """The tool-parser plugin and the template: repo files the Dockerfile copies to /workspace
    (a directory COPY puts its contents there)."""
    check = preflight.check_workspace_files(config, REPO_DIR / "Dockerfile")
    assert check.status == preflight.GO, check.detail
    assert "qwen3_coder_plugin.py" in check.detail


def test_a_flag_063_does_not_know_is_no_go(config) -> None:
    bad = type(config)(config.concurrency, config.command + ["--reasoning-parser", "qwen3"], {})
    check = preflight.check_vllm_parser(bad)
    assert check.status == preflight.NO_GO and "--reasoning-parser" in check.detail


def test_cpu_launch_runs_float32_on_one_rank(config) -> None:
    argv, env = build_launch(config, model="m", cpu=True, base_env={})
    assert get_flag(argv, "--dtype") == "float32"
    assert get_flag(argv, "--tensor-parallel-size") == "1"
    assert get_flag(argv, "--swap-space") == "1"  # host RAM on a CPU machine
    # /workspace paths resolve to this checkout where /workspace does not exist.
    assert get_flag(argv, "--chat-template") == str(REPO_DIR / "chat_template_multi_system.jinja")
    # Room for a 262,144-token prompt of the tiny model (4 KiB a token in float32) above V0's
    # 1 % watermark: with exactly 1 GiB such a prompt was never scheduled (200, no tokens).
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) * 2**30 >= 262_144 * 4096 * 1.02
    assert int(env["VLLM_RPC_TIMEOUT"]) > int(config.env["VLLM_RPC_TIMEOUT"])
