#!/usr/bin/env python3
"""What vLLM's CPU KV tier costs a host, measured on a CUDA machine (no vLLM needed).

    python3 worklogs/remote_scripts/offload_copy_probe.py --out $OUT/offload [--gib 4]

The tier (``--kv-offloading-size``, patch 0012) is one ``/dev/shm`` file, pre-faulted with
``MADV_POPULATE_WRITE``, pinned with ``cudaHostRegister``, and filled / read one block-sized
chunk at a time (20.6 MiB per rank for Qwen3.6 at TP4: four KV cache groups x 10 layers x a
528-token page). This times each of those steps on a region of ``--gib`` GiB (or a plain file
in ``/tmp`` when ``/dev/shm`` is too small, said in the JSON), and the device <-> host copy
rate of such chunks, pinned and pageable, against which the cache simulator's "every transfer
is done by the next step" stands.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import time
from pathlib import Path

import torch

CHUNK = 4 * 10 * 528 * 1024  # bytes per block and rank: 4 groups x 10 layers x one page
GIB = 1 << 30


def rate(fn, nbytes: int, reps: int = 5) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def copies(mm: mmap.mmap, size: int, n: int) -> dict:
    """Chunk copies pageable, then pinned; the tensors die here so the map can close."""
    out: dict = {}
    base = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
    host = base[: n * CHUNK]
    dev = torch.empty(n * CHUNK, dtype=torch.uint8, device="cuda")

    def both() -> dict:
        return {
            "d2h_GBps": rate(lambda: host.copy_(dev, non_blocking=True), n * CHUNK),
            "h2d_GBps": rate(lambda: dev.copy_(host, non_blocking=True), n * CHUNK),
        }

    out["pageable"] = both()
    cudart = torch.cuda.cudart()
    t = time.perf_counter()
    err = int(cudart.cudaHostRegister(base.data_ptr(), size, 0))
    out["host_register_s"] = time.perf_counter() - t
    out["host_register_error"] = err
    if err == 0:
        out["pinned"] = both()
        cudart.cudaHostUnregister(base.data_ptr())
    best = out.get("pinned", out["pageable"])
    out["step_store_ms"] = n * CHUNK / (best["d2h_GBps"] * 1e9) * 1e3
    # a 250K-token hit loads the attention pages (10 layers x 1 KiB per token) and one state
    out["load_250k_tokens_ms"] = (250_000 * 10 * 1024 + CHUNK) / (best["h2d_GBps"] * 1e9) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--chunks", type=int, default=16, help="one 8,192-token prefill step")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    size = int(args.gib * GIB) // CHUNK * CHUNK
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    where = "/dev/shm" if shm_free > size + GIB else "/tmp"
    res: dict = {"gpu": torch.cuda.get_device_name(), "chunk_bytes": CHUNK, "region_bytes": size,
                 "region_dir": where, "dev_shm_free_bytes": shm_free}  # fmt: skip
    path = f"{where}/vo_offload_probe.mmap"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        t = time.perf_counter()
        mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, size)
        res["populate_GBps"] = size / (time.perf_counter() - t) / 1e9
        res.update(copies(mm, size, min(args.chunks, size // CHUNK)))
        gc.collect()  # the tensor views of the map are gone before it closes
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    print(json.dumps(res, indent=1))
    (args.out / "offload_copy_probe.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
