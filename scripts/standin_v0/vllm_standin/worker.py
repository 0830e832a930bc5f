"""``StandinWorker``: vLLM 0.6.3's GPU ``Worker`` with its device set to the CPU.

Everything the card's worker runs stays as it is (``ModelRunner``'s input preparation, the
attention metadata builders, chunked prefill, prefix caching, ``request_ids_to_seq_ids`` /
``finished_requests_ids`` for models with inner state, the profiling forward, the cache
engine). Only what needs a CUDA device is replaced:

- ``init_device``: no ``torch.cuda.set_device`` / ``mem_get_info``; the process group is gloo
  (vLLM's own ``init_distributed_environment``), and all-reduce / gather of CPU tensors work
  over gloo (:func:`_collectives_on_gloo`), so tensor parallel runs across CPU processes.
- ``determine_num_available_blocks``: still runs the profiling forward, but sizes the KV cache
  from ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1) instead of profiling device memory.
- ``load_model``: vLLM's ``DeviceMemoryProfiler`` reads CUDA/XPU counters only (on the CPU
  platform it fails with an unbound local); it is measured as process RSS instead.
- torch's CPU threads: ``VLLM_STANDIN_TORCH_THREADS`` (default 1), see :func:`torch_threads`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
import torch
import vllm.envs as envs
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.parallel_state import (
    GroupCoordinator,
    get_pp_group,
    get_tp_group,
    get_world_group,
    set_custom_all_reduce,
)
from vllm.logger import init_logger
from vllm.model_executor import set_random_seed
from vllm.utils import GiB_bytes
from vllm.worker import model_runner as _model_runner
from vllm.worker.worker import Worker

from vllm_standin import ops

logger = init_logger(__name__)

# The stand-in's ops must exist wherever a worker builds a model (each TP rank's process).
ops.register()

DEFAULT_KV_GIB = 1
DEFAULT_TORCH_THREADS = 1


def torch_threads() -> int:
    """How many intra-op threads the worker's torch uses (``VLLM_STANDIN_TORCH_THREADS``).

    On the card the model runs on the device and these threads only launch kernels. Here they
    compute, and torch's default (one per core) cost a decode step of the tiny model 376 ms
    instead of 37 ms on the two-core machine with other processes busy (the API server, the
    test client, other work): each of a step's ~1,000 small ops opens an OpenMP region whose
    spinning threads wait for one that the kernel has descheduled (~10 ms per op; a
    (1x128)x(128x512) linear: 10.4 ms with 2 threads, 0.010 ms with 1). One thread loses at
    most the second core's share of a large prefill on an idle machine.
    """
    raw = os.environ.get("VLLM_STANDIN_TORCH_THREADS", str(DEFAULT_TORCH_THREADS))
    try:
        threads = int(raw)
    except ValueError as exc:
        raise ValueError(f"VLLM_STANDIN_TORCH_THREADS must be an integer, got {raw!r}") from exc
    if threads < 1:
        raise ValueError(f"VLLM_STANDIN_TORCH_THREADS must be >= 1, got {threads}")
    return threads


def kv_cache_bytes() -> int:
    """The stand-in's KV cache budget: ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 when unset or 0."""
    gib = envs.VLLM_CPU_KVCACHE_SPACE
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be >= 0 GiB, got {gib}")
    return (gib or DEFAULT_KV_GIB) * GiB_bytes


class _RssProfiler:
    """``DeviceMemoryProfiler``'s interface, measured as this process's resident memory."""

    def __init__(self, device: object = None) -> None:
        self.consumed_memory = 0

    def __enter__(self) -> _RssProfiler:
        self._start = psutil.Process().memory_info().rss
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumed_memory = psutil.Process().memory_info().rss - self._start


