#!/usr/bin/env python3
"""Kernel benchmark: native (plain PyTorch) Qwen3.5/3.6 kernels vs FLA's Triton kernels.

Shapes are Qwen3.6-35B-A3B's (hidden 2048, 256 experts top-8, expert/shared intermediate 512,
GDN 16 key / 32 value heads of dim 128) sharded for TP1 and TP4. For every case it records
median milliseconds eagerly and under CUDA-graph replay, the floors measured in the same run
(device-to-device copy bandwidth, bf16 matmul rate), and the output error of each
implementation against a float64 reference.

Cases (TP4 first: the targets are stated at TP4; a global deadline keeps the run inside one
device call and results are rewritten after every case, so a cut-off run still returns data):

* floors: copy GB/s (bytes read + written), bf16 / tf32 matmul TF/s (8192^3).
* GDN prefill T = 16384, 65536 (one sequence, random initial state): FLA
  ``chunk_gated_delta_rule`` vs native ``chunk_gated_delta_rule`` in float32 and in TF32.
* GDN decode B = 1, 64 (float32 states, 4 rotating input sets so the states do not sit in
  L2): FLA ``fused_recurrent_gated_delta_rule`` vs native ``gated_delta_rule_decode``
  (``embedding_bag`` and ``index_select`` gathers) and the packed-decode API.
* MoE decode T = 1..32 (8 rotating routings): native route + experts (gather / grouped /
  dense) vs the gather method's two GEMMs alone on pre-gathered weights.
* MoE prefill T = 16384: native route + sort + grouped GEMMs + combine vs the two grouped GEMMs
  alone (TF/s), and the per-expert loop fallback (eager).

Usage on the device (see worklogs/LEDGER.md for the exact command used)::

    FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1 python3 worklogs/kernel_bench.py --out $OUT \\
        --commit <sha> [--dirty]

Locally: ``--smoke`` runs tiny shapes on the CPU (no FLA, no graphs) to check the script;
``--ledger-from results.json --command "..."`` appends the markdown table to LEDGER.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vllm_overrides.native import gdn, kernels, moe  # noqa: E402
from vllm_overrides.native import gdn_reference as gref  # noqa: E402
from vllm_overrides.native import moe_reference as mref  # noqa: E402

MODEL = {
    "hidden": 2048,
    "experts": 256,
    "top_k": 8,
    "moe_inter": 512,
    "shared_inter": 512,
    "k_heads": 16,
    "v_heads": 32,
    "head_k": 128,
    "head_v": 128,
}
# GDN prefill at TP4, T = 16,384: the most a mode may take against FLA's chunk kernel. The fused
# CUDA kernels answer issue 15 (<= 2x, output and final-state errors no worse than FLA's); the
# PyTorch paths issue 5 (<= 3x, output error no worse).
GDN_PREFILL_TARGETS = {
    "fused": (2.0, True),
    "native_tf32": (3.0, False),
    "native_tf32_trsm": (3.0, False),
    "native_fp32": (3.0, False),
}


def gdn_prefill_target(c: dict[str, Any], mode: str) -> str:
    """The target cell of a TP4 T = 16,384 GDN prefill row ("" for a mode without a target)."""
    if mode not in GDN_PREFILL_TARGETS:
        return ""
    most, state = GDN_PREFILL_TARGETS[mode]
    nb, bb = _best(c.get(mode)), _best(c.get("fla"))
    errs = [("err", c.get(f"{mode}_err"), c.get("fla_err"))]
    if state:
        errs.append(("state err", c.get(f"{mode}_state_err"), c.get("fla_state_err")))
    ok = bool(nb and bb and nb <= most * bb) and all(
        e is not None and f is not None and e <= f for _, e, f in errs
    )
    conds = ", ".join(f"{name}<=FLA" for name, _, _ in errs)
    return f"{'MET' if ok else 'not met'} (<={most:g}x FLA, {conds})"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))
    return float("inf") if err != err else err


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Median per-call time, eagerly and as CUDA-graph replays, over rotating input sets."""

    def __init__(self, device: torch.device, smoke: bool) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.smoke = smoke

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _loop(self, fns: list[Callable[[], Any]], n_inner: int, reps: int) -> float:
        times = []
        for _ in range(reps):
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for i in range(n_inner):
                    fns[i % len(fns)]()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / n_inner)
            else:
                t0 = time.perf_counter()
                for i in range(n_inner):
                    fns[i % len(fns)]()
                times.append((time.perf_counter() - t0) * 1e3 / n_inner)
        return statistics.median(times)

    def _plan(self, fns: list[Callable[[], Any]], target_ms: float) -> tuple[int, int]:
        for f in fns:
            f()
        self.sync()
        t = self._loop(fns, len(fns), 1)
        if self.smoke:
            return 1, 2
        n_inner = max(len(fns), min(400, math.ceil(target_ms / max(t, 1e-3))))
        n_inner = math.ceil(n_inner / len(fns)) * len(fns)
        reps = 7 if t * n_inner > 20 else 11
        return n_inner, reps

    def eager(self, fns: list[Callable[[], Any]], target_ms: float = 5.0) -> float:
        n_inner, reps = self._plan(fns, target_ms)
        return self._loop(fns, n_inner, reps)

    def graph(self, fns: list[Callable[[], Any]], target_ms: float = 5.0) -> float:
        if not self.cuda:
            raise RuntimeError("no CUDA graphs on CPU")
        graphs = []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for f in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs.append(g)
        replays = [g.replay for g in graphs]
        return self._loop(replays, *self._plan(replays, target_ms))

    def both(self, fns: list[Callable[[], Any]], target_ms: float = 5.0) -> dict[str, Any]:
        out: dict[str, Any] = {"eager_ms": self.eager(fns, target_ms)}
        try:
            out["graph_ms"] = self.graph(fns, target_ms)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out["graph_ms"] = None
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self.cuda:
                torch.cuda.synchronize()
        return out


