"""Patch 0012: `--kv-offloading-size` is fitted to the host (or turned off) before vLLM builds its
offloading connector, and the CPU tier it gives serves prefixes the GPU pool has evicted."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_overrides.engines.v1_0_32 import kv_offload_fit as kof

GIB = kof.GIB
REPO = Path(__file__).resolve().parents[2]
ROOMY = kof.HostFacts(True, True, shm_free=500 * GIB, mem_available=900 * GIB, cgroup_free=None)


def _host(**kw: object) -> kof.HostFacts:
    return kof.HostFacts(**{**ROOMY.__dict__, **kw})


@pytest.mark.parametrize(
    ("host", "env", "want"),
    [
        (ROOMY, {}, 128.0),
        (ROOMY, {"KV_OFFLOAD": "0"}, None),
        (_host(cuda_like=False), {}, None),  # the CPU backend
        (_host(has_copy_op=False), {}, None),  # a build without the batched block copy
        (_host(shm_free=64 << 20), {}, None),  # Docker's default /dev/shm: 64 MiB
        (_host(shm_free=50 * GIB), {}, 48.0),  # less the 2 GiB reserve
        (_host(shm_free=50 * GIB + GIB // 2), {}, 48.0),  # whole GiB
        (_host(mem_available=100 * GIB), {}, 76.0),  # less the 24 GiB reserve
        (_host(cgroup_free=60 * GIB), {}, 36.0),  # the container's limit binds first
        (_host(shm_free=None, mem_available=None), {}, 128.0),  # nothing known: as asked
        (_host(cgroup_free=27 * GIB), {}, None),  # 3 GiB left: below the 4 GiB minimum
    ],
)
def test_fit(host: kof.HostFacts, env: dict[str, str], want: float | None) -> None:
    gib, why = kof.fit(128.0, host, env)
    assert gib == want, why
    assert why


def test_cgroup_limits(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert kof._cgroup_free(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{64 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{10 * GIB}\n")
    assert kof._cgroup_free(tmp_path) == 54 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5\n")
    assert kof._cgroup_free(v1) is None
    assert kof._cgroup_free(tmp_path / "absent") is None


def _vllm_config(size: float | None):  # noqa: ANN202 -- vLLM's VllmConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    if not (REPO / "build" / "tiny-model" / "config.json").exists():
        pytest.skip("tiny model not built (make model)")
    return VllmConfig(
        model_config=ModelConfig(model=str(REPO / "build" / "tiny-model"), max_model_len=4096),
        cache_config=CacheConfig(kv_offloading_size=size),
    )


def test_patched_vllm_turns_the_tier_off_on_this_cpu() -> None:
    """The deployed vLLM calls the hook: on the CPU backend the tier is off and no connector is
    configured (without patch 0012 vLLM would configure one its CPU workers cannot run)."""
    cfg = _vllm_config(8.0)
    assert cfg.cache_config.kv_offloading_size is None
    assert cfg.kv_transfer_config is None


def test_patched_vllm_configures_the_fitted_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kof, "host_facts", lambda: _host(shm_free=12 * GIB))
    cfg = _vllm_config(128.0)
    assert cfg.cache_config.kv_offloading_size == 10.0
    kvt = cfg.kv_transfer_config
    assert kvt is not None and kvt.kv_connector == "OffloadingConnector"
    assert kvt.kv_connector_extra_config["cpu_bytes_to_use"] == 10 * GIB


def test_cpu_tier_serves_a_prefix_the_gpu_pool_evicted() -> None:
    """vLLM's scheduler with its OffloadingConnector (cache_sim, tiny-model layout, a 26K-token
    GPU pool): session s0's 12K-token prompt is evicted by s1's 24K one; s0's next turn finds it
    again only in the CPU tier."""
    if not (REPO / "build" / "tiny-model" / "config.json").exists():
        pytest.skip("tiny model not built (make model)")
    sys.path.insert(0, str(REPO / "worklogs"))
    import cache_sim

    rng = np.random.default_rng(1)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1000, 100000, n)]

    a, b = toks(12000), toks(24000)
    reqs = [
        {"id": "a", "meta": {"session_id": "s0"}, "ids": np.array(a)},
        {"id": "b", "meta": {"session_id": "s1"}, "ids": np.array(b)},
        {"id": "a2", "meta": {"session_id": "s0"}, "ids": np.array(a + toks(500))},
    ]
    cached = {}
    for gib in (0.0, 1.0):
        sim = cache_sim.SimConfig(8192, 0.05, None, True, 0, 1, 2, "tiny-cpu", gib)
        out = cache_sim.simulate(sim, reqs, [0, 0, 12000])
        cached[gib] = [r["cached_tokens"] for r in out["records"]]
    assert cached[0.0] == [0, 0, 0], cached  # the pool alone has lost it
    # 46 blocks of 256 (the prompt's last full block) from the tier.
    assert cached[1.0] == [0, 0, 11776], cached