@contextlib.contextmanager
def _no_cuda_synchronize() -> Iterator[None]:
    """``profile_run`` ends with ``torch.cuda.synchronize()``; with no CUDA device there is
    no queued device work to wait for, and the call would raise "no NVIDIA driver"."""
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _collectives_on_gloo(group: GroupCoordinator) -> None:
    """Make two of vLLM 0.6.3's collectives work on CPU tensors over gloo (this group only).

    - all-reduce: upstream's ``_all_reduce_in_place`` sends a CPU tensor to Intel's IPEX, which
      is neither on the card nor here; on the card the tensor is on the device and goes to
      (ixformer's) NCCL. Here it goes to ``torch.distributed`` on the group's gloo device group,
      as upstream does for any non-CPU tensor without pynccl.
    - gather (the logits of a vocab-parallel LM head): upstream allocates the receive buffers
      under the worker's ``inference_mode``; gloo fills them from its own thread, outside
      inference mode, and torch 2.1 refuses the in-place write to an inference tensor. The same
      gather with ordinary receive buffers.
    """

    def all_reduce_in_place(input_: torch.Tensor) -> None:
        torch.distributed.all_reduce(input_, group=group.device_group)

    def gather(input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        if group.world_size == 1:
            return input_
        dim = dim % input_.dim()
        parts = None
        if group.rank_in_group == dst:
            with torch.inference_mode(False):
                parts = [torch.empty_like(input_) for _ in range(group.world_size)]
        torch.distributed.gather(input_, parts, dst=group.ranks[dst], group=group.device_group)
        return None if parts is None else torch.cat(parts, dim=dim)

    group._all_reduce_in_place = all_reduce_in_place  # type: ignore[method-assign]
    group.gather = gather  # type: ignore[method-assign]


class StandinWorker(Worker):
    """The card's worker class, on ``torch.device("cpu")``."""

    def init_device(self) -> None:
        if self.device_config.device.type != "cpu":
            raise RuntimeError(f"StandinWorker runs on the CPU, got {self.device_config.device}")
        self.device = torch.device("cpu")
        self.init_gpu_memory = 0
        torch.set_num_threads(torch_threads())
        # No NCCL device here: without this, a TP group would build a PyNcclCommunicator from
        # the torch wheel's libnccl and fail on torch.cuda.device("cpu"). vLLM disables pynccl
        # when the library cannot load, as on any machine without NCCL; the all-reduces then
        # go through the gloo device group.
        os.environ["VLLM_NCCL_SO_PATH"] = "/nonexistent/vllm-standin-has-no-nccl.so"
        set_custom_all_reduce(False)
        pc = self.parallel_config
        init_distributed_environment(
            pc.world_size, self.rank, self.distributed_init_method, self.local_rank, backend="gloo"
        )
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        for group in (get_world_group(), get_tp_group(), get_pp_group()):
            _collectives_on_gloo(group)
        set_random_seed(self.model_config.seed)

    def load_model(self) -> None:
        original = _model_runner.DeviceMemoryProfiler
        _model_runner.DeviceMemoryProfiler = _RssProfiler  # type: ignore[misc,assignment]
        try:
            super().load_model()
        finally:
            _model_runner.DeviceMemoryProfiler = original  # type: ignore[misc]

    @torch.inference_mode()
    def determine_num_available_blocks(self) -> tuple[int, int]:
        # The card's profiling forward (max_num_batched_tokens of dummy prompts) still runs:
        # it is a code path of start-up, and models with inner state see it too.
        with _no_cuda_synchronize():
            self.model_runner.profile_run()
        block_bytes = self.get_cache_block_size_bytes()
        if block_bytes == 0:  # attention-free model
            return 0, 0
        num_gpu_blocks = kv_cache_bytes() // block_bytes
        num_cpu_blocks = int(self.cache_config.swap_space_bytes // block_bytes)
        logger.info(
            "stand-in KV cache: %d blocks of %d bytes (VLLM_CPU_KVCACHE_SPACE), %d swap blocks",
            num_gpu_blocks,
            block_bytes,
            num_cpu_blocks,
        )
        return num_gpu_blocks, num_cpu_blocks
