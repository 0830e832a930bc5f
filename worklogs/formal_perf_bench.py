#!/usr/bin/env python3
"""Replay a generated dataset against a server, streaming, and score it like the platform.

Usage::

    python worklogs/formal_perf_bench.py --base-url http://127.0.0.1:8000 \\
        --dataset /tmp/quick8.jsonl --out worklogs/results/quick8.json [-c 1] [-r 8] \\
        [--max-tokens 32] [--output-len body|target|exact] [--label "v0.1 tp4"]
    python worklogs/formal_perf_bench.py --compare A.json B.json

Per request it records start, TTFT (first chunk with content, reasoning or a tool call), end,
usage (prompt / completion / cached tokens), status and error; timeouts and failures stay in the
records. The metrics (``perf_metrics.compute_metrics``) are a pure function of the records and
are recomputed by the tests. Writes RESULT.json (command, dataset hash, server info, params,
environment, preflight, metrics, records), RESULT.png (distributions), prints a table and the
markdown row for ``worklogs/LEDGER.md``.

Output length (``--output-len``):

* ``body`` (default): send ``max_completion_tokens`` as recorded (mostly 8192, as the
  platform does); the model decides when to stop, exactly like the evaluator's replay;
* ``target``: cap at the dataset's ``target_output_tokens`` (input:output = 60:1 overall);
* ``exact``: ``target`` plus vLLM's ``ignore_eos`` so every request decodes exactly its target
  (reproducible throughput numbers, also with random-weight models that never emit EOS).

``--max-tokens N`` replaces the per-request value in any mode.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import perf_client  # noqa: E402
import perf_metrics as pm  # noqa: E402

SCHEMA = "formal_perf_bench/1"


def load_dataset(path: str, limit: int | None) -> tuple[list[dict[str, Any]], str]:
    h = hashlib.sha256()
    lines = []
    with open(path, "rb") as f:
        for raw in f:
            h.update(raw)
            if raw.strip():
                lines.append(json.loads(raw))
    if limit is not None:
        lines = lines[:limit]
    return lines, h.hexdigest()


def build_specs(lines: Sequence[dict[str, Any]], output_len: str, max_tokens: int | None,
                model: str | None) -> list[perf_client.RequestSpec]:
    specs = []
    for ln in lines:
        meta = ln.get("meta", {})
        body = dict(ln["body"])
        if model:
            body["model"] = model
        if output_len in ("target", "exact") and meta.get("target_output_tokens"):
            body["max_completion_tokens"] = int(meta["target_output_tokens"])
        if max_tokens is not None:
            body["max_completion_tokens"] = max_tokens
        if output_len == "exact":
            body["ignore_eos"] = True
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        specs.append(perf_client.RequestSpec(
            id=ln.get("id", f"req-{len(specs)}"), body=body, session_id=meta.get("session_id"),
            counted_tokens=meta.get("counted_tokens"),
            extra={"turn": meta.get("turn"), "target_output_tokens":
                   meta.get("target_output_tokens")}))
    return specs


def overhead_stats(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Server prompt_tokens minus the generator's counted tokens: the chat template's share."""
    diffs = [r["prompt_tokens"] - r["counted_tokens"] for r in records
             if r.get("status") == "ok" and r.get("counted_tokens") is not None
             and r.get("prompt_tokens") is not None]
    if not diffs:
        return {"n": 0}
    return {"n": len(diffs), "min": min(diffs), "median": pm.percentile(diffs, 50),
            "max": max(diffs)}


def add_ideal(base_url: str, specs: Sequence[perf_client.RequestSpec],
              records: list[dict[str, Any]], api_key: str | None) -> dict[str, Any]:
    """Per record ``ideal_tokens``: the longest common prefix, in the server's own token ids
    (``/tokenize`` with the chat template), with any earlier request of the run (capped at
    prompt - 1: vLLM always computes a prompt's last token); and the run's cache efficiency
    (cached / ideal). Tokenized after the replay, so it never competes with it for the server.
    """
    tokens = perf_client.tokenize_chat(base_url, [s.body for s in specs], api_key)
    known = [i for i, t in enumerate(tokens) if t is not None]
    ideal = pm.ideal_prefix_tokens([tokens[i] for i in known])
    for i, lcp in zip(known, ideal, strict=True):
        rec, n = records[i], len(tokens[i] or ())
        rec["tokenized_prompt_tokens"] = n
        rec["ideal_tokens"] = min(lcp, n - 1)
    eff = pm.cache_efficiency(records)
    eff["n_not_tokenized"] = len(specs) - len(known)
    return eff


def efficiency_table(records: Sequence[dict[str, Any]], limit: int = 40) -> str:
    rows = [(r["id"], r.get("session_id") or "", r.get("prompt_tokens"), r.get("ideal_tokens"),
             r.get("cached_tokens"),
             pm.pct(r["cached_tokens"] / r["ideal_tokens"]) if r.get("ideal_tokens")
             and r.get("cached_tokens") is not None else "-")
            for r in records[:limit]]
    more = f"\n  ... {len(records) - limit} more in the JSON" if len(records) > limit else ""
    return pm.render_table(rows, ("request", "session", "prompt", "ideal", "cached",
                                  "cached/ideal")) + more


