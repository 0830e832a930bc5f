"""worklogs/cache_sim.py --engine v0 predicts the replay's cache hit on the platform line with its
own model of vLLM 0.6.3's prefix-caching block allocator (no tensors, fast enough for 881 long
prompts). That model must grant the same cached prefix as vLLM 0.6.3's BlockSpaceManagerV2 does
on the same request stream, evictions included, and the checkpoint rule must take a hit only
where a GDN checkpoint exists at a cached boundary.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("cache_sim", REPO / "worklogs" / "cache_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cache_sim"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _stream(seed: int, n: int) -> list[np.ndarray]:
    """Agent-like prompts: a few shared system prefixes, sessions whose turns extend the last
    prompt, some repeats; lengths not multiples of the block size."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if sessions and r < 0.5:
            s = rng.choice(sessions)
            s.extend(rng.randrange(1000) for _ in range(rng.randrange(5, 60)))
            prompt = list(s)
        elif sessions and r < 0.6:
            prompt = list(rng.choice(sessions))
        else:
            s = list(rng.choice(systems)) + [
                rng.randrange(1000) for _ in range(rng.randrange(5, 80))
            ]
            sessions.append(s)
            prompt = list(s)
        out.append(np.asarray(prompt, dtype=np.int32))
    return out


@pytest.mark.parametrize(("seed", "blocks"), [(0, 48), (1, 96), (2, 400)])
def test_granted_prefix_matches_block_manager_v2(sim, seed: int, blocks: int) -> None:
    from vllm.core.block_manager_v2 import BlockSpaceManagerV2
    from vllm.core.interfaces import AllocStatus
    from vllm.inputs import LLMInputs
    from vllm.sequence import Sequence, SequenceGroup

    bs = 16
    manager = BlockSpaceManagerV2(block_size=bs, num_gpu_blocks=blocks, num_cpu_blocks=0,
                                  watermark=0.01, enable_caching=True)  # fmt: skip
    ours = sim.V0BlockPool(blocks, bs)
    refused = granted = 0
    for i, ids in enumerate(_stream(seed, 80)):
        seq = Sequence(i, LLMInputs(prompt_token_ids=ids.tolist()), block_size=bs)
        group = SequenceGroup(str(i), [seq], arrival_time=float(i))
        never = manager.can_allocate(group) == AllocStatus.NEVER
        assert never is (blocks - sim.cdiv(len(ids), bs) < int(0.01 * blocks))
        if never:
            refused += 1
            continue
        manager.allocate(group)
        theirs = len(manager.get_common_computed_block_ids([seq]))
        manager.access_all_blocks_in_seq(seq, float(i))
        manager.mark_blocks_as_computed(group, token_chunk_size=len(ids))
        manager.free(seq)
        hashes = sim.v0_block_hashes(ids, bs)
        leading = ours.allocate(hashes, len(ids) % bs != 0, now=i)
        ours.release(hashes, len(ids) % bs != 0, now=i)
        mine = min(leading, sim.cdiv(len(ids), bs) - 1)
        assert mine == theirs, (i, len(ids), mine, theirs)
        granted += theirs
    assert granted > 0  # the stream does reuse prefixes
    assert ours.evictions > 0 or blocks == 400


def test_hit_needs_a_checkpoint_at_a_cached_boundary(sim) -> None:
    """A repeated prompt resumes at its last full block (checkpoint saved there by the first);
    with no checkpoint pool nothing is taken however much KV is cached."""
    ids = np.arange(100, dtype=np.int32)  # 6 full blocks + 4 tokens
    assert sim.v0_save_boundaries(ids, 16, -1, 0, "engine") == [96]
    aligned = np.arange(96, dtype=np.int32)  # ends on a boundary: one block before it too
    assert sim.v0_save_boundaries(aligned, 16, -1, 0, "engine") == [96, 80]
    sys_end = np.concatenate([np.arange(40), [999], np.arange(60)]).astype(np.int32)
    assert sim.v0_save_boundaries(sys_end, 16, 999, 0, "engine") == [96, 32]
    assert sim.v0_save_boundaries(sys_end, 16, 999, 64, "junctions") == [96, 32, 64]
