"""Cached-token counting on V0 (engines/v0/prefix_stats.py, patches 0012 / 0013): the runner's
skip rule, and vLLM 0.6.3's own scheduler and RequestOutput, patched (copies), on a repeated
prompt."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engines.v0.api_fakes import patched_module
from vllm_overrides.engines.v0.prefix_stats import skipped_tokens

REPO = Path(__file__).resolve().parents[3]
PATCHES = REPO / "patches" / "vllm-0.6.3"


@pytest.mark.parametrize(
    ("prefix", "context", "chunk", "skipped"),
    [
        (0, 0, 17, 0),  # nothing cached
        (16, 0, 17, 16),  # the cached prefix ends inside the chunk
        (16, 0, 8, 7),  # covers the whole chunk: only its last token is computed
        (16, 8, 8, 7),
        (16, 16, 1, 0),  # past the cached region
        (32, 0, 17, 16),
    ],
)
def test_the_runner_rule(prefix, context, chunk, skipped) -> None:
    assert skipped_tokens(prefix, context, chunk) == skipped


def test_a_repeated_prompt_reports_its_cached_blocks(tmp_path: Path) -> None:
    pytest.importorskip("vllm.core.scheduler")
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import Sequence, SequenceGroup

    scheduler_mod = patched_module(
        "0012-scheduler-count-prefix-cache-hits.patch", "vo_patched_scheduler"
    )
    outputs_mod = patched_module("0013-request-output-cached-tokens.patch", "vo_patched_outputs")
    block = 4
    cache = CacheConfig(block_size=block, gpu_memory_utilization=1.0, swap_space=0,
                        cache_dtype="auto", enable_prefix_caching=True)  # fmt: skip
    cache.num_gpu_blocks, cache.num_cpu_blocks = 64, 8
    scheduler = scheduler_mod.Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256,
                        use_v2_block_manager=True),
        cache, None,
    )  # fmt: skip
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks and one partial

    def group(i: int) -> SequenceGroup:
        seq = Sequence(i, {"prompt_token_ids": prompt, "prompt": None}, block)
        return SequenceGroup(
            f"r{i}", [seq], time.time(), sampling_params=SamplingParams(max_tokens=4)
        )

    first, second = group(1), group(2)
    scheduler.add_seq_group(first)
    scheduler.schedule()
    first.update_num_computed_tokens(len(prompt))  # what the engine does after the step
    scheduler.add_seq_group(second)
    scheduler.schedule()
    assert outputs_mod.RequestOutput.from_seq_group(first, False).num_cached_tokens == 0
    assert outputs_mod.RequestOutput.from_seq_group(second, False).num_cached_tokens == 4 * block