def print_report(result: dict[str, Any], out_path: str) -> None:
    m = result["metrics"]
    print(pm.render_table(pm.metrics_rows(m), ("metric", "value")))
    eff = result.get("cache_efficiency")
    if eff and eff.get("n"):
        print("\n" + efficiency_table(result["records"]))
        print(f"\ncache efficiency (cached / token-level ideal): {pm.pct(eff['efficiency'])} "
              f"= {eff['cached_tokens']:,} / {eff['ideal_tokens']:,}; ideal hit "
              f"{pm.pct(eff['ideal_hit'])}, hit {pm.pct(eff['hit'])}; per request p10 "
              f"{pm.pct(eff['efficiency_per_request']['p10'])}, "
              f"{eff['efficiency_per_request']['n_below_95pct']} of "
              f"{eff['efficiency_per_request']['n']} below 95 %")
    ov = result.get("template_overhead", {})
    if ov.get("n"):
        print(f"\nserver prompt_tokens - counted tokens (template overhead): min {ov['min']}, "
              f"median {ov['median']:.0f}, max {ov['max']} over {ov['n']} requests")
    fails = [r for r in result["records"] if r["status"] != "ok"]
    for r in fails[:5]:
        print(f"  FAILED {r['id']}: {r['status']} {r.get('http_status')} {r.get('error')}")
    print("\nLEDGER row:")
    print(pm.ledger_row(result.get("label") or "?", out_path, m))


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    # recompute from the records so the comparison never trusts stale stored metrics
    ma, mb = pm.compute_metrics(a["records"]), pm.compute_metrics(b["records"])
    print(f"A = {a_path} ({a.get('label')})\nB = {b_path} ({b.get('label')})")
    print(pm.render_table(pm.compare_rows(ma, mb), ("metric", "A", "B", "B / A")))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--dataset")
    ap.add_argument("--out", help="result JSON (a PNG is written next to it)")
    ap.add_argument("-c", "--concurrency", type=int, default=1)
    ap.add_argument("-r", "--requests", type=int, help="replay only the first N requests")
    ap.add_argument("--max-tokens", type=int, help="max_completion_tokens for every request")
    ap.add_argument("--output-len", choices=("body", "target", "exact"), default="body")
    ap.add_argument("--model", help="override the body's model name (default: as in dataset)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    ap.add_argument("--label", help="version/config for the ledger row")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--no-session-deps", action="store_true",
                    help="do not wait for a session's previous request before sending the next")
    ap.add_argument("--no-preflight", action="store_true")
    ap.add_argument("--reset-prefix-cache", action="store_true",
                    help="POST /reset_prefix_cache first (vLLM with VLLM_SERVER_DEV_MODE=1); "
                    "without it a rerun of the same dataset on the same server starts warm")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--record-log", type=Path,
                    help="append each request's record to this JSON-lines file as it ends")
    ap.add_argument("--no-ideal", action="store_true",
                    help="skip the /tokenize pass (token-level ideal and cache efficiency)")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.dataset or not args.out:
        ap.error("--dataset and --out are required (unless --compare)")

    lines, sha = load_dataset(args.dataset, args.requests)
    specs = build_specs(lines, args.output_len, args.max_tokens, args.model)
    model = args.model or (specs[0].body.get("model") if specs else "llm")
    info = perf_client.server_info(args.base_url, args.api_key)
    env = perf_client.run_environment()
    reset = None
    if args.reset_prefix_cache:
        reset = perf_client.reset_prefix_cache(args.base_url, args.api_key)
        if not reset.get("ok"):
            print(f"WARNING: prefix cache not reset: {reset}", file=sys.stderr)
    preflight = None
    if not args.no_preflight:
        # the platform's first request; kept out of the metrics, but a failure is reported
        preflight = asyncio.run(perf_client.run_specs(
            args.base_url, [perf_client.preflight_spec(model)], 1, min(args.timeout, 300),
            args.api_key, progress_label="preflight "))[0]
        if preflight["status"] != "ok":
            print(f"WARNING: preflight failed: {preflight['status']} {preflight['error']}",
                  file=sys.stderr)
    if args.record_log:
        args.record_log.write_text("", encoding="utf-8")  # this run's records only
    t_wall0 = time.time()
    records = asyncio.run(perf_client.run_specs(
        args.base_url, specs, args.concurrency, args.timeout, args.api_key,
        session_deps=not args.no_session_deps, progress_label="replay ",
        record_log=args.record_log))
    metrics = pm.compute_metrics(records)
    efficiency = None if args.no_ideal else add_ideal(args.base_url, specs, records,
                                                      args.api_key)
    result = {
        "schema": SCHEMA,
        "label": args.label,
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None
        else shlex.join(["formal_perf_bench.py", *argv]),
        "dataset": {"path": os.path.abspath(args.dataset), "sha256": sha,
                    "n_requests_used": len(lines),
                    "preset": lines[0].get("meta", {}).get("preset") if lines else None,
                    "seed": lines[0].get("meta", {}).get("seed") if lines else None},
        "params": {"base_url": args.base_url, "concurrency": args.concurrency,
                   "requests": args.requests, "max_tokens": args.max_tokens,
                   "output_len": args.output_len, "timeout_s": args.timeout,
                   "session_deps": not args.no_session_deps, "model": model},
        "server": info,
        "environment": env,
        "started_at_unix": t_wall0,
        "prefix_cache_reset": reset,
        "preflight": preflight,
        "metrics": metrics,
        "cache_efficiency": efficiency,
        "template_overhead": overhead_stats(records),
        "records": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if not args.no_plot:
        png = os.path.splitext(args.out)[0] + ".png"
        pm.plot_distributions(records, metrics, png,
                              f"{args.label or ''} {os.path.basename(args.dataset)} "
                              f"c={args.concurrency}".strip())
    rel = os.path.relpath(args.out)
    print_report(result, args.out if rel.startswith("..") else rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
