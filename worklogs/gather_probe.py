"""Row-gather speed on the GPU: copying whole expert blocks (MoE decode) or state slots (GDN
decode) with ``index_select`` as stored, versus on a wider-word view of the same bytes.

``index_select`` with few indices runs PyTorch's "small index" kernel, one element per thread
step; viewing bf16 rows as int64 / complex128 words moves 4x / 8x the bytes per step. Prints
JSON and a table (CUDA-graph replay, median of 200; one graph runs 8 gathers with 8 random
index sets, so the source does not sit in L2; time per gather). Usage (GPU host):

    python3 worklogs/gather_probe.py > gather_probe.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# Run as `python3 worklogs/gather_probe.py`: sys.path[0] is worklogs/, and the shared timer
# lives in remote_scripts/ beside the other probes that use it.
sys.path.insert(0, str(Path(__file__).resolve().parent / "remote_scripts"))
from cuda_graph_timing import graph_replay_ms  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    cases = {
        "moe w13 [256,256,2048] bf16": torch.randn(256, 256, 2048, device=dev).bfloat16(),
        "moe w2 [256,2048,128] bf16": torch.randn(256, 2048, 128, device=dev).bfloat16(),
        "gdn state [1024,8,128,128] f32": torch.randn(1024, 8, 128, 128, device=dev),
    }
    rows = []
    for name, w in cases.items():
        n_rows = w.shape[0]
        for count in (1, 8, 64, 256):
            sets = [torch.randperm(n_rows, device=dev)[:count] for _ in range(8)]
            flat = w.view(n_rows, -1)
            ref = flat.index_select(0, sets[0])
            res = {"case": name, "indices": count, "MB": ref.numel() * ref.element_size() / 2**20}
            for label, dt in (
                ("as stored", None),
                ("int64 words", torch.int64),
                ("complex128 words", torch.complex128),
            ):
                src = flat if dt is None else flat.view(dt)
                assert torch.equal(src.index_select(0, sets[0]).view(w.dtype), ref)

                def eight(src: torch.Tensor = src, sets: list[torch.Tensor] = sets) -> None:
                    for i in sets:
                        src.index_select(0, i)

                ms = graph_replay_ms(eight, rounds=200) / len(sets)
                res[label] = {"ms": ms, "GBps": 2 * res["MB"] * 2**20 / (ms * 1e-3) / 1e9}
            rows.append(res)
            cols = "  ".join(
                f"{k}: {res[k]['ms'] * 1e3:7.1f} us ({res[k]['GBps']:5.0f} GB/s)"
                for k in ("as stored", "int64 words", "complex128 words")
            )
            print(f"{name:32s} n={count:4d} {res['MB']:7.1f} MB  {cols}", file=sys.stderr)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
