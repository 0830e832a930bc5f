#!/usr/bin/env python3
"""Paper TTFT on the target card for each configuration of a cache simulation.

    python worklogs/ttft_from_sim.py --prefill worklogs/results/<run>/prefill_step_bench.json \\
        --sim worklogs/results/cache-sim-replay881-offload.json [--variant cuda] [--out F.json]

The prefill step bench (``decode_step_bench.py --prefill``) scales its H200 step times to the
target card (its ``target`` figures: GEMMs at the card's assumed fp16 rate, the rest by copy
bandwidth). From one variant's fresh and resumed rows this fits ``t(N, C) = a N + b (N C + N^2/2)``
for ``N`` new tokens after ``C`` cached ones (``b``: attention per causal pair), then applies it
to every request of each simulated run (``cache_sim.py``: per request prompt and cached tokens)
and prints the TTFT percentiles. Prefill only, one rank; the ``tp4`` figures add what one
rank's step leaves out (``perf_metrics.tp4_overhead_s``: the TP4 all-reduces at each of the
card's assumed link rates, ``--link-gbps``, and the weights re-read by every further chunk of
computility-run.yaml's ``--max-num-batched-tokens``). The first decode step, queueing and the
vision tower are left out, as in the bench's own estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher: the chunk size
sys.path.insert(0, str(Path(__file__).resolve().parent))

import perf_metrics as pm  # noqa: E402

QS = (50, 90, 99)


def fit(cases: list[dict], variant: str) -> tuple[float, float]:
    """The cost model over the variant's rows: fresh ones have C = 0, resumed ones C = N."""
    rows = [r for r in cases if r.get("variant") == variant and "target" in r]
    if not rows:
        raise SystemExit(f"no rows of variant {variant!r} with target figures")
    n = [r["tokens"] for r in rows]
    c = [r["tokens"] if r.get("mode") == "resume" else 0 for r in rows]
    return pm.fit_prefill_cost(n, c, [r["target"]["ms"] / 1e3 for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=Path, required=True, help="prefill_step_bench.json")
    ap.add_argument("--sim", type=Path, required=True, help="cache_sim.py result JSON")
    ap.add_argument("--variant", default="cuda", help="cuda (ours), fla or torch")
    ap.add_argument("--link-gbps", type=float, nargs="+", default=list(pm.CARD_TP4["link_GBps"]),
                    help="the card's all-reduce bus bandwidths to assume, GB/s")  # fmt: skip
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    chunk, chunk_source = pm.prefill_chunk_tokens()

    bench = json.loads(args.prefill.read_text(encoding="utf-8"))
    a, b = fit(bench["cases"], args.variant)
    sim = json.loads(args.sim.read_text(encoding="utf-8"))
    runs = []
    for run in sim["runs"]:
        recs = [r for r in run["records"] if r.get("status") == "ok"]
        p = np.array([r["prompt_tokens"] for r in recs], dtype=float)
        c = np.array([r["cached_tokens"] for r in recs], dtype=float)
        n = p - c
        warm = pm.prefill_seconds(a, b, n, c)
        cold = pm.prefill_seconds(a, b, p, 0.0)
        run_chunk = run["config"].get("mnbt", chunk)  # the simulated engine's chunk
        tp4 = {f"{g:g}": pm.tp4_overhead_s(n, g, run_chunk) for g in args.link_gbps}
        runs.append({
            "config": run["config"],
            "hit": run["hit"],
            "ttft_cold_s": {f"p{q}": float(np.percentile(cold, q)) for q in QS},
            "ttft_s": {f"p{q}": float(np.percentile(warm, q)) for q in QS},
            "uncached_tokens": {f"p{q}": float(np.percentile(n, q)) for q in QS},
            "tp4_ttft_s": {g: {f"p{q}": float(np.percentile(warm + o, q)) for q in QS}
                           for g, o in tp4.items()},
        })  # fmt: skip
    links = [f"{g:g}" for g in args.link_gbps]
    rows = [
        (f"{r['config'].get('offload_gib', 0):g}", f"{r['config']['capacity_scale']:g}",
         pm.pct(r["hit"]), f"{r['uncached_tokens']['p90']:,.0f}",
         *(f"{r['ttft_s'][f'p{q}']:.2f}" for q in QS), f"{r['ttft_cold_s']['p90']:.2f}",
         *(f"{r['tp4_ttft_s'][g]['p90']:.2f}" for g in links))
        for r in runs
    ]  # fmt: skip
    print(f"variant {args.variant}: a = {a:.3e} s/token, b = {b:.3e} s/pair (card, paper)")
    print(pm.render_table(rows, ("cpu GiB", "cap x", "hit", "new tok P90", "TTFT P50",
                                 "P90", "P99", "cold P90",
                                 *(f"tp4 P90 @{g} GB/s" for g in links))))  # fmt: skip
    print(f"tp4 = TTFT + the TP4 all-reduces at the link rate + weights re-read every further "
          f"chunk (each run's mnbt, else {chunk}: {chunk_source}); gate: P90 <= "
          f"{pm.GATE_TTFT_P90_S:g} s; "
          f"link rates: {pm.CARD_TP4['link_GBps_source']}")  # fmt: skip
    result = {"prefill": str(args.prefill), "sim": str(args.sim), "variant": args.variant,
              "a_s_per_token": a, "b_s_per_pair": b, "card": bench.get("target_card"),
              "tp4": {**pm.CARD_TP4, "link_GBps": args.link_gbps, "chunk_tokens": chunk,
                      "chunk_source": chunk_source},
              "runs": runs}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
