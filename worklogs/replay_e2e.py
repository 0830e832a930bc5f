#!/usr/bin/env python3
"""End-to-end replay on the tiny model (``make replay``): dataset -> patched server -> bench.

    python worklogs/replay_e2e.py [--preset replay88] [-r N] [--max-tokens 16] [--port 8131]
        [--out worklogs/results/replay88_tiny-cpu.json] [--label ...] [-- EXTRA_LAUNCHER_ARGS]

1. generates the preset (``generate_official_like_dataset.py``, seed 0) into ``build/replay/``;
2. starts the server from ``computility-run.yaml`` through the launcher (``--cpu``, tiny
   model, the YAML's ``--max-model-len`` so the replay's 254K-token prompts fit), logging to
   ``build/replay/server.log``;
3. replays the dataset with ``formal_perf_bench.py`` at the YAML's concurrency, short outputs
   (``--max-tokens``), per-request ideal / cached / efficiency (``/tokenize``);
4. samples the server's resident memory (the whole process tree) every 5 s (each sample also
   appended to ``<out>.memory.jsonl`` as it is taken, like the bench's record log), checks
   ``/health`` afterwards and that the log holds no engine traceback, and adds both to the
   result JSON (``memory``, ``engine``);
5. stops the server.

Sizes on the development VM (2 cores, tiny model, ``--max-tokens 16``): ``make replay`` runs the
first 34 requests of ``replay88`` (1/10 scale, same distributions), well under an hour; request
35 is a cold 250K-token prompt, and all of ``replay88`` took over an hour on the shared VM, the
full ``replay881`` hours (``worklogs/LEDGER.md``) -- run those in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "worklogs"))

import formal_perf_bench  # noqa: E402
import generate_official_like_dataset as gen  # noqa: E402

from vllm_overrides.launcher import DEFAULT_CONFIG, load_run_config  # noqa: E402


class MemorySampler(threading.Thread):
    """RSS of a process and its children, every ``every`` seconds; with ``log``, each sample is
    also appended to that JSONL file as it is taken (a run cut short keeps its series)."""

    def __init__(self, pid: int, every: float = 5.0, log: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every = every
        self.log = log
        self.samples: list[tuple[float, int]] = []
        self.by_process: list[tuple[float, dict[str, int]]] = []  # RSS by process title
        self.stop_event = threading.Event()
        self.t0 = time.perf_counter()

    def rss(self) -> tuple[int, dict[str, int]]:
        total, parts = 0, {}
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                rss = p.memory_info().rss
                name = f"{p.name()}[{p.pid}]"  # vLLM titles its processes (VLLM::EngineCore)
            except psutil.Error:
                continue
            total += rss
            parts[name] = rss
        return total, parts

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                t = round(time.perf_counter() - self.t0, 1)
                total, parts = self.rss()
            except psutil.Error:
                break
            self.samples.append((t, total))
            self.by_process.append((t, parts))
            if self.log is not None:
                with open(self.log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"t_s": t, "rss": total, "by_process": parts}) + "\n")
            self.stop_event.wait(self.every)

    def per_pass(self, spans: list[tuple[float, float]]) -> list[dict[str, float]]:
        """Mean, max and last RSS (MiB) within each pass's [start, end) seconds."""
        rows = []
        for a, b in spans:
            mib = np.array([m for t, m in self.samples if a <= t < b], dtype=np.float64) / 2**20
            if len(mib):
                procs: dict[str, float] = {}
                for t, parts in self.by_process:
                    if a <= t < b:
                        for name, rss in parts.items():
                            procs[name] = max(procs.get(name, 0.0), rss / 2**20)
                rows.append({"start_s": round(a, 1), "end_s": round(b, 1),
                             "mean_mib": round(float(mib.mean()), 1),
                             "max_mib": round(float(mib.max()), 1),
                             "last_mib": round(float(mib[-1]), 1),
                             "max_mib_by_process": {k: round(v, 1) for k, v in procs.items()},
                             })  # fmt: skip
        return rows

    def summary(self, replay_start: float) -> dict[str, object]:
        return memory_summary([(t, m) for t, m in self.samples if t >= replay_start], self.every)


