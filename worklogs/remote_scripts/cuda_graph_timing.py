"""GPU time of a call by CUDA-graph replay, shared by the probes (not a script of its own).

Imported as ``from cuda_graph_timing import graph_replay_ms``: the probes in this folder find it
as their own folder (``sys.path[0]`` of ``python3 worklogs/remote_scripts/<probe>.py``);
``worklogs/gather_probe.py`` adds this folder to ``sys.path`` first.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_replay_ms(
    fn: Callable[[], object], *, rounds: int, replays: int = 1, calls: int = 1
) -> float:
    """ms per call of ``fn``: the median over ``rounds`` timed rounds, each ``replays``
    back-to-back replays of one CUDA graph that captured ``calls`` calls of ``fn``.

    Replay leaves the host's launch gaps out, so this is the GPU's time alone. Several calls per
    graph or several replays per round make a round long against the events' resolution.
    """
    # Warm up on a side stream, as capture requires (allocator, lazy init, autotuning).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    # The first replay can pay a one-time upload of the graph: keep it out of the timed rounds.
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (replays * calls))
    return statistics.median(times)
