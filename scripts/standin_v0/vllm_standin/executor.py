"""Executors that run :class:`vllm_standin.worker.StandinWorker` (the card's worker on CPU).

vLLM 0.6.3 sends device "cpu" to its ``CPUExecutor``, which turns chunked prefill and prefix
caching off and runs ``CPUModelRunner`` (no request ids for models with inner state). The
stand-in's edit in ``LLMEngine._get_executor_cls`` / ``AsyncLLMEngine._get_executor_cls``
(``repack_vllm.py``) asks :func:`standin_executor_class` instead: the card's executors
(``GPUExecutor``, ``MultiprocessingGPUExecutor`` for TP > 1), with only the worker class and
the CUDA device count check replaced. ``VLLM_STANDIN_EXECUTOR=0`` keeps upstream's CPU
executor (to compare with it).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import vllm.triton_utils
from vllm.config import EngineConfig, ModelConfig, SchedulerConfig
from vllm.executor.executor_base import ExecutorBase
from vllm.executor.gpu_executor import GPUExecutor, GPUExecutorAsync
from vllm.logger import init_logger
from vllm.worker.worker_base import WorkerBase

if not hasattr(vllm.triton_utils, "maybe_set_triton_cache_manager"):
    # Upstream 0.6.3's multiproc_gpu_executor imports this name unconditionally, but
    # triton_utils defines it only where Triton is installed, so without Triton (the card's
    # case, and the stand-in's) TP > 1 cannot even import. It only points Triton's kernel
    # cache at a per-process directory; with no Triton there is nothing to point.
    vllm.triton_utils.maybe_set_triton_cache_manager = lambda: None  # type: ignore[attr-defined]

from vllm.executor.multiproc_gpu_executor import (  # noqa: E402 (needs the name above)
    MultiprocessingGPUExecutor,
    MultiprocessingGPUExecutorAsync,
)

logger = init_logger(__name__)
WORKER = ("vllm_standin.worker", "StandinWorker")


class _StandinWorkerMixin:
    """Every stand-in executor builds ``StandinWorker`` where the card builds ``Worker``."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    speculative_config: object

    def _init_executor(self) -> None:
        if not self.model_config.enforce_eager:
            # The card's vLLM hard-codes enforce_eager (shared/PLATFORM.md); a CPU has no CUDA
            # graphs to capture either. Same outcome as on the card, said out loud.
            logger.warning("stand-in: enforce_eager forced on, as the card's vLLM does")
            self.model_config.enforce_eager = True
        super()._init_executor()  # type: ignore[misc]

    def _get_worker_module_and_class(
        self,
    ) -> tuple[str, str, Callable[[], type[WorkerBase]] | None]:
        # Multi-step and speculative decoding build other worker classes around Worker; the
        # platform uses neither, so the stand-in refuses them rather than run them half-way.
        if self.scheduler_config.is_multi_step or self.speculative_config:
            raise NotImplementedError(
                "the stand-in runs the plain Worker only "
                "(no multi-step scheduling, no speculative decoding)"
            )
        return WORKER[0], WORKER[1], None


class StandinExecutor(_StandinWorkerMixin, GPUExecutor):
    pass


class StandinExecutorAsync(_StandinWorkerMixin, GPUExecutorAsync):
    pass


class _NoCudaCountMixin:
    def _check_executor_parameters(self) -> None:
        # Upstream checks TP <= the CUDA device count and sets CUDA_VISIBLE_DEVICES; the
        # stand-in's ranks are CPU processes, as many as asked for.
        return None


class StandinMPExecutor(_StandinWorkerMixin, _NoCudaCountMixin, MultiprocessingGPUExecutor):
    pass


class StandinMPExecutorAsync(
    _StandinWorkerMixin, _NoCudaCountMixin, MultiprocessingGPUExecutorAsync
):
    pass


def standin_executor_class(engine_config: EngineConfig, is_async: bool) -> type[ExecutorBase]:
    """The executor class for device "cpu" on the stand-in."""
    if os.environ.get("VLLM_STANDIN_EXECUTOR", "1") == "0":
        if is_async:
            from vllm.executor.cpu_executor import CPUExecutorAsync

            return CPUExecutorAsync
        from vllm.executor.cpu_executor import CPUExecutor

        return CPUExecutor
    parallel = engine_config.parallel_config
    backend = parallel.distributed_executor_backend
    if backend not in (None, "mp"):
        raise ValueError(f"the stand-in runs TP ranks as processes ('mp'), not {backend!r}")
    if parallel.world_size > 1 or backend == "mp":
        return StandinMPExecutorAsync if is_async else StandinMPExecutor
    return StandinExecutorAsync if is_async else StandinExecutor
