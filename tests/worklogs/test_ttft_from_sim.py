"""worklogs/ttft_from_sim.py: the fitted prefill cost model and the TTFT it gives each
simulated request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import perf_metrics as pm  # noqa: E402
import ttft_from_sim  # noqa: E402

A, B = 5e-5, 2e-9  # s per token, s per causal pair


def _t(n: int, c: int) -> float:
    return A * n + B * (n * c + n * n / 2)


def test_fit_recovers_the_cost_model_and_applies_it(tmp_path: Path) -> None:
    cases = [
        {"variant": "cuda", "mode": "fresh", "tokens": 8192, "target": {"ms": 1e3 * _t(8192, 0)}},
        {"variant": "cuda", "mode": "fresh", "tokens": 16384, "target": {"ms": 1e3 * _t(16384, 0)}},
        {"variant": "cuda", "mode": "resume", "tokens": 16384,
         "target": {"ms": 1e3 * _t(16384, 16384)}},
        {"variant": "fla", "mode": "fresh", "tokens": 16384, "target": {"ms": 1.0}},
    ]  # fmt: skip
    a, b = ttft_from_sim.fit(cases, "cuda")
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)

    recs = [{"prompt_tokens": 10_000, "cached_tokens": c, "status": "ok"} for c in range(0, 10_000, 100)]
    sim = {"runs": [{"config": {"offload_gib": 128, "capacity_scale": 1.0}, "hit": 0.5,
                     "records": recs},
                    {"config": {"offload_gib": 0, "capacity_scale": 1.0, "mnbt": 1024}, "hit": 0.5,
                     "records": recs}]}  # fmt: skip
    (tmp_path / "bench.json").write_text(json.dumps({"cases": cases}))
    (tmp_path / "sim.json").write_text(json.dumps(sim))
    out = tmp_path / "out.json"
    assert ttft_from_sim.main(["--prefill", str(tmp_path / "bench.json"), "--sim",
                               str(tmp_path / "sim.json"), "--out", str(out)]) == 0  # fmt: skip
    run = json.loads(out.read_text())["runs"][0]
    warm = sorted(_t(10_000 - r["cached_tokens"], r["cached_tokens"]) for r in recs)
    assert run["ttft_s"]["p50"] == pytest.approx((warm[49] + warm[50]) / 2, rel=1e-6)
    assert run["ttft_cold_s"]["p90"] == pytest.approx(_t(10_000, 0), rel=1e-6)
    # tp4: each request's TTFT plus its uncached tokens' all-reduces and chunk re-reads
    chunk = pm.prefill_chunk_tokens()[0]
    assert set(run["tp4_ttft_s"]) == {f"{g:g}" for g in pm.CARD_TP4["link_GBps"]}
    full = sorted(_t(10_000 - r["cached_tokens"], r["cached_tokens"])
                  + pm.tp4_overhead_s(10_000 - r["cached_tokens"], 16.0, chunk) for r in recs)  # fmt: skip
    assert run["tp4_ttft_s"]["16"]["p50"] == pytest.approx((full[49] + full[50]) / 2, rel=1e-6)
    assert run["tp4_ttft_s"]["8"]["p90"] > run["tp4_ttft_s"]["16"]["p90"] > run["ttft_s"]["p90"]
    # a simulated run at another chunk size takes its own: more chunks, more latencies, re-reads
    small = json.loads(out.read_text())["runs"][1]
    full = sorted(_t(10_000 - r["cached_tokens"], r["cached_tokens"])
                  + pm.tp4_overhead_s(10_000 - r["cached_tokens"], 16.0, 1024) for r in recs)  # fmt: skip
    assert small["tp4_ttft_s"]["16"]["p50"] == pytest.approx((full[49] + full[50]) / 2, rel=1e-6)
    assert small["tp4_ttft_s"]["16"]["p50"] > run["tp4_ttft_s"]["16"]["p50"]