def memory_summary(samples: list[tuple[float, int]], every: float) -> dict[str, object]:
    """Start, end (medians of the first and last tenth), max and growth of an RSS series."""
    if not samples:
        return {"n": 0}
    mib = np.array([m for _, m in samples], dtype=np.float64) / 2**20
    n = len(mib)
    q = max(1, n // 10)
    first, last = float(np.median(mib[:q])), float(np.median(mib[-q:]))
    return {
        "n": n, "every_s": every, "start_mib": round(first, 1),
        "end_mib": round(last, 1), "max_mib": round(float(mib.max()), 1),
        "growth_mib": round(last - first, 1),
        "growth_pct": round(100 * (last - first) / first, 2) if first else None,
        "samples": samples,
    }  # fmt: skip


def exit_on_sigterm() -> None:
    """SIGTERM (``kill``, a job's time limit) raises SystemExit(143), so ``main``'s ``finally``
    stops the server: Python's default SIGTERM ends the process at once, and the server, in its
    own session, outlived the replay (2026-12-03, LEDGER)."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="replay88")
    ap.add_argument("-r", "--requests", type=int, help="replay only the first N requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label")
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="replay the same requests N times on one server (a leak grows every pass; a "
        "high-water mark does not); passes after the first write <out>-passK.json",
    )
    ap.add_argument(
        "--cold-passes",
        action="store_true",
        help="with --passes: reset the prefix cache before each later pass (the server runs "
        "with VLLM_SERVER_DEV_MODE=1 for the reset endpoint), so every pass recomputes",
    )
    ap.add_argument("extra", nargs="*", help="after --: extra launcher arguments")
    args = ap.parse_args(argv)
    exit_on_sigterm()

    build = REPO / "build" / "replay"
    build.mkdir(parents=True, exist_ok=True)
    dataset = build / f"{args.preset}.jsonl"
    if not dataset.exists():
        assert gen.main(["--preset", args.preset, "--seed", "0", "--out", str(dataset)]) == 0
    size = f"-r{args.requests}" if args.requests else ""
    out = args.out or REPO / "worklogs" / "results" / f"{args.preset}{size}_tiny-cpu.json"
    concurrency = load_run_config(DEFAULT_CONFIG).concurrency

    log = build / "server.log"
    cmd = [sys.executable, "-m", "vllm_overrides.launcher", "--cpu", "--model",
           str(REPO / "build" / "tiny-model"), "--host", "127.0.0.1", "--port", str(args.port),
           *args.extra]  # fmt: skip
    print("server:", " ".join(cmd), f"(log {log})", flush=True)
    with open(log, "w") as logf:
        env = {**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if args.cold_passes else {})}
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                  start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{args.port}"
    memory_log = out.with_suffix(".memory.jsonl")
    memory_log.unlink(missing_ok=True)
    sampler = MemorySampler(server.pid, log=memory_log)
    try:
        t0 = time.perf_counter()
        while True:
            if server.poll() is not None:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"server exited with {server.returncode} during start-up")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.startup_timeout:
                raise SystemExit("server did not become healthy")
            time.sleep(5)
        startup_s = time.perf_counter() - t0
        print(f"server healthy after {startup_s:.0f} s", flush=True)
        sampler.start()
        replay_start = time.perf_counter() - sampler.t0
        bench = ["--base-url", base, "--dataset", str(dataset), "--out", str(out),
                 "-c", str(concurrency), "--max-tokens", str(args.max_tokens),
                 "--label", args.label or f"{args.preset}{size} tiny-cpu c={concurrency}"]
        if args.requests:
            bench += ["-r", str(args.requests)]
        t_bench = time.perf_counter()
        rc, pass_spans = 0, []
        for k in range(1, args.passes + 1):
            t_pass = time.perf_counter() - sampler.t0
            pout = out if k == 1 else out.with_name(f"{out.stem}-pass{k}{out.suffix}")
            later = [*bench[:5], str(pout), *bench[6:]]
            if args.cold_passes:
                later.append("--reset-prefix-cache")
            # Each request's record as it ends: a replay of hours that is cut short keeps them.
            log_k = ["--record-log", str(pout.with_suffix(".records.jsonl"))]
            rc |= formal_perf_bench.main([*(bench if k == 1 else later), *log_k])
            pass_spans.append((t_pass, time.perf_counter() - sampler.t0))
        bench_wall = time.perf_counter() - t_bench
        sampler.stop_event.set()
        sampler.join(10)
        try:
            healthy = httpx.get(base + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            healthy = False
        text = log.read_text(errors="replace")
        engine = {
            "healthy_after": healthy,
            "server_alive": server.poll() is None,
            "tracebacks_in_log": text.count("Traceback"),
            "engine_dead_lines": sum("EngineDeadError" in ln for ln in text.splitlines()),
            "startup_s": round(startup_s, 1),
            "bench_wall_s": round(bench_wall, 1),
            "server_command": cmd,
            "server_env": {k: os.environ[k] for k in ("GDN_NATIVE", "RMSNORM_NATIVE",
                           "MOE_NATIVE", "QK_NORM_ROPE_NATIVE", "VISION_ROPE_NATIVE", "GEMV_NATIVE",
                           "NATIVE_KERNELS") if k in os.environ},
        }  # fmt: skip
        result = json.loads(out.read_text())
        result["memory"] = sampler.summary(replay_start)
        if args.passes > 1:
            result["memory"]["passes"] = sampler.per_pass(pass_spans)
        result["engine"] = engine
        out.write_text(json.dumps(result, indent=1) + "\n")
        mem = result["memory"]
        print(f"\nengine: healthy after the replay {healthy}, tracebacks in the log "
              f"{engine['tracebacks_in_log']}; bench wall {bench_wall:.0f} s")
        if mem.get("n"):
            print(f"server RSS (whole tree): start {mem['start_mib']:.0f} MiB, end "
                  f"{mem['end_mib']:.0f} MiB, max {mem['max_mib']:.0f} MiB "
                  f"(growth {mem['growth_pct']} %)")
            for k, row in enumerate(mem.get("passes", []), 1):
                print(f"  pass {k}: mean {row['mean_mib']:.0f} MiB, max {row['max_mib']:.0f} MiB, "
                      f"last {row['last_mib']:.0f} MiB; max by process "
                      f"{row['max_mib_by_process']}")
        return 0 if rc == 0 and healthy and not engine["tracebacks_in_log"] else 1
    finally:
        sampler.stop_event.set()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
