"""Nsight Compute target (H200, device tool): one eager B = 1, 4K decode step of
``decode_step_bench.DecodeStep`` on the fused kernels, inside cudaProfilerStart/Stop, so that

    ncu --profile-from-start off --kernel-name regex:'moe_up|moe_down|gdn_decode|gemv' \\
        --launch-count 8 --section SpeedOfLight --section WarpStateStats ... \\
        python3 worklogs/remote_scripts/decode_kernels_ncu.py

profiles the step's own launches (warm: three steps run first) and no set-up kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode_step_bench as dsb  # noqa: E402

from vllm_overrides.native import kernels as kn  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    m = dsb.DecodeStep(dsb.Shapes(), torch.bfloat16, dev)
    m.set_case(1, 4096)
    kn.set_backend("cuda")
    assert kn.extension_loaded(), kn._load_error
    for _ in range(3):
        m.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    m.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
