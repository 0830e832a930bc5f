"""computility-run.yaml: the platform's schema, vLLM 0.32.0's own parser, the local overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_overrides.launcher import (
    DEFAULT_CONFIG,
    REPO_DIR,
    build_launch,
    get_flag,
    load_run_config,
    server_args,
)


@pytest.fixture(scope="module")
def config():
    return load_run_config(DEFAULT_CONFIG)


def parse_with_vllm(args: list[str], validate: bool = True):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    if validate:  # also checks that files it names (the chat template) exist
        validate_parsed_serve_args(parsed)
    return parsed


def test_yaml_schema_and_the_platform_settings(config) -> None:
    assert config.concurrency >= 1
    assert config.command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert all(isinstance(v, str) for v in config.env.values())
    assert config.env == {
        "PROF_TRACE": "0", "PROF_MOE_SUMMARY": "0", "MOE_NATIVE": "1", "MOE_DECODE_NATIVE": "0",
        "GDN_NATIVE": "1", "RMSNORM_NATIVE": "1", "QK_NORM_ROPE_NATIVE": "1", "GEMV_NATIVE": "1",
        "VISION_ROPE_NATIVE": "1", "NATIVE_KERNELS": "auto", "GDN_CHUNK_KERNEL": "fused",
    }  # fmt: skip
    assert b"\r" not in DEFAULT_CONFIG.read_bytes()


def test_launch_profile_needs_no_triton(config) -> None:
    """The target has no Triton: eager (no Inductor, no CUDA graphs), and every layer kind that
    upstream runs on Triton kernels (GDN, MoE, attention's fused q/k norm + RoPE, the vision
    tower's RoPE) on our native paths."""
    args = parse_with_vllm(server_args(config.command), validate=False)
    assert args.enforce_eager is True
    # MRoPE: upstream's CUDA forward is a Triton kernel; the custom op off means forward_native.
    assert "-rotary_embedding" in args.compilation_config.custom_ops
    assert config.env["GDN_NATIVE"] == "1" and config.env["MOE_NATIVE"] == "1"
    assert config.env["QK_NORM_ROPE_NATIVE"] == "1" and config.env["VISION_ROPE_NATIVE"] == "1"
    assert config.env["NATIVE_KERNELS"] in ("auto", "cuda")


def test_vllm_parser_accepts_every_flag(config) -> None:
    # /workspace exists only in the image; the override test below validates the full set.
    args = parse_with_vllm(server_args(config.command), validate=False)
    assert args.model == "/model"
    assert args.served_model_name == ["llm"]
    assert args.tensor_parallel_size == 4
    assert args.max_model_len == 262144
    assert args.chat_template == "/workspace/chat_template_multi_system.jinja"
    assert args.enable_prefix_caching is True
    assert args.enable_chunked_prefill is True
    assert args.max_num_batched_tokens == 8192  # make preflight GO (issue 13)
    assert args.tool_call_parser == "qwen3_coder"
    assert args.enable_auto_tool_choice is True
    assert args.reasoning_parser == "qwen3"
    assert args.enable_prompt_tokens_details is True
    assert args.gpu_memory_utilization == 0.9
    assert args.dtype == "float16"
    assert not args.api_key  # documented: keys are off on the platform


def test_local_overrides_change_only_what_they_name(config) -> None:
    argv, env = build_launch(
        config, model="/tmp/m", tp=1, max_model_len=4096, port=9000, host="127.0.0.1",
        cpu=True, workspace=REPO_DIR, python="/venv/python", base_env={},
    )  # fmt: skip
    assert argv[0] == "/venv/python"
    assert get_flag(argv, "--model") == "/tmp/m"
    assert get_flag(argv, "-tp") == "1" and "-tp" not in argv
    assert get_flag(argv, "--max-model-len") == "4096"
    assert get_flag(argv, "--port") == "9000"
    assert get_flag(argv, "--dtype") == "bfloat16"
    template = get_flag(argv, "--chat-template")
    assert template == str(REPO_DIR / "chat_template_multi_system.jinja")
    untouched = ["--tool-call-parser", "--reasoning-parser", "--max-num-batched-tokens"]
    for flag in untouched:
        assert get_flag(argv, flag) == get_flag(config.command, flag)
    assert env["MOE_NATIVE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    parse_with_vllm(server_args(argv))


def test_caller_environment_wins_over_the_file(config) -> None:
    _, env = build_launch(
        config, cpu=True, base_env={"MOE_NATIVE": "0", "VLLM_CPU_KVCACHE_SPACE": "9"}
    )
    assert env["MOE_NATIVE"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "9"
    assert env["PROF_TRACE"] == "0"


def test_print_mode_emits_the_launch(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_overrides.launcher", "--cpu", "--port", "8123", "--print"],
        capture_output=True, text=True, cwd=REPO_DIR, check=True,
    )  # fmt: skip
    launch = json.loads(out.stdout)
    assert get_flag(launch["argv"], "--port") == "8123"
    assert launch["env"]["PROF_MOE_SUMMARY"] == "0"


def test_bad_yaml_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text("concurrency: 1\ncommand: [python3]\nenv:\n  - name: X\n    value: 1\n")
    with pytest.raises(ValueError, match="must be a string"):
        load_run_config(bad)


def test_cpu_runs_one_process_unless_told(config) -> None:
    argv, _ = build_launch(config, cpu=True, base_env={})
    assert get_flag(argv, "--tensor-parallel-size") == "1"
    argv, _ = build_launch(config, base_env={})
    assert get_flag(argv, "-tp") == "4"  # the platform's value when not on CPU


def test_mrope_runs_its_pytorch_forward_under_the_yaml(config) -> None:
    """Eager vLLM enables every custom op, and MRoPE's CUDA forward is a Triton kernel: the
    YAML's compilation config must switch that op off (forward_native), and does."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    ):
        assert MRotaryEmbedding.enabled()  # what the flag is there for
    args = parse_with_vllm(server_args(config.command), validate=False)
    with set_current_vllm_config(VllmConfig(compilation_config=args.compilation_config)):
        assert not MRotaryEmbedding.enabled()
