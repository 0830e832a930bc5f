"""Fit `--kv-offloading-size` to the host the server starts on (patch 0012).

Why: the prefix-cache hit on the platform's agent replay is bound by how many tokens the cache
holds (worklogs/LEDGER.md, issue 13: 35 % with the GPU pool alone, 61 % with a 128 GiB CPU tier,
by vLLM's own scheduler in `worklogs/cache_sim.py`), and vLLM 0.32.0's native offloading tier is
the switch that adds capacity. That tier is one file in `/dev/shm` of the whole size, written
through pinned-host copies that only CUDA-like devices do. vLLM refuses to start when `/dev/shm`
cannot hold the file, and the host's memory is not known when the launch file is written. So the
flag is a request: here it shrinks to what the host can hold, or turns off, with one log line
each time, and the server always starts.

Rules (every size is the whole tier, all tensor-parallel ranks together, as vLLM takes it):

* ``KV_OFFLOAD=0`` turns the tier off;
* off where the device is not CUDA-like or vLLM's build lacks the batched block copy
  (``_C_cache_ops.swap_blocks_batch``): the CPU backend, any build that cannot run its worker;
* at most what ``/dev/shm`` has free less ``SHM_RESERVE`` (vLLM's own IPC buffers live there) and
  what the memory headroom (``MemAvailable``, and the cgroup's limit less its usage, whichever is
  smaller) leaves after ``HOST_RESERVE`` for the server's processes;
* off below ``MIN_GIB``: a smaller tier costs a pre-faulted region and PCIe traffic for
  practically no hits.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger("vllm.vllm_overrides.kv_offload_fit")  # under vLLM's handlers

GIB = 1 << 30
SHM_PATH = "/dev/shm"
SHM_RESERVE = 2 * GIB
HOST_RESERVE = 24 * GIB
MIN_GIB = 4.0


@dataclass(frozen=True)
class HostFacts:
    """What decides the tier's size, read once at start-up."""

    cuda_like: bool
    has_copy_op: bool
    shm_free: int | None  # bytes; None: no /dev/shm (vLLM then skips its own check)
    mem_available: int | None  # bytes, the kernel's MemAvailable (psutil)
    cgroup_free: int | None  # bytes, limit - usage; None: no limit


def _cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory cgroup's limit less its usage (v2, else v1); None without a limit."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (root / limit_file).read_text(encoding="ascii").strip()
            usage = int((root / usage_file).read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            continue
        # v1 writes a page-rounded 2^63 when unlimited.
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(int(limit) - usage, 0)
    return None


def host_facts() -> HostFacts:
    try:
        from vllm.platforms import current_platform

        cuda_like = bool(current_platform.is_cuda_alike())
    except Exception:  # noqa: BLE001 -- no platform: no device tier
        cuda_like = False
    has_copy_op = False
    if cuda_like:
        try:
            import torch
            import vllm._custom_ops  # noqa: F401 -- loads the _C libraries

            has_copy_op = hasattr(torch.ops._C_cache_ops, "swap_blocks_batch")
        except Exception:  # noqa: BLE001
            has_copy_op = False
    shm_free = shutil.disk_usage(SHM_PATH).free if os.path.isdir(SHM_PATH) else None
    mem_available = psutil.virtual_memory().available  # the kernel's MemAvailable
    return HostFacts(cuda_like, has_copy_op, shm_free, mem_available, _cgroup_free())


def fit(
    requested_gib: float, host: HostFacts, env: dict[str, str] | None = None
) -> tuple[float | None, str]:
    """The tier size to use (GiB, None: off) and why."""
    env = os.environ if env is None else env
    if env.get("KV_OFFLOAD", "1").strip() == "0":
        return None, "KV_OFFLOAD=0"
    if not host.cuda_like:
        return None, "the device is not CUDA-like (the tier's copies need one)"
    if not host.has_copy_op:
        return None, "this vLLM build has no _C_cache_ops.swap_blocks_batch"
    limits = {"requested": requested_gib * GIB}
    if host.shm_free is not None:
        limits[f"{SHM_PATH} free - reserve"] = host.shm_free - SHM_RESERVE
    headroom = [x for x in (host.mem_available, host.cgroup_free) if x is not None]
    if headroom:
        limits["host memory headroom - reserve"] = min(headroom) - HOST_RESERVE
    bound, size = min(limits.items(), key=lambda kv: kv[1])
    gib = max(size, 0) / GIB
    detail = ", ".join(f"{k} {max(v, 0) / GIB:.1f}" for k, v in limits.items())
    if gib < MIN_GIB:
        return None, f"only {gib:.1f} GiB fits, below {MIN_GIB:g} ({detail} GiB)"
    gib = float(int(gib))  # whole GiB: a stable size across restarts
    if bound == "requested":
        return gib, f"as requested ({detail} GiB)"
    return gib, f"limited by {bound} ({detail} GiB)"


def fit_cache_config(cache_config: Any, host: HostFacts | None = None) -> None:
    """Patch 0012's hook: rewrite ``cache_config.kv_offloading_size`` to what fits here."""
    requested = cache_config.kv_offloading_size
    if requested is None:
        return
    gib, why = fit(float(requested), host or host_facts())
    cache_config.kv_offloading_size = gib
    if gib is None:
        logger.warning("vllm_overrides: KV offloading off (requested %s GiB): %s", requested, why)
    else:
        logger.info("vllm_overrides: KV offloading %.0f GiB: %s", gib, why)