def profile_table(fn: Callable[[], Any], n: int = 5, rows: int = 18) -> str:
    """Top kernels by device time over ``n`` calls (torch.profiler), as text."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60
    )


# ---------------------------------------------------------------------------------------------
# Benchmark driver
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.timer = Timer(self.dev, self.smoke)
        self.t0 = time.time()
        self.deadline = args.deadline or (self.t0 + args.budget_s)
        self.part = Path(args.parts_dir) / f"{args.child}.json"
        self.results: dict[str, Any] = {"meta": self.meta(), "floors": {}, "cases": []}
        floors = Path(args.parts_dir) / "floors.json"
        if args.child != "floors" and floors.exists():
            self.results["floors"] = json.loads(floors.read_text())["floors"]
        self.fla = None
        if not self.smoke:
            try:
                from fla.ops.gated_delta_rule import (
                    chunk_gated_delta_rule,
                    fused_recurrent_gated_delta_rule,
                )

                self.fla = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
            except Exception as exc:  # noqa: BLE001
                self.results["meta"]["fla_error"] = repr(exc)[:300]

    def meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "command": " ".join(sys.argv),
            "commit": self.args.commit,
            "dirty_tree": self.args.dirty,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "host": platform.node(),
            "smoke": self.smoke,
            "env": {k: os.environ.get(k) for k in ("FLA_FLASH_QLA", "CUDA_VISIBLE_DEVICES")},
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        try:
            import triton

            m["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            m["triton"] = None
        try:
            import fla

            m["fla"] = fla.__version__
        except Exception:  # noqa: BLE001
            m["fla"] = None
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            m["gpu"] = p.name
            m["sms"] = p.multi_processor_count
            try:
                m["driver"] = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=driver_version,clocks.max.sm",
                        "--format=csv,noheader",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
            except Exception:  # noqa: BLE001
                m["driver"] = None
        return m

    # -- bookkeeping --------------------------------------------------------------------------

    def left_s(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.part.write_text(json.dumps(self.results, indent=1))

    def run_case(self, name: str, fn: Callable[[], dict[str, Any]], min_left_s: float) -> None:
        if self.left_s() < min_left_s:
            log(f"SKIP {name}: {self.left_s():.0f}s left < {min_left_s:.0f}s")
            self.results["cases"].append({"case": name, "skipped": "deadline"})
            self.save()
            return
        log(f"START {name}")
        t = time.time()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - keep going with the other cases
            res = {
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-2000:],
            }
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
        res = {"case": name, **res, "wall_s": round(time.time() - t, 1)}
        self.results["cases"].append(res)
        self.save()
        log(
            f"DONE  {name} ({res['wall_s']}s): "
            + json.dumps(
                {
                    k: v
                    for k, v in res.items()
                    if k not in ("traceback", "case") and not k.startswith("profile")
                }
            )[:600]
        )
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    # -- floors ---------------------------------------------------------------------------------

    def floors(self) -> None:
        f = self.results["floors"]
        n = (1 << 28) if not self.smoke else (1 << 20)  # 1 GiB of fp32
        src = torch.randn(n, device=self.dev)
        dst = torch.empty_like(src)
        ms = self.timer.eager([lambda: dst.copy_(src)], 20.0)
        f["copy_GBps"] = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
        src = dst = None
        m = 8192 if not self.smoke else 256
        a = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
        ms = self.timer.eager([lambda: a @ b], 20.0)
        f["bf16_matmul_TFps"] = 2 * m**3 / (ms * 1e-3) / 1e12
        a, b = a.float(), b.float()
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        ms = self.timer.eager([lambda: a @ b], 20.0)
        f["tf32_matmul_TFps"] = 2 * m**3 / (ms * 1e-3) / 1e12
        torch.backends.cuda.matmul.allow_tf32 = False
        ms = self.timer.eager([lambda: a @ b], 20.0)
        f["fp32_matmul_TFps"] = 2 * m**3 / (ms * 1e-3) / 1e12
        torch.backends.cuda.matmul.allow_tf32 = old
        log(f"floors: {json.dumps(f)}")
        self.save()

    def copy_ms(self, nbytes: float) -> float:
        return nbytes / (self.results["floors"]["copy_GBps"] * 1e9) * 1e3

    def bf16_ms(self, flops: float) -> float:
        return flops / (self.results["floors"]["bf16_matmul_TFps"] * 1e12) * 1e3

    # -- shapes ---------------------------------------------------------------------------------

    def shard(self, tp: int) -> dict[str, int]:
        if self.smoke:
            return {"H": 2, "HV": 4, "K": 32, "V": 32, "E": 16, "hidden": 64, "I": 32, "k": 4}
        return {
            "H": MODEL["k_heads"] // tp,
            "HV": MODEL["v_heads"] // tp,
            "K": MODEL["head_k"],
            "V": MODEL["head_v"],
            "E": MODEL["experts"],
            "hidden": MODEL["hidden"],
            "I": MODEL["moe_inter"] // tp,
            "k": MODEL["top_k"],
        }

    def gdn_inputs(self, T: int, s: dict[str, int], n_seq: int = 1) -> dict[str, torch.Tensor]:
        dev, H, HV, K, V = self.dev, s["H"], s["HV"], s["K"], s["V"]
        A_log = torch.log(torch.empty(HV, device=dev).uniform_(1.0, 16.0))
        dt_bias = torch.randn(HV, device=dev) * 0.5
        g, beta = gdn.gdn_gating(
            A_log, torch.randn(T, HV, device=dev) - 2.0, dt_bias, torch.randn(T, HV, device=dev)
        )
        return {
            "q": torch.randn(T, H, K, device=dev, dtype=torch.bfloat16),
            "k": torch.randn(T, H, K, device=dev, dtype=torch.bfloat16),
            "v": torch.randn(T, HV, V, device=dev, dtype=torch.bfloat16),
            "g": g,
            "beta": beta,
            "A_log": A_log,
            "dt_bias": dt_bias,
            "h0": torch.randn(n_seq, HV, V, K, device=dev) * 0.05,
        }

    # -- GDN prefill ----------------------------------------------------------------------------

    def gdn_prefill(self, tp: int, T: int) -> dict[str, Any]:
        s = self.shard(tp)
        x = self.gdn_inputs(T, s)
        cu = torch.tensor([0, T], device=self.dev, dtype=torch.long)
        layout = gdn.prepare_chunk_layout(cu, T)
        q, k, v = x["q"][None], x["k"][None], x["v"][None]
        g, beta, h0 = x["g"][None], x["beta"][None], x["h0"]
        res: dict[str, Any] = {
            "kind": "gdn_prefill",
            "tp": tp,
            "T": T,
            **s,
            "n_chunks": layout.n_chunks,
            "n_pad": layout.n_pad,
            "scan_group": layout.group,
        }
        nbytes = (2 * q.numel() + 2 * v.numel()) * 2 + 2 * g.numel() * 4 + 2 * h0.numel() * 4
        n_ch = T / 64 * s["HV"]
        C, Kd, Vd = 64, s["K"], s["V"]
        flops = n_ch * (2 * C * C * Kd + 2 * C * C * (Kd + Vd) + 8 * C * Kd * Vd + 2 * C * C * Vd)
        res["floor_ms"] = max(self.copy_ms(nbytes), self.bf16_ms(flops))
        res["floor_note"] = "max(bytes/copy, chunk-form flops/bf16 rate)"

        log(f"  reference float64 (T={T}) ...")
        t = time.time()
        ro, rfin = gref.gated_delta_rule_reference_fast(
            x["q"], x["k"], x["v"], x["g"], x["beta"], [0, T], initial_state=h0
        )
        res["ref_s"] = round(time.time() - t, 1)

        def native(tri: str = "matmul", tf32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
            return gdn.chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                initial_state=h0,
                output_final_state=True,
                cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True,
                layout=layout,
                tri_solve=tri,
                tf32=tf32,
            )

        # (tri_solve="torch", cuBLAS trsm, lost at TP4 16K: 3.43 vs 2.77 ms in run 2, 2.91 vs
        # 2.22 ms in the 2026-12-01 run)
        modes = (("native_fp32", False, "matmul"), ("native_tf32", True, "matmul"))
        for mode, tf32, tri in modes:
            fn = functools.partial(native, tri, tf32)
            o, fin = fn()
            res[f"{mode}_err"] = rel(o[0], ro)
            res[f"{mode}_state_err"] = rel(fin, rfin)
            del o, fin
            res[mode] = self.timer.both([fn], 50.0)
            log(f"  {mode}: {res[mode]} err {res[f'{mode}_err']:.2e}")
            if self.dev.type == "cuda" and tp == 4 and T == 16384 and mode == "native_tf32":
                res["profile_native_tf32"] = profile_table(fn, n=3)

        if kernels.use_cuda(q):
            # The fused chunk kernels (csrc/gdn_chunk.cu): three launches, l2 norm fused.
            def fused() -> tuple[torch.Tensor, torch.Tensor | None]:
                return kernels.chunk_gated_delta_rule(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    initial_state=h0,
                    output_final_state=True,
                    cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True,
                )

            o, fin = fused()
            res["fused_err"] = rel(o[0], ro)
            res["fused_state_err"] = rel(fin, rfin)
            del o, fin
            res["fused"] = self.timer.both([fused], 50.0)
            log(f"  fused: {res['fused']} err {res['fused_err']:.2e}")
            if self.dev.type == "cuda" and tp == 4 and T == 16384:
                res["profile_fused"] = profile_table(fused, n=3)

        if self.fla is not None:
            chunk = self.fla[0]
            cu_cpu = cu.cpu()

            def fla() -> tuple[torch.Tensor, torch.Tensor]:
                return chunk(
                    q,
                    k,
                    v,
                    g=g,
                    beta=beta,
                    initial_state=h0,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    state_v_first=True,
                    cu_seqlens=cu,
                    cu_seqlens_cpu=cu_cpu,
                )

            log("  FLA first call (autotune) ...")
            t = time.time()
            o, fin = fla()
            self.timer.sync()
            res["fla_first_call_s"] = round(time.time() - t, 1)
            res["fla_err"] = rel(o[0], ro)
            res["fla_state_err"] = rel(fin, rfin)
            res["native_vs_fla_state_err"] = rel(native()[1], fin)
            del o, fin
            res["fla"] = self.timer.both([fla], 50.0)
            log(f"  fla: {res['fla']} err {res['fla_err']:.2e}")
        return res

    def gdn_scan_only(self, tp: int, T: int) -> dict[str, Any]:
        """Time of the chunk-state scan alone (fp32 and tf32), for the breakdown."""
        s = self.shard(tp)
        n_pad, group = gdn._scan_shape(T // 64)
        HV, K, V = s["HV"], s["K"], s["V"]
        MB = torch.randn(HV, n_pad, V + K, K, device=self.dev)
        MB[:, :, V:] *= K**-0.5
        res: dict[str, Any] = {
            "kind": "gdn_scan",
            "tp": tp,
            "T": T,
            "n_pad": n_pad,
            "group": group,
        }
        old = torch.backends.cuda.matmul.allow_tf32
        for mode, tf32 in (("fp32", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            res[mode] = self.timer.both([lambda: gdn._affine_scan(MB, V, group)], 20.0)
        torch.backends.cuda.matmul.allow_tf32 = old
        return res

    # -- GDN decode -----------------------------------------------------------------------------

    def gdn_decode(self, tp: int, B: int, n_sets: int = 4) -> dict[str, Any]:
        s = self.shard(tp)
        HV, K, V = s["HV"], s["K"], s["V"]
        dev = self.dev
        sets = []
        for _ in range(n_sets):
            x = self.gdn_inputs(B, s)
            state = torch.randn(B + 1, HV, V, K, device=dev) * 0.05
            mixed = torch.cat(
                [x["q"].reshape(B, -1), x["k"].reshape(B, -1), x["v"].reshape(B, -1)], dim=1
            )
            x.update(
                state=state,
                mixed=mixed,
                a=torch.randn(B, HV, device=dev),
                b=torch.randn(B, HV, device=dev),
                out=torch.empty(B, 1, HV, V, device=dev, dtype=torch.bfloat16),
            )
            sets.append(x)
        idx = torch.arange(1, B + 1, device=dev, dtype=torch.int32)
        res: dict[str, Any] = {
            "kind": "gdn_decode",
            "tp": tp,
            "B": B,
            **s,
            "state_dtype": "float32",
            "rotating_sets": n_sets,
        }
        res["floor_ms"] = self.copy_ms(2 * B * HV * V * K * 4)
        res["floor_note"] = "state read + write at copy bandwidth"

        x0 = sets[0]
        start = x0["state"][1:].clone()
        ro, rfin = gref.gated_delta_rule_reference_fast(
            x0["q"], x0["k"], x0["v"], x0["g"], x0["beta"], list(range(B + 1)), initial_state=start
        )

        def native_fn(x: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
            return lambda: gdn.gated_delta_rule_decode(
                x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], idx
            )

        # Default path only (index_select gather + index_copy_ write-back). Earlier runs at
        # B=64 TP4 vs its 0.158 ms: gather="embedding_bag" 0.228 ms, a CSR sparse.mm gather
        # 0.172 ms, an index_put_ write-back 0.170 ms; embedding_bag over the cache's K-float
        # rows 0.232 ms, an element-wise (addcmul_) rank-1 update 0.166 ms (LEDGER, 06:23 UTC).
        st = torch.cat([x0["state"][:1], start])  # errors first: timing mutates states
        o = gdn.gated_delta_rule_decode(x0["q"], x0["k"], x0["v"], x0["g"], x0["beta"], st, idx)
        res["native_index_select_err"] = rel(o, ro)
        res["native_index_select_state_err"] = rel(st[1:], rfin)
        res["native_index_select"] = self.timer.both([native_fn(x) for x in sets], 5.0)
        log(f"  native index_select: {res['native_index_select']}")
        if self.dev.type == "cuda" and B == 64:
            res["profile_native"] = profile_table(native_fn(x0))

        def packed(x: dict[str, torch.Tensor]) -> Callable[[], Any]:
            return lambda: gdn.fused_recurrent_gated_delta_rule_packed_decode(
                x["mixed"],
                x["a"],
                x["b"],
                x["A_log"],
                x["dt_bias"],
                K**-0.5,
                x["state"],
                x["out"],
                idx,
                use_qk_l2norm_in_kernel=True,
            )

        res["native_packed_api"] = self.timer.both([packed(x) for x in sets], 5.0)

        if dev.type == "cuda" and kernels.extension_loaded():
            # The fused kernel does the conv update, gates and norms too (one launch).
            D = x0["mixed"].shape[1]
            conv_sd = torch.randn(B + 1, 3, D, device=dev, dtype=torch.bfloat16)
            conv_w = torch.randn(D, 4, device=dev, dtype=torch.bfloat16) * 0.5
            kernels.set_backend("cuda")

            def fused(x: dict[str, torch.Tensor]) -> Callable[[], Any]:
                ab = (x["a"].to(torch.bfloat16), x["b"].to(torch.bfloat16))
                return lambda: kernels.gdn_decode(
                    x["mixed"], *ab, conv_sd.transpose(-1, -2), conv_w, None, x["A_log"],
                    x["dt_bias"], x["state"], x["out"][:, 0], idx, s["H"], K**-0.5,
                )  # fmt: skip

            res["fused_cuda"] = self.timer.both([fused(x) for x in sets], 5.0)
            log(f"  fused cuda: {res['fused_cuda']}")
            kernels.set_backend("auto")

        if self.fla is not None:
            fr = self.fla[1]

            cu_dec = torch.arange(B + 1, device=dev, dtype=torch.long)

            def fla_fn(x: dict[str, torch.Tensor]) -> Callable[[], Any]:
                # Varlen form, as vLLM calls it for decode: B sequences of one token.
                h0 = x["state"][1:]
                # keywords: FLA's 5th positional parameter is gk, not beta
                return lambda: fr(
                    x["q"][None],
                    x["k"][None],
                    x["v"][None],
                    g=x["g"][None],
                    beta=x["beta"][None],
                    scale=K**-0.5,
                    initial_state=h0,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    state_v_first=True,
                    cu_seqlens=cu_dec,
                )

            o, fin = fla_fn({**x0, "state": torch.cat([x0["state"][:1], start])})()
            res["fla_err"] = rel(o[0], ro)
            res["fla_state_err"] = rel(fin, rfin)
            res["fla"] = self.timer.both([fla_fn(x) for x in sets], 5.0)
            log(f"  fla: {res['fla']}")
        return res

    # -- MoE ------------------------------------------------------------------------------------

    def moe_weights(self, s: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        E, Hd, I = s["E"], s["hidden"], s["I"]  # noqa: E741
        w13 = (torch.randn(E, 2 * I, Hd, device=self.dev) * Hd**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, Hd, I, device=self.dev) * I**-0.5).to(torch.bfloat16)
        return w13, w2

    def moe_decode(self, tp: int, Ts: list[int], n_sets: int = 8) -> list[dict[str, Any]]:
        s = self.shard(tp)
        E, Hd, I, k = s["E"], s["hidden"], s["I"], s["k"]  # noqa: E741
        w13, w2 = self.moe_weights(s)
        dev = self.dev
        out = []
        for T in Ts:
            if self.left_s() < 30:
                out.append({"kind": "moe_decode", "tp": tp, "T": T, "skipped": "deadline"})
                continue
            sets = []
            for _ in range(n_sets):
                x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
                logits = torch.randn(T, E, device=dev, dtype=torch.bfloat16)
                w, ids = moe.route(logits, k, True)
                flat = ids.reshape(-1)
                w13g = w13.index_select(0, flat).view(T, k * 2 * I, Hd)
                w2g = w2.index_select(0, flat)  # [T*k, H, I], as the gather method has it
                act = torch.randn(T * k, I, 1, device=dev, dtype=torch.bfloat16)
                sets.append(
                    {
                        "x": x,
                        "logits": logits,
                        "w": w,
                        "ids": ids,
                        "w13g": w13g,
                        "w2g": w2g,
                        "act": act,
                    }
                )
            uniq = statistics.mean(int(torch.unique(d["ids"]).numel()) for d in sets)
            res: dict[str, Any] = {
                "kind": "moe_decode",
                "tp": tp,
                "T": T,
                **s,
                "rotating_sets": n_sets,
                "mean_unique_experts": uniq,
            }
            res["floor_ms"] = self.copy_ms(uniq * 3 * I * Hd * 2)
            res["floor_note"] = "distinct experts' weights read once at copy bandwidth"
            d0 = sets[0]
            ref = mref.moe_experts_reference(d0["x"], d0["w"], d0["ids"], w13, w2)

            def gemms(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
                # the gather method's two GEMMs on pre-gathered weights
                return lambda: (
                    torch.bmm(d["w13g"], d["x"].unsqueeze(-1)),
                    torch.bmm(d["w2g"], d["act"]),
                )

            res["gemms_alone"] = self.timer.both([gemms(d) for d in sets], 5.0)
            # Routing alone: the stable sort (route's contract: ties by ascending expert id)
            # against a plain top-k of the same logits; and whether top-k picks the same
            # experts in the same order on bf16 logits full of ties.
            res["route_sort"] = self.timer.both(
                [lambda d=d: moe.route(d["logits"], k, True) for d in sets], 3.0
            )
            res["route_topk"] = self.timer.both(
                [lambda d=d: torch.topk(d["logits"], k, dim=-1) for d in sets], 3.0
            )
            tied = torch.randint(-3, 4, (T, E), device=dev).to(torch.bfloat16)
            res["route_topk_same_ids_on_ties"] = bool(
                torch.equal(torch.topk(tied, k, dim=-1).indices, moe.route(tied, k, True)[1])
            )
            if T == 1 and self.dev.type == "cuda":
                res["profile_native_gather"] = profile_table(
                    lambda d=d0: moe.moe_experts_decode(
                        d["x"], *moe.route(d["logits"], k, True), w13, w2, "gather"
                    )
                )
            if dev.type == "cuda" and kernels.extension_loaded():
                kernels.set_backend("cuda")
                res["fused_route"] = self.timer.both(
                    [lambda d=d: kernels.moe_route(d["logits"], k, True) for d in sets], 3.0
                )

                def fused(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
                    def f() -> torch.Tensor:
                        wt, ids = kernels.moe_route(d["logits"], k, True)
                        return kernels.moe_decode(d["x"], wt, ids, w13, w2)

                    return f

                o = kernels.moe_decode(d0["x"], d0["w"], d0["ids"], w13, w2)
                res["fused_cuda_err"] = rel(o, ref)
                res["fused_cuda"] = self.timer.both([fused(d) for d in sets], 5.0)
                res["fused_experts_only"] = self.timer.both(
                    [
                        lambda d=d: kernels.moe_decode(d["x"], d["w"], d["ids"], w13, w2)
                        for d in sets
                    ],
                    5.0,
                )
                # The engine's decode call: routing inside the up kernel (2 launches, not 3).
                lg = [d["logits"].to(d["x"].dtype) for d in sets]
                o = kernels.moe_decode_routed(d0["x"], lg[0], k, True, w13, w2)
                res["fused_routed_err"] = rel(o, ref)
                res["fused_routed"] = self.timer.both(
                    [
                        lambda d=d, g=g: kernels.moe_decode_routed(d["x"], g, k, True, w13, w2)
                        for d, g in zip(sets, lg, strict=True)
                    ],
                    5.0,
                )
                if T == 1:
                    res["profile_fused"] = profile_table(fused(d0))
                log(f"  fused cuda: {res['fused_cuda']} (experts only {res['fused_experts_only']})")
                log(f"  fused routed (2 launches): {res['fused_routed']}")
                kernels.set_backend("auto")
            for method in ("gather", "grouped", "dense"):

                def nat(d: dict[str, torch.Tensor], m: str = method) -> Callable[[], Any]:
                    def f() -> torch.Tensor:
                        wt, ids = moe.route(d["logits"], k, True)
                        return moe.moe_experts_decode(d["x"], wt, ids, w13, w2, m)

                    return f

                try:
                    o = moe.moe_experts_decode(d0["x"], d0["w"], d0["ids"], w13, w2, method)
                    res[f"native_{method}_err"] = rel(o, ref)
                    res[f"native_{method}"] = self.timer.both([nat(d) for d in sets], 5.0)
                except Exception as exc:  # noqa: BLE001
                    res[f"native_{method}"] = {"error": repr(exc)[:300]}
            log(
                f"  moe decode tp{tp} T={T}: gemms {res['gemms_alone']} gather "
                f"{res.get('native_gather')} grouped {res.get('native_grouped')} "
                f"dense {res.get('native_dense')}"
            )
            out.append(res)
            del sets
        return out

    def moe_prefill(self, tp: int, T: int, with_loop: bool) -> dict[str, Any]:
        s = self.shard(tp)
        E, Hd, I, k = s["E"], s["hidden"], s["I"], s["k"]  # noqa: E741
        dev = self.dev
        w13, w2 = self.moe_weights(s)
        x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, E, device=dev, dtype=torch.bfloat16)
        flops = 2 * T * k * (2 * I * Hd + Hd * I)
        res: dict[str, Any] = {
            "kind": "moe_prefill",
            "tp": tp,
            "T": T,
            **s,
            "gflop": flops / 1e9,
            "floor_ms": self.bf16_ms(flops),
            "floor_note": "expert GEMM flops at the bf16 matmul rate",
        }
        w, ids = moe.route(logits, k, True)
        sub = 256
        ref = mref.moe_experts_reference(x[:sub], w[:sub], ids[:sub], w13, w2)

        def native(method: str) -> Callable[[], torch.Tensor]:
            def f() -> torch.Tensor:
                wt, i2 = moe.route(logits, k, True)
                return moe.moe_experts_prefill(x, wt, i2, w13, w2, method)

            return f

        o = native("grouped")()
        res["native_grouped_err_first256"] = rel(o[:sub], ref)
        res["native_grouped"] = self.timer.both([native("grouped")], 50.0)
        if self.dev.type == "cuda" and tp == 4:
            res["profile_native"] = profile_table(native("grouped"), n=3)
        order, inverse, ends = moe._sorted_pairs(ids, E)
        xs = x.index_select(0, order // k)
        act = torch.randn(T * k, I, device=dev, dtype=torch.bfloat16)

        def gemms() -> Any:
            return (
                torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends),
                torch._grouped_mm(act, w2.transpose(1, 2), offs=ends),
            )

        res["gemms_alone"] = self.timer.both([gemms], 50.0)
        # eager stage breakdown of the native path
        st: dict[str, float] = {}
        stages: list[tuple[str, Callable[[], Any]]] = [
            ("route", lambda: moe.route(logits, k, True)),
            ("sort_pairs", lambda: moe._sorted_pairs(ids, E)),
            ("gather_x", lambda: x.index_select(0, order // k)),
            ("gemm1", lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)),
        ]
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
        ws = w.reshape(-1).index_select(0, order)
        stages.append(("act", lambda: moe._weighted_act(h, ws.unsqueeze(-1))))
        stages.append(("gemm2", lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)))
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
        stages.append(("combine_gather", lambda: moe._combine(y, inverse, k, "gather")))
        try:
            res["combine_csr_err_vs_gather"] = rel(
                moe._combine(y, inverse, k, "csr"), moe._combine(y, inverse, k)
            )
            stages.append(("combine_csr", lambda: moe._combine(y, inverse, k, "csr")))
        except Exception as exc:  # noqa: BLE001
            res["combine_csr_error"] = repr(exc)[:300]
        for name, fn in stages:
            st[name] = self.timer.eager([fn], 20.0)
        res["stages_eager_ms"] = st
        for key in ("native_grouped", "gemms_alone"):
            ms = res[key].get("graph_ms") or res[key]["eager_ms"]
            res[f"{key}_TFps"] = flops / (ms * 1e-3) / 1e12
        if with_loop:
            o = native("loop")()
            res["native_loop_err_first256"] = rel(o[:sub], ref)
            res["native_loop"] = {"eager_ms": self.timer.eager([native("loop")], 50.0)}
        if self.dev.type == "cuda" and kernels.use_cuda(x):
            self.moe_prefill_fused(res, x, logits, w13, w2, k, ref, flops, with_loop)
        return res

    def time_fused_method(
        self,
        res: dict[str, Any],
        key: str,
        fn: Callable[[], torch.Tensor],
        ref: torch.Tensor,
        flops: float,
        profile_key: str,
    ) -> None:
        """One fused moe_prefill method into ``res``: its error on the reference's rows
        (``{key}_err_first256``), eager / graph ms (``key``), TF/s at the best of the two
        (``{key}_TFps``) and, at TP4, its kernel profile (``profile_key``)."""
        res[f"{key}_err_first256"] = rel(fn()[: ref.shape[0]], ref)
        res[key] = self.timer.both([fn], 50.0)
        ms = res[key].get("graph_ms") or res[key]["eager_ms"]
        res[f"{key}_TFps"] = flops / (ms * 1e-3) / 1e12
        if res["tp"] == 4:
            res[profile_key] = profile_table(fn, n=3)

    def moe_prefill_fused(
        self,
        res: dict[str, Any],
        x: torch.Tensor,
        logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        k: int,
        ref: torch.Tensor,
        flops: float,
        with_loop: bool,
    ) -> None:
        """The fused prefill kernels (kernels.moe_prefill, routing included) and their stages."""
        sub = ref.shape[0]

        def fused(method: str) -> Callable[[], torch.Tensor]:
            return lambda: kernels.moe_prefill(x, logits, k, True, w13, w2, None, method)

        self.time_fused_method(res, "fused_grouped", fused("grouped"), ref, flops, "profile_fused")
        ops = torch.ops.vo_kernels
        w, ids, counts, slot = ops.moe_route_count(logits, k, True)
        xs, ws, inverse, ends = ops.moe_permute(x, w, ids, counts, slot)
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(ops.moe_act(h, ws), w2.transpose(1, 2), offs=ends)
        stages: list[tuple[str, Callable[[], Any]]] = [
            ("route_count", lambda: ops.moe_route_count(logits, k, True)),
            ("permute", lambda: ops.moe_permute(x, w, ids, counts, slot)),
            ("act", lambda: ops.moe_act(h, ws)),
            ("combine", lambda: ops.moe_combine(y, inverse, k, None, None)),
        ]
        res["fused_stages_eager_ms"] = {n: self.timer.eager([fn], 20.0) for n, fn in stages}
        if kernels._grouped_gemm_fits(x, w13, w2):
            self.time_fused_method(
                res, "fused_wmma", fused("wmma"), ref, flops, "profile_fused_wmma"
            )
            self.moe_prefill_wmma(res, x, logits, w13, w2, k, (xs, h, ws, ends))
        if with_loop:
            res["fused_loop_err_first256"] = rel(fused("loop")()[:sub], ref)
            res["fused_loop"] = {"eager_ms": self.timer.eager([fused("loop")], 50.0)}

    def moe_prefill_wmma(
        self,
        res: dict[str, Any],
        x: torch.Tensor,
        logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        k: int,
        stock: tuple[torch.Tensor, ...],
    ) -> None:
        """method="wmma" (our grouped GEMMs, x's rows gathered in place) by stage, each GEMM
        beside the stock torch._grouped_mm on the same rows (graph replay); moe_prefill_fused
        times the method whole."""
        ops = torch.ops.vo_kernels
        xs, h, ws_p, ends_p = stock
        w, ids, counts, slot = ops.moe_route_count(logits, k, True)
        src, ws, inverse, ends, tiles = ops.moe_order(w, ids, counts, slot)
        act = ops.moe_grouped_gemm(x, src, w13, ends, tiles, ws)
        act_p = ops.moe_act(h, ws_p)
        P, H, I = src.numel(), x.shape[1], w2.shape[2]  # noqa: E741
        up, down = 4 * P * H * I, 2 * P * H * I
        gg = ops.moe_grouped_gemm
        gemms: list[tuple[str, Callable[[], Any], float]] = [
            ("order", lambda: ops.moe_order(w, ids, counts, slot), 0.0),
            ("wmma_gate_up", lambda: gg(x, src, w13, ends, tiles, ws), up),
            ("stock_gate_up", lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends_p), up),
            ("wmma_down", lambda: gg(act, None, w2, ends, tiles, None), down),
            ("stock_down", lambda: torch._grouped_mm(act_p, w2.transpose(1, 2), offs=ends_p), down),
        ]
        out: dict[str, Any] = {}
        for name, fn, fl in gemms:
            t = self.timer.both([fn], 20.0)
            ms = t.get("graph_ms") or t["eager_ms"]
            out[name] = {**t, **({"TFps": fl / (ms * 1e-3) / 1e12} if fl else {})}
        res["wmma_stages"] = out

    # -- plan ------------------------------------------------------------------------------------

    def group_cases(self, group: str) -> list[tuple[str, Callable[[], dict[str, Any]], float]]:
        sm = self.smoke
        t16, t64 = (16384, 65536) if not sm else (256, 512)
        dec_T = [1, 2, 4, 8, 16, 32] if not sm else [1, 4]
        tp = 4 if group.startswith("tp4") else 1
        if group.endswith("gdn_prefill"):
            cases = [(f"gdn_prefill tp{tp} T={t16}", lambda: self.gdn_prefill(tp, t16), 100)]
            if tp == 4:
                cases.append(
                    (f"gdn_scan_only tp{tp} T={t16}", lambda: self.gdn_scan_only(tp, t16), 15)
                )
            cases.append((f"gdn_prefill tp{tp} T={t64}", lambda: self.gdn_prefill(tp, t64), 60))
            return cases
        if group.endswith("gdn_decode"):
            return [
                (f"gdn_decode tp{tp} B={b}", lambda b=b: self.gdn_decode(tp, b), 20)
                for b in (1, 64)
            ]
        if group.endswith("moe"):
            return [
                (
                    f"moe_decode tp{tp}",
                    lambda: {"rows": self.moe_decode(tp, dec_T if tp == 4 else dec_T[::2])},
                    30,
                ),
                (
                    f"moe_prefill tp{tp} T={t16}",
                    lambda: self.moe_prefill(tp, t16, with_loop=tp == 4),
                    30,
                ),
            ]
        raise ValueError(group)

    def run_child(self, group: str) -> None:
        if group == "floors":
            self.floors()
            return
        for name, fn, min_left in self.group_cases(group):
            self.run_case(name, fn, min_left)


GROUPS = [
    "tp4_gdn_prefill",
    "tp4_gdn_decode",
    "tp4_moe",
    "tp1_moe",
    "tp1_gdn_decode",
    "tp1_gdn_prefill",
]


def run_parent(args: argparse.Namespace) -> None:
    """Each group runs in its own process (a CUDA fault or an OOM loses that group only);
    results are merged and rewritten to --out after every group."""
    t0 = time.time()
    deadline = t0 + args.budget_s
    parts = Path(args.parts_dir)
    parts.mkdir(parents=True, exist_ok=True)
    for f in parts.glob("*.json"):
        f.unlink()
    merged: dict[str, Any] = {"meta": {}, "floors": {}, "cases": [], "groups": {}}
    out_dir = Path(args.out) if args.out else None

    def save() -> None:
        merged["meta"]["total_s"] = round(time.time() - t0, 1)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "kernel_bench.json").write_text(json.dumps(merged, indent=1))
            (out_dir / "kernel_bench.txt").write_text(render_text(merged))

    for group in ["floors", *[g for g in args.groups.split(",") if g]]:
        left = deadline - time.time()
        if left < 25:
            log(f"SKIP group {group}: {left:.0f}s left")
            merged["groups"][group] = "skipped (deadline)"
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            group,
            "--parts-dir",
            str(parts),
            "--deadline",
            str(deadline),
            "--commit",
            args.commit,
        ]
        if args.dirty:
            cmd.append("--dirty")
        if args.smoke:
            cmd.append("--smoke")
        log(f"GROUP {group}: {' '.join(cmd[2:])}")
        try:
            rc = subprocess.run(cmd, timeout=left + 90).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        merged["groups"][group] = rc
        part = parts / f"{group}.json"
        if part.exists():
            res = json.loads(part.read_text())
            if group == "floors":
                merged["meta"] = res["meta"]
                merged["meta"]["command"] = " ".join(sys.argv)
                merged["floors"] = res["floors"]
            else:
                merged["cases"].extend(res["cases"])
        if rc != 0:
            merged["cases"].append({"case": f"group {group}", "error": f"process exit {rc}"})
        save()
    merged["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save()
    print(render_text(merged), flush=True)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _ms(d: Any) -> str:
    if not isinstance(d, dict):
        return "-"
    if "error" in d:
        return "ERR"
    g, e = d.get("graph_ms"), d.get("eager_ms")
    gs = f"{g:.4f}" if g is not None else "n/a"
    es = f"{e:.4f}" if e is not None else "n/a"
    return f"{gs} / {es}"


def _best(d: Any) -> float | None:
    if not isinstance(d, dict) or "error" in d:
        return None
    return d.get("graph_ms") or d.get("eager_ms")


def _err(v: Any) -> str:
    return f"{v:.1e}" if isinstance(v, (int, float)) else "-"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """Rows: case | baseline | baseline ms (graph / eager) | native | native ms | ratio | floor |
    err baseline | err native | target."""
    rows = []
    for c in results.get("cases", []):
        if "skipped" in c or "error" in c:
            rows.append(
                [
                    c["case"],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    c.get("skipped") or ("ERROR: " + c["error"][:80]),
                ]
            )
            continue
        kind = c.get("kind")
        if kind == "gdn_prefill":
            base = c.get("fla")
            for mode in ("fused", "native_tf32", "native_tf32_trsm", "native_fp32"):
                if mode not in c:
                    continue
                nb, bb = _best(c.get(mode)), _best(base)
                ratio = f"{nb / bb:.2f}x" if nb and bb else "-"
                tgt = gdn_prefill_target(c, mode) if c["tp"] == 4 and c["T"] == 16384 else ""
                rows.append(
                    [
                        f"GDN prefill tp{c['tp']} T={c['T']}",
                        "FLA chunk",
                        _ms(base),
                        mode.replace("native_", "native "),
                        _ms(c.get(mode)),
                        ratio,
                        f"{c['floor_ms']:.3f}",
                        _err(c.get("fla_err")),
                        _err(c.get(f"{mode}_err")),
                        tgt,
                    ]
                )
        elif kind == "gdn_decode":
            base = c.get("fla")
            modes = [m for m in c if m.startswith("native_") and isinstance(c[m], dict)]
            for mode in sorted(modes, key=lambda m: m == "native_packed_api"):
                nb, bb = _best(c.get(mode)), _best(base)
                ratio = f"{nb / bb:.2f}x" if nb and bb else "-"
                tgt = ""
                if c["tp"] == 4 and c["B"] == 64 and mode != "native_packed_api":
                    tgt = ("MET" if nb and bb and nb <= 2 * bb else "not met") + " (<=2x FLA)"
                err_key = f"{mode}_err" if mode != "native_packed_api" else None
                rows.append(
                    [
                        f"GDN decode tp{c['tp']} B={c['B']}",
                        "FLA fused_recurrent",
                        _ms(base),
                        mode.replace("native_", "native "),
                        _ms(c.get(mode)),
                        ratio,
                        f"{c['floor_ms']:.4f}",
                        _err(c.get("fla_err")),
                        _err(c.get(err_key)) if err_key else "-",
                        tgt,
                    ]
                )
        elif kind == "gdn_scan":
            for mode in ("tf32", "fp32"):
                rows.append(
                    [
                        f"GDN chunk scan only tp{c['tp']} T={c['T']}",
                        "-",
                        "-",
                        f"scan {mode} (groups of {c.get('group')})",
                        _ms(c.get(mode)),
                        "-",
                        "-",
                        "-",
                        "-",
                        "breakdown",
                    ]
                )
        elif "rows" in c:
            for r in c["rows"]:
                if "skipped" in r:
                    continue
                base = r.get("gemms_alone")
                for m in ("gather", "grouped", "dense"):
                    nb, bb = _best(r.get(f"native_{m}")), _best(base)
                    ratio = f"{nb / bb:.2f}x" if nb and bb else "-"
                    tgt = ""
                    if r["tp"] == 4:
                        tgt = (
                            "MET" if nb and bb and nb <= 1.5 * bb else "not met"
                        ) + " (<=1.5x GEMMs)"
                    rows.append(
                        [
                            f"MoE decode tp{r['tp']} T={r['T']}",
                            "2 GEMMs alone (gather)",
                            _ms(base),
                            f"native {m}",
                            _ms(r.get(f"native_{m}")),
                            ratio,
                            f"{r['floor_ms']:.4f}",
                            "-",
                            _err(r.get(f"native_{m}_err")),
                            tgt,
                        ]
                    )
        elif kind == "moe_prefill":
            gt = c.get("native_grouped_TFps")
            tgt = ""
            if c["tp"] == 4:
                tgt = ("MET" if gt and gt >= 200 else "not met") + f" (>=200 TF/s: {gt:.0f})"
            rows.append(
                [
                    f"MoE prefill tp{c['tp']} T={c['T']}",
                    f"2 grouped GEMMs alone ({c.get('gemms_alone_TFps', 0):.0f} TF/s)",
                    _ms(c.get("gemms_alone")),
                    "native grouped",
                    _ms(c.get("native_grouped")),
                    f"{_best(c.get('native_grouped')) / _best(c.get('gemms_alone')):.2f}x"
                    if _best(c.get("gemms_alone")) and _best(c.get("native_grouped"))
                    else "-",
                    f"{c['floor_ms']:.3f}",
                    "-",
                    _err(c.get("native_grouped_err_first256")),
                    tgt,
                ]
            )
            if "fused_grouped" in c:
                ft = c["fused_grouped_TFps"]
                rows.append(
                    [
                        f"MoE prefill tp{c['tp']} T={c['T']}",
                        "-",
                        "-",
                        "fused (route/permute/act/combine kernels) + grouped GEMMs",
                        _ms(c["fused_grouped"]),
                        f"{_best(c['fused_grouped']) / _best(c.get('gemms_alone')):.2f}x"
                        if _best(c.get("gemms_alone"))
                        else "-",
                        f"{c['floor_ms']:.3f}",
                        "-",
                        _err(c.get("fused_grouped_err_first256")),
                        ("MET" if ft >= 250 else "not met") + f" (>=250 TF/s: {ft:.0f})",
                    ]
                )
            if "fused_loop" in c:
                rows.append(
                    [
                        f"MoE prefill tp{c['tp']} T={c['T']}",
                        "-",
                        "-",
                        "fused + per-expert mm (no grouped GEMM)",
                        _ms(c["fused_loop"]),
                        "-",
                        f"{c['floor_ms']:.3f}",
                        "-",
                        _err(c.get("fused_loop_err_first256")),
                        "fallback path",
                    ]
                )
            if "native_loop" in c:
                rows.append(
                    [
                        f"MoE prefill tp{c['tp']} T={c['T']}",
                        "-",
                        "-",
                        "native loop (no grouped GEMM)",
                        _ms(c["native_loop"]),
                        "-",
                        f"{c['floor_ms']:.3f}",
                        "-",
                        _err(c.get("native_loop_err_first256")),
                        "fallback path",
                    ]
                )
    return rows


HEADER = [
    "case",
    "baseline",
    "baseline ms (graph / eager)",
    "native",
    "native ms (graph / eager)",
    "native/baseline (best)",
    "floor ms",
    "err baseline",
    "err native",
    "target",
]


def render_text(results: dict[str, Any]) -> str:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    f = results.get("floors", {})
    lines.append("floors: " + ", ".join(f"{k}={v:.1f}" for k, v in f.items()))
    return "\n".join(lines) + "\n"


def render_markdown(results: dict[str, Any], command: str) -> str:
    m = results["meta"]
    f = results.get("floors", {})
    out = [
        "## Kernel timings (H200)",
        "",
        f"- Command (device call, repo root): `{command}`",
        f"- Machine: {m.get('gpu')} ({m.get('sms')} SMs, driver/max SM clock "
        f"{m.get('driver')}), Python {m.get('python')}, torch {m.get('torch')}, "
        f"triton {m.get('triton')}, fla-core {m.get('fla')}, FLA_FLASH_QLA="
        f"{m.get('env', {}).get('FLA_FLASH_QLA')}",
        f"- Commit: `{m.get('commit')}`"
        + (
            " plus uncommitted working-tree files (the native package, tests and this benchmark "
            "were not committed yet)"
            if m.get("dirty_tree")
            else ""
        ),
        f"- Run: {m.get('started')} .. {m.get('finished', '(cut off)')}, {m.get('total_s', '?')} s",
        "- Floors measured in the same run: " + ", ".join(f"{k} {v:.0f}" for k, v in f.items()),
        "- Times are medians in ms, `graph replay / eager`; ratio uses graph replay where it "
        "captured. Errors are relative L2 vs a float64 token-by-token reference on the same "
        "bf16 inputs (GDN: output o; MoE prefill: first 256 tokens). Decode cases rotate "
        "4 (GDN) / 8 (MoE) input sets so states and expert weights do not sit in L2.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for r in table_rows(results):
        out.append("| " + " | ".join(x.replace("|", "/") for x in r) + " |")
    out.append("")
    return "\n".join(out) + "\n"


def append_ledger(json_path: str, command: str, ledger_path: str | None = None) -> None:
    results = json.loads(Path(json_path).read_text())
    ledger = Path(ledger_path) if ledger_path else REPO / "worklogs" / "LEDGER.md"
    if not ledger.exists():
        ledger.write_text("# Ledger\n\n")
    text = ledger.read_text()
    if not text.endswith("\n"):
        text += "\n"
    ledger.write_text(text + "\n" + render_markdown(results, command))
    print(f"appended to {ledger}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder ($OUT)")
    ap.add_argument("--commit", default="unknown", help="git short sha of the tree being run")
    ap.add_argument("--dirty", action="store_true", help="tree has uncommitted files")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no group after this")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run, no FLA")
    ap.add_argument("--ledger-from", help="render results JSON into worklogs/LEDGER.md")
    ap.add_argument("--command", default="", help="exact device command (for --ledger-from)")
    ap.add_argument("--ledger", default=None, help="ledger file (default worklogs/LEDGER.md)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma list of groups to run")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parts-dir", default="/tmp/kernel_bench_parts", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ledger_from:
        append_ledger(args.ledger_from, args.command, args.ledger)
        return
    if args.smoke:
        torch.set_num_threads(1)
    if args.child:
        Bench(args).run_child(args.child)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
