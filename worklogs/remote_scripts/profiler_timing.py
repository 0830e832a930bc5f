"""GPU time per kernel of a call by torch.profiler, shared by the probes (not a script of its own).

Imported as ``from profiler_timing import kernel_us``: the probes in this folder find it as their
own folder (``sys.path[0]`` of ``python3 worklogs/remote_scripts/<probe>.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch


def kernel_us(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Mean GPU time (us) per call of ``fn`` of each kernel it launches, by name (first 60
    characters), over ``reps`` profiled calls after 3 warm-up calls. Eager launches: the host's
    gaps between kernels are not counted, so the sum is the GPU's busy time of one call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name].append(e.device_time)
    return {n[:60]: sum(t) / reps for n, t in us.items()}
