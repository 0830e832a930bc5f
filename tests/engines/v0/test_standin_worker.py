"""The stand-in worker's torch threads (``vllm_standin.worker.torch_threads``).

Two OpenMP threads on the shared two-core machine made each small op of a decode step wait for
a descheduled thread: 376 ms a step of the tiny model instead of 37 ms (see the function's doc).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_standin")

from vllm_standin import worker  # noqa: E402


def test_one_thread_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_STANDIN_TORCH_THREADS", raising=False)
    assert worker.torch_threads() == 1


def test_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_STANDIN_TORCH_THREADS", "2")
    assert worker.torch_threads() == 2


@pytest.mark.parametrize("raw", ["0", "-1", "two", ""])
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("VLLM_STANDIN_TORCH_THREADS", raw)
    with pytest.raises(ValueError, match="VLLM_STANDIN_TORCH_THREADS"):
        worker.torch_threads()


def test_init_device_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_device`` sets torch's thread count before the model is built (the rest of it,
    process groups on gloo, is covered by the engine tests)."""
    monkeypatch.setenv("VLLM_STANDIN_TORCH_THREADS", "1")
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "")  # init_device overwrites it; restored after
    before = torch.get_num_threads()
    calls: list[int] = []

    class Stop(Exception):
        pass

    def fake_init(*args: object, **kwargs: object) -> None:
        calls.append(torch.get_num_threads())
        raise Stop

    monkeypatch.setattr(worker, "init_distributed_environment", fake_init)
    self = worker.StandinWorker.__new__(worker.StandinWorker)
    self.device_config = type("D", (), {"device": torch.device("cpu")})()
    self.parallel_config = type("P", (), {"world_size": 1})()
    self.rank = self.local_rank = 0
    self.distributed_init_method = "tcp://127.0.0.1:1"
    try:
        torch.set_num_threads(2)
        with pytest.raises(Stop):
            self.init_device()
        assert calls == [1]
    finally:
        torch.set_num_threads(before)
