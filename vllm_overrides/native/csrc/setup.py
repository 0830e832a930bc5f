"""Builds the ``vo_native_kernels`` wheel: the fused kernels of ``*.cu``
(``native_kernels.cu``: decode; ``moe_prefill.cu``, ``moe_grouped_gemm.cu``, ``gdn_conv.cu``,
``gdn_chunk.cu``: prefill).

Run through ``scripts/build_kernels_wheel.sh`` (``pip wheel --no-build-isolation``), in the
environment whose torch the wheel is for: a torch extension is tied to that torch's version and
ABI. Knobs (environment variables):

* ``TORCH_CUDA_ARCH_LIST`` -- the GPU architectures (e.g. ``9.0`` for an H200); ``CUDA_HOME``,
  ``CC`` / ``CXX`` -- the toolchain, as torch's ``cpp_extension`` reads them. A CUDA-compatible
  vendor toolchain (e.g. CoreX's clang, ``--cuda-gpu-arch=ivcore10``) comes in the same way,
  through its torch build's ``cpp_extension`` and ``VO_NVCC_FLAGS``.
* ``VO_NVCC_FLAGS`` / ``VO_CXX_FLAGS`` -- extra device / host compiler flags (space separated).
* ``VO_KERNELS_CPU_EMULATION=1`` -- a test build of the same sources for host threads
  (``cpu_emulation.h``; ops registered for CPU tensors): what CI builds to check this packaging.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

HERE = Path(__file__).resolve().parent
# The overlay's version (the build script passes it: it builds from a copy of this folder).
VERSION = os.environ.get("VO_KERNELS_VERSION") or re.search(
    r'__version__ = "([^"]+)"', (HERE.parents[1] / "__init__.py").read_text()
).group(1)
NVCC = ["-O3", *os.environ.get("VO_NVCC_FLAGS", "").split()]
CXX = ["-O3", *os.environ.get("VO_CXX_FLAGS", "").split()]

if os.environ.get("VO_KERNELS_CPU_EMULATION") == "1":
    VERSION += "+cpuemu"  # never mistaken for a device build
    ext = CppExtension(
        "vo_native_kernels",
        ["cpu_emulation.cpp", "module.cpp"],
        extra_compile_args=CXX + ["-fno-strict-aliasing", "-Wno-unknown-pragmas"],
    )
else:
    ext = CUDAExtension(
        "vo_native_kernels",
        [*sorted(p.name for p in HERE.glob("*.cu")), "module.cpp"],
        extra_compile_args={"cxx": CXX, "nvcc": NVCC},
    )

setup(
    name="vo-native-kernels",
    version=VERSION,
    description="Fused decode kernels for vllm_overrides (Qwen3.5 / Qwen3.6 MoE)",
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
)
