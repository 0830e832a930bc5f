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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cache_sim  # noqa: E402
import perf_metrics as pm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--token-cache", type=Path, default=Path("/tmp/cache_sim_tokens"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    recs = [json.loads(ln) for ln in args.records.read_text(encoding="utf-8").splitlines() if ln]
    reqs, sha = cache_sim.render_dataset(args.dataset, None, args.token_cache)
    last = max(r["index"] for r in recs)
    ideal = pm.ideal_prefix_tokens([r["ids"] for r in reqs[: last + 1]])
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
    }
    print(f"{len(recs)} of {len(reqs)} requests in {span / 60:.1f} min: success "
          f"{pm.pct(out['success'])}, hit {pm.pct(eff['hit'])}, ideal hit "
          f"{pm.pct(eff['ideal_hit'])}, efficiency {pm.pct(eff['efficiency'])} "
          f"({eff['cached_tokens']:,} / {eff['ideal_tokens']:,}); requests below 95 % of their "
          f"ideal: {eff['efficiency_per_request']['n_below_95pct']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
