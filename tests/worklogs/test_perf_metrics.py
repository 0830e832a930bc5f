"""Metric math of worklogs/perf_metrics.py on hand-made records with known answers."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import perf_metrics as pm  # noqa: E402


def rec(status: str, t_start: float, t_first: float | None, t_end: float, prompt: int | None = None,
        cached: int | None = None, completion: int | None = None) -> dict:
    return {"status": status, "t_start": t_start, "t_first_token": t_first, "t_end": t_end,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}


# Two successes and one failure over a 100 s window. Cached 50,773 and uncached 17,684 prompt
# tokens give Cache TPS 507.73 and Input TPS 176.84, i.e. hit 507.73 / (176.84 + 507.73).
RECORDS = [
    rec("ok", 0.0, 1.0, 5.0, prompt=30_000, cached=20_000, completion=200),
    rec("ok", 2.0, 2.5, 100.0, prompt=38_457, cached=30_773, completion=400),
    rec("http_error", 3.0, None, 3.1),
]


def test_percentile_definition() -> None:
    xs = list(range(1, 11))
    assert pm.percentile(xs, 10) == pytest.approx(1.9)
    assert pm.percentile(xs, 50) == pytest.approx(5.5)
    assert pm.percentile(xs, 90) == pytest.approx(9.1)
    assert pm.percentile(xs, 0) == 1 and pm.percentile(xs, 100) == 10
    assert pm.percentile([7.0], 90) == 7.0
    assert pm.percentile([], 50) is None
    assert pm.percentile([3, 1, 2], 50) == 2  # order of the input does not matter
    with pytest.raises(ValueError):
        pm.percentile(xs, 101)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
       st.floats(0, 100))
def test_percentile_matches_numpy_linear(xs: list[float], q: float) -> None:
    np = pytest.importorskip("numpy")
    assert pm.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9,
                                                 abs=1e-6)


def test_known_answers() -> None:
    m = pm.compute_metrics(RECORDS)
    assert m["n_requests"] == 3 and m["n_ok"] == 2
    assert m["status_counts"] == {"http_error": 1, "ok": 2}
    assert m["success_rate"] == pytest.approx(2 / 3)
    assert m["wall_s"] == pytest.approx(100.0)
    assert m["prompt_tokens"] == 68_457
    assert m["cached_tokens"] == 50_773
    assert m["uncached_prompt_tokens"] == 17_684
    assert m["completion_tokens"] == 600
    assert m["input_tps"] == pytest.approx(176.84)
    assert m["cache_tps"] == pytest.approx(507.73)
    assert m["output_tps"] == pytest.approx(6.0)
    # TTFTs 1.0 and 0.5 s
    assert m["ttft_s"]["p50"] == pytest.approx(0.75)
    assert m["ttft_s"]["p90"] == pytest.approx(0.95)
    # evaluator: 200 / 5 = 40 and 400 / 98; decode: 200 / 4 = 50 and 400 / 97.5
    ev = sorted([40.0, 400 / 98])
    assert m["output_tps_evaluator"]["p10"] == pytest.approx(ev[0] + 0.1 * (ev[1] - ev[0]))
    dec = sorted([50.0, 400 / 97.5])
    assert m["output_tps_decode"]["p10"] == pytest.approx(dec[0] + 0.1 * (dec[1] - dec[0]))
    assert m["weighted_score"] == pytest.approx(6.0 * 16.796 + 176.84 * 2.799 + 507.73 * 0.56)
    assert m["weighted_score"] == pytest.approx(880.07996)


def test_cache_hit_identity() -> None:
    m = pm.compute_metrics(RECORDS)
    assert m["cache_hit"] == pytest.approx(m["cache_tps"] / (m["input_tps"] + m["cache_tps"]))
    assert round(100 * m["cache_hit"], 2) == 74.17
    assert round(100 * 507.73 / (176.84 + 507.73), 2) == 74.17


def test_gates() -> None:
    m = pm.compute_metrics(RECORDS)
    assert m["gates"] == {"output_tps_p10>=20": False, "ttft_p90<=5s": True,
                          "cache_hit>=50%": True, "success>=99%": False}
    assert m["gates_pass"] is False
    good = [rec("ok", i, i + 0.5, i + 5.5, 1000, 600, 200) for i in range(10)]
    g = pm.compute_metrics(good)
    assert g["gates_pass"] is True
    assert g["output_tps_evaluator"]["p10"] == pytest.approx(200 / 5.5)


def test_failures_are_counted_not_dropped() -> None:
    recs = [rec("ok", 0, 0.1, 1, 100, 0, 10)] + [rec("timeout", 0, None, 50)] * 3
    m = pm.compute_metrics(recs)
    assert m["success_rate"] == 0.25
    assert m["wall_s"] == 50  # a timed-out request stretches the window
    assert m["output_tps"] == pytest.approx(10 / 50)


def test_pure_and_invariant() -> None:
    m1 = pm.compute_metrics(RECORDS)
    assert pm.compute_metrics(RECORDS) == m1
    shuffled = RECORDS[:]
    random.Random(3).shuffle(shuffled)
    shifted = [{**r, "t_start": r["t_start"] + 1e4, "t_end": r["t_end"] + 1e4,
                "t_first_token": None if r["t_first_token"] is None else r["t_first_token"] + 1e4}
               for r in shuffled]
    m2 = pm.compute_metrics(shifted)
    for key in ("success_rate", "cache_hit", "output_tps", "input_tps", "cache_tps",
                "weighted_score"):
        assert m2[key] == pytest.approx(m1[key])
    assert m2["ttft_s"]["p90"] == pytest.approx(m1["ttft_s"]["p90"])


def test_empty_and_missing_fields() -> None:
    m = pm.compute_metrics([])
    assert m["n_requests"] == 0 and m["success_rate"] is None and m["cache_hit"] is None
    assert m["gates_pass"] is False
    no_cache = [rec("ok", 0, 1, 2, 100, None, 5)]
    m = pm.compute_metrics(no_cache)
    assert m["cache_hit"] == 0 and m["n_ok_without_cached_field"] == 1


def test_ledger_row_and_compare() -> None:
    m = pm.compute_metrics(RECORDS)
    row = pm.ledger_row("v1", "r.json", m)
    assert row.startswith("| v1 | `r.json` | 66.67 % | 74.17 % | 0.950 |")
    assert row.count("|") == pm.LEDGER_HEADER.splitlines()[0].count("|")
    rows = {name: ratio for name, _, _, ratio in pm.compare_rows(m, m)}
    assert rows["weighted score"] == "1.000x"
    faster = [{**r, "t_end": r["t_end"] / 2} if r["status"] == "ok" else r for r in RECORDS]
    mb = pm.compute_metrics(faster)
    rows = {name: ratio for name, _, _, ratio in pm.compare_rows(m, mb)}
    assert rows["Output TPS (aggregate)"] == "2.000x"


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    pm.plot_distributions(RECORDS, pm.compute_metrics(RECORDS), str(png), "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(png.stat().st_size)


def _brute_lcp(prompts: list[list[int]]) -> list[int]:
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out.append(best)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=300), min_size=1, max_size=12),
       st.sampled_from([1, 4, 64]))
def test_ideal_prefix_is_the_longest_common_prefix_with_any_earlier_prompt(
        prompts: list[list[int]], unit: int) -> None:
    # A tiny alphabet makes long shared prefixes (and near-misses inside a hash unit) common.
    assert pm.ideal_prefix_tokens(prompts, unit=unit) == _brute_lcp(prompts)


def test_ideal_prefix_agent_turns() -> None:
    system = list(range(1000, 1300))
    s0 = [system + [1, 2, 3], system + [1, 2, 3, 9, 9, 4], system + [5]]
    assert pm.ideal_prefix_tokens(s0) == [0, 303, 300]


def test_cache_efficiency() -> None:
    recs = [
        {"status": "ok", "prompt_tokens": 100, "cached_tokens": 0, "ideal_tokens": 0},
        {"status": "ok", "prompt_tokens": 200, "cached_tokens": 90, "ideal_tokens": 100},
        {"status": "ok", "prompt_tokens": 300, "cached_tokens": 200, "ideal_tokens": 200},
        {"status": "http_error", "prompt_tokens": None, "cached_tokens": None,
         "ideal_tokens": 50},
    ]
    e = pm.cache_efficiency(recs)
    assert (e["n"], e["prompt_tokens"], e["cached_tokens"], e["ideal_tokens"]) == (
        3, 600, 290, 300)
    assert e["efficiency"] == pytest.approx(290 / 300)
    assert e["hit"] == pytest.approx(290 / 600) and e["ideal_hit"] == pytest.approx(0.5)
    assert e["efficiency_per_request"]["n"] == 2
    assert e["efficiency_per_request"]["n_below_95pct"] == 1
    assert e["efficiency_per_request"]["p50"] == pytest.approx(0.95)


def test_prefill_cost_fit_recovers_the_model_and_falls_back_without_attention() -> None:
    a, b = 3e-4, 5e-8
    new, cached = [1000, 5000, 20000, 8000], [0, 0, 10000, 40000]
    t = [pm.prefill_seconds(a, b, n, c) for n, c in zip(new, cached, strict=True)]
    fa, fb = pm.fit_prefill_cost(new, cached, t)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-9)
    # Times that fall with length would need b < 0: a line through 0 instead.
    fa, fb = pm.fit_prefill_cost([1000, 2000], [0, 0], [1.0, 1.5])
    assert fb == 0.0 and fa == pytest.approx((1000 * 1.0 + 2000 * 1.5) / (1000**2 + 2000**2))


def test_tp4_overhead_counts_the_all_reduces_latencies_and_chunk_rereads() -> None:
    """A TP4 prefill of 16,384 tokens in 8,192-token chunks at 16 GB/s, from the card's figures:
    81 all-reduces of 16,384 x 2,048 fp16 (64 MiB) each move 1.5 x that through a rank's link
    (0.5096 s), 82 latencies of 163 us in each of the 2 chunks (0.0267 s), and one weight
    re-read of 16.2 GB at 584 GB/s (0.0277 s)."""
    card = pm.CARD_TP4
    assert (card["hidden"], card["layers"]) == (2048, 40)
    comm = 81 * 16384 * 2048 * 2 * 1.5 / 16e9
    assert comm == pytest.approx(0.50961, rel=1e-4)
    want = comm + 2 * 82 * 163e-6 + 16.2 / 584
    assert pm.tp4_overhead_s(16384, 16.0, 8192) == pytest.approx(want, rel=1e-12)
    assert pm.tp4_overhead_s(16384, 16.0, 8192) == pytest.approx(0.5641, rel=1e-3)
    # one chunk: no re-read; one token more: a second chunk, its latencies and one re-read
    one = pm.tp4_overhead_s(8192, 16.0, 8192)
    two = pm.tp4_overhead_s(8193, 16.0, 8192)
    assert one == pytest.approx(81 * 8192 * 6144 / 16e9 + 82 * 163e-6, rel=1e-12)
    assert two - one == pytest.approx(81 * 6144 / 16e9 + 82 * 163e-6 + 16.2 / 584, rel=1e-9)
    # the link's share halves with twice the rate; arrays give the same as floats
    n = np.array([1000.0, 16384.0])
    fast, slow = pm.tp4_overhead_s(n, 32.0, 8192), pm.tp4_overhead_s(n, 16.0, 8192)
    assert (slow - fast) == pytest.approx(81 * n * 6144 / 32e9)
    assert fast[1] == pytest.approx(pm.tp4_overhead_s(16384, 32.0, 8192))


def test_prefill_chunk_tokens_reads_the_launch_yaml(tmp_path: Path, monkeypatch) -> None:
    from vllm_overrides import launcher

    assert pm.prefill_chunk_tokens()[0] == int(
        launcher.get_flag(launcher.load_run_config(launcher.DEFAULT_CONFIG).command,
                          "--max-num-batched-tokens"))  # fmt: skip
    y = tmp_path / "run.yaml"
    y.write_text("concurrency: 1\ncommand: [python3, -m, x, --max-num-batched-tokens, '4096']\n"
                 "env: []\n")  # fmt: skip
    monkeypatch.setattr(launcher, "DEFAULT_CONFIG", y)
    assert pm.prefill_chunk_tokens() == (4096, "computility-run.yaml --max-num-batched-tokens")
    y.write_text("not: [valid\n")
    chunk, source = pm.prefill_chunk_tokens()
    assert chunk == 8192 and source.startswith("8192 assumed")
