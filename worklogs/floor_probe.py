#!/usr/bin/env python3
"""Skeleton floors: can a stock-PyTorch-operator implementation reach issue 5's speed targets?

For three of the targets this times, under CUDA-graph replay with the kernel benchmark's
shapes and rotating input sets (``worklogs/kernel_bench.py``, TP4 shard of Qwen3.6-35B-A3B), a
*skeleton*: the few operator calls that every implementation built from stock PyTorch operators
must contain, with all the rest of the math left out (gates, norms, activations, softmax, the
output). A skeleton computes less than the real op, so when even the skeleton is slower than
the target's budget -- measured in the same run -- no composition of stock operators meets the
target; a fused kernel is needed.

* GDN decode, B = 64 (budget 2x FLA ``fused_recurrent_gated_delta_rule``): the states live in
  a slot cache read through arbitrary indices. A stock op either gathers them (``index_select``)
  or updates the cache in place by index (``index_copy_`` / ``index_add_``); the delta rule's
  update needs ``h k`` of the *old* state first, so the state is read by one op and written by
  a later one. Skeletons: gather + one GEMM + in-place rank-1 update + scatter back, and gather
  + one GEMM + delta + ``index_add_``.
* MoE decode, T = 1..32 (budget 1.5x the gather method's two GEMMs on pre-gathered weights):
  a routing top-k (one ``topk``) and then either two expert-block gathers + two GEMMs, two
  grouped GEMMs over all experts (``torch._grouped_mm``, offsets precomputed -- the sort left
  out), or dense GEMMs over every expert.
* MoE prefill, T = 16,384 (budget 200 TF/s = the expert GEMM flops in 1.03 ms): the token rows
  gathered into expert order, the two grouped GEMMs, and the weighted sum back to token order
  (the CSR product; routing, the pair sort and the activation left out).

Usage (GPU host, fla-core installed; see worklogs/LEDGER.md for the exact command)::

    FLA_FLASH_QLA=0 python3 worklogs/floor_probe.py > $OUT/floor_probe.json

``--smoke`` runs tiny shapes eagerly on the CPU (no FLA, no graphs) to check the script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from kernel_bench import MODEL, Timer  # noqa: E402

from vllm_overrides.native import moe  # noqa: E402


def shard(tp: int, smoke: bool) -> dict[str, int]:
    if smoke:
        return {"H": 2, "HV": 4, "K": 32, "V": 32, "E": 16, "hidden": 64, "I": 32, "k": 4}
    return {
        "H": MODEL["k_heads"] // tp, "HV": MODEL["v_heads"] // tp, "K": MODEL["head_k"],
        "V": MODEL["head_v"], "E": MODEL["experts"], "hidden": MODEL["hidden"],
        "I": MODEL["moe_inter"] // tp, "k": MODEL["top_k"],
    }  # fmt: skip


class Probe:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")
        self.timer = Timer(self.dev, smoke)
        self.s = shard(4, smoke)

    def ms(self, fns: list[Callable[[], Any]]) -> float:
        """Graph-replay median on the GPU, eager on the CPU (smoke)."""
        return self.timer.eager(fns) if self.smoke else self.timer.graph(fns)

    # -- GDN decode ------------------------------------------------------------------------------

    def gdn_decode(self, B: int = 64, n_sets: int = 4) -> dict[str, Any]:
        HV, K, V, H = self.s["HV"], self.s["K"], self.s["V"], self.s["H"]
        dev = self.dev
        idx = torch.arange(1, B + 1, device=dev)
        sets = []
        for _ in range(n_sets):
            sets.append({
                "state": torch.randn(B + 1, HV, V, K, device=dev) * 0.05,
                "kq": torch.randn(B * HV, K, 2, device=dev),  # k and q of every value head
                "k": torch.randn(B * HV, 1, K, device=dev),
                "u": torch.randn(B * HV, V, 1, device=dev),
                "q": torch.randn(B, H, K, device=dev, dtype=torch.bfloat16),
                "kb": torch.randn(B, H, K, device=dev, dtype=torch.bfloat16),
                "v": torch.randn(B, HV, V, device=dev, dtype=torch.bfloat16),
                "g": -torch.rand(B, HV, device=dev),
                "beta": torch.rand(B, HV, device=dev),
            })  # fmt: skip

        def gather_scatter(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                st = d["state"].index_select(0, idx)
                d["state"].index_copy_(0, idx, st)

            return f

        def rank1(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                st = d["state"].index_select(0, idx).view(B * HV, V, K)
                torch.bmm(st, d["kq"])  # h k and h q of the old state: one read
                st.baddbmm_(d["u"], d["k"])  # h + u k^T in place (decay left out)
                d["state"].index_copy_(0, idx, st.view(B, HV, V, K))

            return f

        def index_add(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                st = d["state"].index_select(0, idx).view(B * HV, V, K)
                torch.bmm(st, d["kq"])
                delta = torch.baddbmm(st, d["u"], d["k"], beta=-0.1)  # -(1-g) h + u k^T
                d["state"].index_add_(0, idx, delta.view(B, HV, V, K))

            return f

        res: dict[str, Any] = {"case": "gdn_decode", "B": B, **self.s, "rotating_sets": n_sets}
        res["gather_scatter_ms"] = self.ms([gather_scatter(d) for d in sets])
        res["skeleton_rank1_ms"] = self.ms([rank1(d) for d in sets])
        res["skeleton_index_add_ms"] = self.ms([index_add(d) for d in sets])
        fla = _fla_fused_recurrent()
        if fla is not None and not self.smoke:
            cu = torch.arange(B + 1, device=dev, dtype=torch.long)

            def fla_fn(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
                return lambda: fla(
                    d["q"][None], d["kb"][None], d["v"][None], g=d["g"][None],
                    beta=d["beta"][None], scale=K**-0.5, initial_state=d["state"][1:],
                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                    state_v_first=True, cu_seqlens=cu,
                )  # fmt: skip

            res["fla_ms"] = self.ms([fla_fn(d) for d in sets])
            res["budget_ms"] = 2 * res["fla_ms"]
        return res

    # -- MoE decode ------------------------------------------------------------------------------

    def moe_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        E, Hd, I = self.s["E"], self.s["hidden"], self.s["I"]  # noqa: E741
        w13 = (torch.randn(E, 2 * I, Hd, device=self.dev) * Hd**-0.5).bfloat16()
        w2 = (torch.randn(E, Hd, I, device=self.dev) * I**-0.5).bfloat16()
        return w13, w2

    def moe_decode(self, w13: torch.Tensor, w2: torch.Tensor, T: int, n_sets: int = 8) -> dict:
        E, Hd, I, k = self.s["E"], self.s["hidden"], self.s["I"], self.s["k"]  # noqa: E741
        dev, bf = self.dev, torch.bfloat16
        sets = []
        for _ in range(n_sets):
            logits = torch.randn(T, E, device=dev, dtype=bf)
            ids = torch.topk(logits, k, dim=-1).indices
            flat = ids.reshape(-1)
            counts = torch.bincount(flat, minlength=E)
            sets.append({
                "x": torch.randn(T, Hd, device=dev, dtype=bf), "logits": logits, "flat": flat,
                "w13g": w13.index_select(0, flat).view(T, k * 2 * I, Hd),
                "w2g": w2.index_select(0, flat),
                "act": torch.randn(T * k, I, 1, device=dev, dtype=bf),
                "xs": torch.randn(T * k, Hd, device=dev, dtype=bf),
                "acts": torch.randn(T * k, I, device=dev, dtype=bf),
                "ends": counts.cumsum(0).to(torch.int32),
                "actd": torch.randn(E, T, I, device=dev, dtype=bf),
            })  # fmt: skip

        def gemms(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            return lambda: (
                torch.bmm(d["w13g"], d["x"].unsqueeze(-1)),
                torch.bmm(d["w2g"], d["act"]),
            )

        def gather(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                torch.topk(d["logits"], k, dim=-1)
                w13g = moe.gather_blocks(w13, d["flat"]).view(T, k * 2 * I, Hd)
                torch.bmm(w13g, d["x"].unsqueeze(-1))
                torch.bmm(moe.gather_blocks(w2, d["flat"]), d["act"])

            return f

        def grouped(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                torch.topk(d["logits"], k, dim=-1)
                torch._grouped_mm(d["xs"], w13.transpose(1, 2), offs=d["ends"])
                torch._grouped_mm(d["acts"], w2.transpose(1, 2), offs=d["ends"])

            return f

        def dense(d: dict[str, torch.Tensor]) -> Callable[[], Any]:
            def f() -> None:
                torch.topk(d["logits"], k, dim=-1)
                torch.nn.functional.linear(d["x"], w13.view(-1, Hd))
                torch.bmm(d["actd"], w2.transpose(1, 2))

            return f

        res: dict[str, Any] = {"case": "moe_decode", "T": T, "rotating_sets": n_sets}
        res["gemms_alone_ms"] = self.ms([gemms(d) for d in sets])
        res["budget_ms"] = 1.5 * res["gemms_alone_ms"]
        res["topk_ms"] = self.ms([lambda d=d: torch.topk(d["logits"], k, dim=-1) for d in sets])
        res["skeleton_gather_ms"] = self.ms([gather(d) for d in sets])
        res["skeleton_dense_ms"] = self.ms([dense(d) for d in sets])
        if moe.grouped_mm_available(dev):
            res["skeleton_grouped_ms"] = self.ms([grouped(d) for d in sets])
        return res

    # -- MoE prefill -----------------------------------------------------------------------------

    def moe_prefill(self, w13: torch.Tensor, w2: torch.Tensor, T: int) -> dict[str, Any]:
        E, Hd, I, k = self.s["E"], self.s["hidden"], self.s["I"], self.s["k"]  # noqa: E741
        dev, bf = self.dev, torch.bfloat16
        x = torch.randn(T, Hd, device=dev, dtype=bf)
        ids = torch.topk(torch.randn(T, E, device=dev), k, dim=-1).indices
        order, inverse, ends = moe._sorted_pairs(ids, E)
        rows = order // k
        acts = torch.randn(T * k, I, device=dev, dtype=bf)
        flops = 2 * T * k * (2 * I * Hd + Hd * I)
        res: dict[str, Any] = {"case": "moe_prefill", "T": T, "gflop": flops / 1e9}
        res["budget_ms"] = flops / 200e12 * 1e3
        if not moe.grouped_mm_available(dev):
            res["skipped"] = "no torch._grouped_mm on this device"
            return res

        def gemms() -> None:
            torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
            torch._grouped_mm(acts, w2.transpose(1, 2), offs=ends)

        xs = x.index_select(0, rows)
        y = torch._grouped_mm(acts, w2.transpose(1, 2), offs=ends)
        combine = "csr" if moe.csr_combine_available(dev, bf) else "gather"

        def skeleton() -> None:
            xg = x.index_select(0, rows)
            torch._grouped_mm(xg, w13.transpose(1, 2), offs=ends)
            yy = torch._grouped_mm(acts, w2.transpose(1, 2), offs=ends)
            moe._combine(yy, inverse, k, combine)

        res["gemms_alone_ms"] = self.ms([gemms])
        res["gather_x_ms"] = self.ms([lambda: x.index_select(0, rows)])
        res[f"combine_{combine}_ms"] = self.ms([lambda: moe._combine(y, inverse, k, combine)])
        res["skeleton_ms"] = self.ms([skeleton])
        res["skeleton_TFps"] = flops / (res["skeleton_ms"] * 1e-3) / 1e12
        return res


def _fla_fused_recurrent() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - FLA is optional (CPU smoke runs)
        return None
    return fused_recurrent_gated_delta_rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, eager, CPU")
    args = ap.parse_args()
    p = Probe(args.smoke)
    torch.manual_seed(0)
    out: dict[str, Any] = {"device": str(p.dev), "torch": torch.__version__, "cases": []}
    if p.dev.type == "cuda":
        out["device"] = torch.cuda.get_device_name()
    out["cases"].append(p.gdn_decode(4 if args.smoke else 64))
    w13, w2 = p.moe_weights()
    for T in (1, 2) if args.smoke else (1, 4, 16, 32):
        out["cases"].append(p.moe_decode(w13, w2, T))
    out["cases"].append(p.moe_prefill(w13, w2, 64 if args.smoke else 16384))
    for c in out["cases"]:
        sk = {k: v for k, v in c.items() if k.startswith("skeleton") and k.endswith("_ms")}
        best = min(sk.values()) if sk else float("nan")
        budget = c.get("budget_ms", float("nan"))
        c["best_skeleton_ms"] = best
        c["skeleton_over_budget"] = best / budget if budget == budget else None
        label = c["case"] + (f" T={c['T']}" if "T" in c else f" B={c.get('B')}")
        print(
            f"{label:24s} budget {budget:8.4f} ms  best skeleton {best:8.4f} ms  "
            + "  ".join(f"{k} {v:.4f}" for k, v in c.items() if k.endswith("_ms")),
            file=sys.stderr,
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
