#!/usr/bin/env python3
"""Short-prompt decode benchmark: TTFT P90, Output TPS P10 (per request) and aggregate TPS.

Usage::

    python worklogs/decode_microbench.py --base-url http://127.0.0.1:8000 -c 4 \\
        --output-tokens 256 --repeats 3 [--out worklogs/results/decode.json]

Each repeat sends ``c`` requests at once (a wave) and waits for all of them; every request has
a unique short prompt (no prefix-cache help) and decodes exactly ``--output-tokens`` tokens
(``ignore_eos``, a vLLM extension; ``--allow-eos`` to leave it out). Metrics come from the same
``perf_metrics.compute_metrics`` as the replay benchmark, over all waves; the table also lists
each wave's aggregate Output TPS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import perf_client  # noqa: E402
import perf_metrics as pm  # noqa: E402

SCHEMA = "decode_microbench/1"


def make_spec(model: str, k: int, output_tokens: int, ignore_eos: bool) -> perf_client.RequestSpec:
    body: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": output_tokens, "temperature": 0.7,
        "messages": [{"role": "user", "content":
                      f"Request {k}: write a long story about a lighthouse keeper and the sea."}],
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return perf_client.RequestSpec(f"decode-{k:04d}", body)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("-c", "--concurrency", type=int, default=1)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="llm")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--allow-eos", action="store_true", help="do not send ignore_eos")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--label")
    ap.add_argument("--out", help="result JSON (default: print only)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    args = ap.parse_args(argv)

    info = perf_client.server_info(args.base_url, args.api_key)
    if not args.no_warmup:  # first request pays one-time costs (graph capture, allocations)
        asyncio.run(perf_client.run_specs(
            args.base_url, [make_spec(args.model, 99_999, 8, not args.allow_eos)], 1,
            args.timeout, args.api_key, progress_label="warmup "))
    t_ref = time.perf_counter()
    records: list[dict[str, Any]] = []
    waves = []
    for rep in range(args.repeats):
        specs = [make_spec(args.model, rep * args.concurrency + i, args.output_tokens,
                           not args.allow_eos) for i in range(args.concurrency)]
        recs = asyncio.run(perf_client.run_specs(
            args.base_url, specs, args.concurrency, args.timeout, args.api_key,
            progress_label=f"wave {rep + 1}/{args.repeats} ", t_ref=t_ref))
        for r in recs:
            r["wave"] = rep
        records += recs
        waves.append(pm.compute_metrics(recs))
    metrics = pm.compute_metrics(records)
    result = {
        "schema": SCHEMA, "label": args.label,
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None
        else shlex.join(["decode_microbench.py", *argv]),
        "params": vars(args) | {"api_key": None},
        "server": info, "environment": perf_client.run_environment(),
        "metrics": metrics,
        "waves": [{"output_tps": w["output_tps"], "ttft_p90": w["ttft_s"]["p90"],
                   "output_tps_p10": w["output_tps_evaluator"]["p10"]} for w in waves],
        "records": records,
    }
    rows = [
        ("requests (ok / total)", f"{metrics['n_ok']} / {metrics['n_requests']}"),
        ("concurrency x output tokens", f"{args.concurrency} x {args.output_tokens}"),
        ("TTFT P90 (s)", pm.fmt(metrics["ttft_s"]["p90"], 3)),
        ("Output TPS P10 (evaluator: tok / whole)",
         pm.fmt(metrics["output_tps_evaluator"]["p10"])),
        ("Output TPS P10 (decode: tok / after TTFT)", pm.fmt(metrics["output_tps_decode"]["p10"])),
        ("Output TPS aggregate (all waves)", pm.fmt(metrics["output_tps"])),
        ("Output TPS aggregate per wave", ", ".join(pm.fmt(w["output_tps"]) for w in waves)),
        ("completion tokens", pm.fmt(metrics["completion_tokens"])),
    ]
    print(pm.render_table(rows, ("decode microbench", "value")))
    for r in records:
        if r["status"] != "ok":
            print(f"  FAILED {r['id']}: {r['status']} {r.get('http_status')} {r.get('error')}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    else:
        print(json.dumps({k: result[k] for k in ("label", "params", "waves")} |
                         {"metrics": {k: metrics[k] for k in ("ttft_s", "output_tps_evaluator",
                                                              "output_tps", "success_rate")}},
                         indent=1))
    return 0 if metrics["n_ok"] == metrics["n_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
