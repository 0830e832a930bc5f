#!/usr/bin/env python3
"""Hit and cache efficiency of a replay that was cut short, from its record log.

    python worklogs/replay_partial.py --records worklogs/results/replay881_tiny-cpu.records.jsonl \\
        --dataset build/replay/replay881.jsonl [--out F.json]

``formal_perf_bench.py --record-log`` (and ``replay_e2e.py``) append each request's record as it
ends; the bench's own token-level ideal (``/tokenize`` on the server) comes only at the end of a
whole run. Here the ideal of each replayed request is its longest common token prefix with any
earlier request of the dataset, with the token ids rendered as ``cache_sim.py`` renders them
(chat template + the real tokenizer; images as their text parts only, so the 27 image requests of
replay881 may differ from the server's ids by their placeholders), capped at the server's
``prompt_tokens - 1``. Prints the totals (success, hit, efficiency) and writes them as JSON.

It also projects the whole run's wall time on the same machine: the prefill cost
``t = a N + b (N C + N^2 / 2)`` (``perf_metrics.fit_prefill_cost``) fitted to the records' TTFTs
(``N`` new and ``C`` cached tokens), plus their mean time after the first token, applied to every
request of the dataset with ``C`` = its ideal times the efficiency reached so far (``projection``;
checked against the records' own measured time). With ``--memory`` (``replay_e2e.py``'s
``<out>.memory.jsonl``, appended as sampled) it adds the server's RSS start, end and growth;
``--plot`` draws tokens and efficiency per request and the RSS over the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cache_sim  # noqa: E402
import perf_metrics as pm  # noqa: E402
import replay_e2e  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--token-cache", type=Path, default=Path("/tmp/cache_sim_tokens"))
    ap.add_argument("--memory", type=Path, help="replay_e2e's <out>.memory.jsonl, if kept")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG: tokens, efficiency and RSS per request")
    args = ap.parse_args(argv)

    recs = [json.loads(ln) for ln in args.records.read_text(encoding="utf-8").splitlines() if ln]
    reqs, sha = cache_sim.render_dataset(args.dataset, None, args.token_cache)
    ideal = pm.ideal_prefix_tokens([r["ids"] for r in reqs])
    for r in recs:
        if r.get("prompt_tokens"):
            r["ideal_tokens"] = min(int(ideal[r["index"]]), int(r["prompt_tokens"]) - 1)
    eff = pm.cache_efficiency(recs)
    ok = sum(r["status"] == "ok" for r in recs)
    span = max(r["t_end"] for r in recs) - min(r["t_start"] for r in recs)
    out = {
        "records": str(args.records),
        "dataset": {"path": str(args.dataset), "sha256": sha, "n_requests": len(reqs)},
        "n_done": len(recs),
        "n_ok": ok,
        "success": ok / len(recs),
        "statuses": {s: sum(r["status"] == s for r in recs) for s in {r["status"] for r in recs}},
        "wall_s": span,
        **{k: v for k, v in eff.items() if k != "n"},
        "projection": projection(recs, [len(r["ids"]) for r in reqs], ideal, eff["efficiency"]),
    }
    if args.memory is not None:
        mem = [json.loads(ln) for ln in args.memory.read_text(encoding="utf-8").splitlines() if ln]
        ts = [m["t_s"] for m in mem]
        every = float(np.median(np.diff(ts))) if len(ts) > 1 else 0.0
        out["memory"] = replay_e2e.memory_summary([(m["t_s"], m["rss"]) for m in mem], every)
        if (m := out["memory"])["n"]:
            print(f"server RSS {m['start_mib']:,} -> {m['end_mib']:,} MiB ({m['growth_pct']} %), "
                  f"max {m['max_mib']:,}, {m['n']} samples")  # fmt: skip
    print(f"{len(recs)} of {len(reqs)} requests in {span / 60:.1f} min: success "
          f"{pm.pct(out['success'])}, hit {pm.pct(eff['hit'])}, ideal hit "
          f"{pm.pct(eff['ideal_hit'])}, efficiency {pm.pct(eff['efficiency'])} "
          f"({eff['cached_tokens']:,} / {eff['ideal_tokens']:,}); requests below 95 % of their "
          f"ideal: {eff['efficiency_per_request']['n_below_95pct']}")  # fmt: skip
    if pj := out["projection"]:
        print(f"projected wall time of all {len(reqs)}: {pj['all_s'] / 3600:.2f} h "
              f"({pj['rest_s'] / 3600:.2f} h after the last record; the model gives "
              f"{pj['done_model_s'] / 60:.1f} min for the {len(recs)} done, measured "
              f"{pj['done_measured_s'] / 60:.1f})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(recs, mem if args.memory is not None else [], args.plot, f"{args.records.name}: "
             f"{len(recs)} of {len(reqs)} requests")  # fmt: skip
    return 0


def plot(recs: list[dict], mem: list[dict], path: Path, title: str) -> None:
    """Per request: prompt, ideal and cached tokens, and cached / ideal; the server's RSS over
    the run (where a memory log was given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in recs if r.get("prompt_tokens")), key=lambda r: r["index"])
    idx = [r["index"] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    for key, style in (("prompt_tokens", "k-"), ("ideal_tokens", "b-"), ("cached_tokens", "g.")):
        ax.plot(idx, [r[key] for r in ok], style, lw=0.8, ms=3, label=key.replace("_", " "))
    ax.set_xlabel("request")
    ax.set_title("tokens per request")
    ax.legend()
    ax = axes[1]
    eff = [(r["index"], r["cached_tokens"] / r["ideal_tokens"]) for r in ok if r["ideal_tokens"]]
    if eff:
        ax.plot(*zip(*eff, strict=True), "g.", ms=3)
    ax.axhline(pm.EFFICIENCY_TARGET, color="red", ls="--", label=f"{pm.EFFICIENCY_TARGET:.0%}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("request")
    ax.set_title("cached / ideal (requests with an ideal > 0)")
    ax.legend()
    ax = axes[2]
    if mem:
        ax.plot([m["t_s"] / 60 for m in mem], [m["rss"] / 2**20 for m in mem], "m-", lw=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("minutes")
    ax.set_title("server RSS (MiB), all its processes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def projection(
    recs: list[dict], prompt_lens: list[int], ideal: list[int], efficiency: float
) -> dict[str, float] | None:
    """Whole-run wall time from the records' cost model (see the module's docstring); None
    without a successful record."""
    ok = [r for r in recs if r["status"] == "ok" and r.get("t_first_token") is not None]
    if not ok:
        return None
    new = [r["prompt_tokens"] - r["cached_tokens"] for r in ok]
    cached = [r["cached_tokens"] for r in ok]
    a, b = pm.fit_prefill_cost(new, cached, [pm.ttft_s(r) for r in ok])
    tail = float(np.mean([r["t_end"] - r["t_first_token"] for r in ok]))
    done_model = sum(
        pm.prefill_seconds(a, b, n, c) + tail for n, c in zip(new, cached, strict=True)
    )
    per_req = []
    for p, i in zip(prompt_lens, ideal, strict=True):
        c = min(i * efficiency, p - 1)
        per_req.append(pm.prefill_seconds(a, b, p - c, c) + tail)
    last = max(r["index"] for r in recs)
    return {
        "a_s_per_token": a,
        "b_s_per_pair": b,
        "after_first_token_s": tail,
        "done_measured_s": sum(r["t_end"] - r["t_start"] for r in ok),
        "done_model_s": done_model,
        "all_s": float(sum(per_req)),
        "rest_s": float(sum(per_req[last + 1 :])),
    }


if __name__ == "__main__":
    sys.exit(main())
