#!/usr/bin/env python3
"""Host cost of one eager launch by the ways our Python can reach a CUDA kernel (issue 14).

The eager decode step is host-bound (LEDGER, "Fused decode kernels on the H200"): ~380 launches
take 8-14 ms on the device tool's host while the GPU is busy 3.3 ms. This probe times, with the
GPU idle enough that the host is the bottleneck, N back-to-back calls of:

* the same trivial kernel reached through a ``torch.ops`` operator (how ``kernels.py`` calls
  every fused op today), through its ``OpOverload`` (``.default``, one attribute lookup fewer),
  and through a plain pybind11 function of the same extension (no dispatcher);
* for scale: ``F.linear`` at decode shapes (cuBLAS), ``torch.empty``, an in-place ``add_``.

Each figure is the median over ``--rounds`` rounds of (wall time of N calls + one sync) / N.
Writes ``host_overhead_probe.json`` and a table to ``--out``. GPU only::

    python3 worklogs/remote_scripts/host_overhead_probe.py --out $OUT/host
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void probe_kernel(const at::BFloat16* x, at::BFloat16* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}

at::Tensor probe_launch(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16, "bf16 CUDA x");
  TORCH_CHECK(w.numel() == x.size(-1), "w");
  auto y = at::empty_like(x);
  const int n = static_cast<int>(x.numel());
  probe_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

TORCH_LIBRARY(vo_probe, m) { m.def("launch(Tensor x, Tensor w, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(vo_probe, CUDA, m) { m.impl("launch", &probe_launch); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("launch", &probe_launch); }
"""


def per_call_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load_inline

    t0 = time.time()
    ext = load_inline("vo_probe_ext", cpp_sources="", cuda_sources=CUDA_SRC, verbose=False)
    build_s = time.time() - t0
    dev = torch.device("cuda")
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    W = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16) * 0.02
    op, overload = torch.ops.vo_probe.launch, torch.ops.vo_probe.launch.default
    cases: dict[str, Callable[[], object]] = {
        "torch.ops.vo_probe.launch (packet, as kernels.py calls)": lambda: op(x, w, 1e-6),
        "torch.ops.vo_probe.launch.default (OpOverload)": lambda: overload(x, w, 1e-6),
        "pybind11 function, same C++": lambda: ext.launch(x, w, 1e-6),
        "F.linear [1, 2048] x [4096, 2048]^T (cuBLAS)": lambda: F.linear(x, W),
        "torch.empty_like (no launch)": lambda: torch.empty_like(x),
        "x.add_(1.0) (one aten launch)": lambda: x.add_(1.0),
        "python lambda, no torch call": lambda: None,
    }
    rows = {name: round(per_call_us(fn, args.n, args.rounds), 2) for name, fn in cases.items()}
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "n_calls": args.n,
        "rounds": args.rounds,
        "build_s": round(build_s, 1),
        "us_per_call_median": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_overhead_probe.json").write_text(json.dumps(out, indent=1))
    lines = [f"host cost per call, {out['device']}, torch {out['torch']}, median of "
             f"{args.rounds} x {args.n} calls"]  # fmt: skip
    lines += [f"{us:9.2f} us  {name}" for name, us in rows.items()]
    (args.out / "host_overhead_probe.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
