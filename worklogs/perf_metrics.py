"""Metrics of a benchmark run, as a pure function of its per-request records.

Shared by ``formal_perf_bench.py`` and ``decode_microbench.py`` (and recomputed by the tests),
so every number in a result file can be re-derived from the records stored next to it.

A record is a plain dict (JSON-serialisable). The fields used here:

* ``status``: ``"ok"`` or a failure class (``http_error``, ``timeout``, ``stream_error``,
  ``incomplete``, ``error``). Only ``ok`` records contribute tokens and latencies; failures count
  in the success rate and in the wall window.
* ``t_start`` / ``t_first_token`` / ``t_end``: seconds on one monotonic clock. ``t_first_token``
  is the arrival of the first chunk carrying content, reasoning or a tool call (``None`` if
  none came). Every record has ``t_end`` (the moment the client gave up, for failures).
* ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens``: from the stream's usage chunk.

Definitions (mirroring the platform's evaluator, see /work/shared/PLATFORM.md):

* wall window = max(t_end) - min(t_start) over *all* records;
* Output TPS (aggregate) = sum(completion) / wall; Input TPS = sum(prompt - cached) / wall;
  Cache TPS = sum(cached) / wall; so cache hit = sum(cached) / sum(prompt)
  = Cache TPS / (Input TPS + Cache TPS);
* per-request Output TPS, evaluator definition = completion / (t_end - t_start), i.e. TTFT
  included; decode definition = completion / (t_end - t_first_token);
* weighted score = aggregate Output TPS * 16.796 + Input TPS * 2.799 + Cache TPS * 0.56
  (the platform's formula; it uses the *aggregate* Output TPS, the P10 only gates);
* gates: Output TPS P10 (evaluator definition) >= 20, TTFT P90 <= 5 s, hit >= 50 %,
  success >= 99 %.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

Record = Mapping[str, Any]

W_OUTPUT = 16.796
W_INPUT = 2.799
W_CACHE = 0.56

GATE_OUTPUT_TPS_P10 = 20.0
GATE_TTFT_P90_S = 5.0
GATE_CACHE_HIT = 0.50
GATE_SUCCESS = 0.99


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks: ``numpy.percentile``'s default ("linear",
    Hyndman-Fan type 7).

    ``q`` is in percent. For sorted x of length n the rank is h = (n - 1) * q / 100 and the
    result x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). Empty input -> None.
    """
    xs = np.asarray(list(values), dtype=np.float64)
    if xs.size == 0:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile out of range: {q}")
    return float(np.percentile(xs, q, method="linear"))


def ideal_prefix_tokens(prompts: Sequence[Sequence[int]], unit: int = 64) -> list[int]:
    """Per prompt, the longest common token prefix with any *earlier* prompt (0 for the first).

    The token-level ideal of a prefix cache that never forgets: what a request could be served
    from cache at best. Exact: prompts are indexed by chained hashes of ``unit``-token blocks,
    the deepest matching block is found by walking the chain, and the match is extended token
    by token against every earlier prompt that shares that block prefix.
    """
    index: dict[bytes, list[int]] = {}
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    out: list[int] = []
    for i, p in enumerate(arrays):
        n_blocks = len(p) // unit
        chain = [b""] * n_blocks
        h = b""
        for b in range(n_blocks):
            h = hashlib.blake2b(h + p[b * unit : (b + 1) * unit].tobytes(), digest_size=16).digest()
            chain[b] = h
        depth = 0
        while depth < n_blocks and chain[depth] in index:
            depth += 1
        candidates = index[chain[depth - 1]] if depth else range(i)
        best = depth * unit
        for j in candidates:
            q = arrays[j]
            n = min(len(p), len(q))
            lo = depth * unit
            diff = np.flatnonzero(p[lo:n] != q[lo:n])
            best = max(best, lo + (int(diff[0]) if diff.size else n - lo))
        out.append(best)
        for b in range(n_blocks):
            index.setdefault(chain[b], []).append(i)
    return out


# Issue 13's per-request line: cached tokens >= 95 % of the ideal (``n_below_95pct`` counts misses).
EFFICIENCY_TARGET = 0.95


def cache_efficiency(records: Sequence[Record]) -> dict[str, Any]:
    """Cached tokens the server granted against the token-level ideal, in total and per request.

    Uses ``prompt_tokens``, ``cached_tokens`` and ``ideal_tokens`` of records whose status is ok
    (records without a status count as ok, as the simulator writes them). The efficiency is
    sum(cached) / sum(ideal): the share of reusable prefix tokens that were served from cache.
    """
    ok = [r for r in records if r.get("status", "ok") == "ok" and r.get("ideal_tokens") is not None]
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    ideal = sum(int(r["ideal_tokens"]) for r in ok)
    per_req = [
        min(int(r.get("cached_tokens") or 0), int(r["ideal_tokens"])) / int(r["ideal_tokens"])
        for r in ok
        if int(r["ideal_tokens"]) > 0
    ]
    chunks = [int(r["prefill_chunks"]) for r in ok if r.get("prefill_chunks") is not None]
    return {
        "n": len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ideal_tokens": ideal,
        "hit": cached / prompt if prompt else None,
        "ideal_hit": ideal / prompt if prompt else None,
        "efficiency": cached / ideal if ideal else None,
        "efficiency_per_request": {
            **{f"p{q}": percentile(per_req, q) for q in (10, 50, 90)},
            "n": len(per_req),
            "n_below_95pct": sum(1 for e in per_req if e < EFFICIENCY_TARGET),
        },
        "cached_over_ideal_requests": sum(
            1 for r in ok if int(r.get("cached_tokens") or 0) > int(r["ideal_tokens"])
        ),
        "prefill_chunks_mean": float(np.mean(chunks)) if chunks else 0.0,
    }


def fit_prefill_cost(new: Any, cached: Any, seconds: Any) -> tuple[float, float]:
    """``a`` (s per new token) and ``b`` (s per causal attention pair) of the prefill cost
    ``t = a N + b (N C + N^2 / 2)`` for ``N`` new tokens after ``C`` cached ones, by least
    squares; where that gives a negative term, ``b = 0`` and ``a`` alone (a line through 0)."""
    n, c, t = (np.asarray(v, dtype=float) for v in (new, cached, seconds))
    a, b = float(np.sum(t * n) / np.sum(n * n)), 0.0
    if n.size >= 2:
        (a2, b2), *_ = np.linalg.lstsq(np.stack([n, n * c + n * n / 2], 1), t, rcond=None)
        if a2 >= 0 and b2 >= 0:
            a, b = float(a2), float(b2)
    return a, b


def prefill_seconds(a: float, b: float, new: Any, cached: Any) -> Any:
    """The cost model of :func:`fit_prefill_cost` (floats or numpy arrays)."""
    return a * new + b * (new * cached + new * new / 2)


# What a TP4 prefill on the target card spends beyond one rank's step (tp4_overhead_s), with
# where each figure comes from. decode_step_bench.TARGET_CARD carries these too.
CARD_TP4: dict[str, Any] = {
    "link_GBps": (8.0, 16.0, 31.5),
    "link_GBps_source": "assumption: a ring all-reduce's bus bandwidth across the 4 cards. The "
    "card's launch report (TechPowerUp, via geektopia.es 2021-04-05) gives it a PCIe 4.0 x16 "
    "interface, 31.5 GB/s a direction raw (the last figure); 16 takes half of that, 8 a quarter "
    "(peer-to-peer staged through the host). No all-reduce of prefill size is known measured "
    "on the card",
    "allreduce_latency_us": 163.0,
    "allreduce_latency_us_source": "/work/shared/PLATFORM.md (13.2 ms of all-reduce per decode "
    "token per rank before the peer team's IPC all-reduce, over the step's 81 collectives)",
    "weights_GB": 16.2,
    "weights_GB_source": "/work/shared/PLATFORM.md (weights per card at TP4)",
    "copy_GBps": 584.0,
    "copy_GBps_source": "/work/shared/PLATFORM.md (measured copy bandwidth)",
    "hidden": 2048,
    "layers": 40,
    "model": "Qwen3.6-35B-A3B (PLATFORM.md)",
}


def prefill_chunk_tokens() -> tuple[int, str]:
    """The engine's prefill chunk, ``--max-num-batched-tokens`` of computility-run.yaml (the
    one source of launch arguments), and where it came from."""
    try:
        from vllm_overrides.launcher import DEFAULT_CONFIG, get_flag, load_run_config

        mnbt = get_flag(load_run_config(DEFAULT_CONFIG).command, "--max-num-batched-tokens")
        return int(mnbt), "computility-run.yaml --max-num-batched-tokens"
    except Exception as exc:  # noqa: BLE001 - a machine without the repo's launcher or PyYAML
        return 8192, f"8192 assumed ({type(exc).__name__} reading computility-run.yaml)"


def tp4_overhead_s(new: Any, link_gbps: float, chunk: int,
                   card: Mapping[str, Any] = CARD_TP4) -> Any:  # fmt: skip
    """Seconds a TP4 prefill of ``new`` tokens spends beyond one rank's step (floats or numpy
    arrays). vLLM runs the all-reduces between the layers' kernels, not beside them: the
    embedding's and two a layer (attention or GDN output, MoE output), each of ``[new, hidden]``
    float16 as a ring over 4 ranks (2 (n - 1) / n of its bytes through each rank's link at
    ``link_gbps``), plus the card's small-message latency for those and the LM head's gather in
    every chunk. The prefill runs in chunks of ``chunk`` tokens, and every chunk after the first
    re-reads the rank's weights (a chunk's 8,192 tokens x top-8 reach all 256 experts)."""
    n = np.asarray(new, dtype=float)
    chunks = np.maximum(np.ceil(n / chunk), 1)
    sized = 2 * card["layers"] + 1
    ring = 2 * (4 - 1) / 4
    comm = sized * n * card["hidden"] * 2 * ring / (link_gbps * 1e9)
    latency = chunks * (sized + 1) * card["allreduce_latency_us"] * 1e-6
    reread = (chunks - 1) * card["weights_GB"] / card["copy_GBps"]
    return comm + latency + reread


def weighted_score(output_tps: float, input_tps: float, cache_tps: float) -> float:
    return output_tps * W_OUTPUT + input_tps * W_INPUT + cache_tps * W_CACHE


def ttft_s(r: Record) -> float | None:
    if r.get("t_first_token") is None:
        return None
    return float(r["t_first_token"]) - float(r["t_start"])


def evaluator_tps(r: Record) -> float | None:
    """Completion tokens over the whole request time (TTFT included), as the evaluator logs."""
    dur = float(r["t_end"]) - float(r["t_start"])
    if r.get("completion_tokens") is None or dur <= 0:
        return None
    return r["completion_tokens"] / dur


def decode_tps(r: Record) -> float | None:
    """Completion tokens over the time after the first token (decode speed as a user sees it)."""
    if r.get("completion_tokens") is None or r.get("t_first_token") is None:
        return None
    dur = float(r["t_end"]) - float(r["t_first_token"])
    if dur <= 0:
        return None
    return r["completion_tokens"] / dur


def _pcts(values: Sequence[float], qs: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def compute_metrics(records: Sequence[Record]) -> dict[str, Any]:
    """All metrics of a run. Pure: depends on nothing but ``records``."""
    n = len(records)
    ok = [r for r in records if r.get("status") == "ok"]
    status_counts: dict[str, int] = {}
    for r in records:
        status_counts[str(r.get("status"))] = status_counts.get(str(r.get("status")), 0) + 1

    if records:
        t0 = min(float(r["t_start"]) for r in records)
        t1 = max(float(r["t_end"]) for r in records)
        wall = t1 - t0
    else:
        wall = 0.0

    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    completion = sum(int(r.get("completion_tokens") or 0) for r in ok)
    uncached = prompt - cached

    def per_wall(x: float) -> float:
        return x / wall if wall > 0 else 0.0

    out_tps, in_tps, cache_tps = per_wall(completion), per_wall(uncached), per_wall(cached)
    ttfts = [t for t in (ttft_s(r) for r in ok) if t is not None]
    ev = [t for t in (evaluator_tps(r) for r in ok) if t is not None]
    dec = [t for t in (decode_tps(r) for r in ok) if t is not None]
    hit = cached / prompt if prompt else None
    success = len(ok) / n if n else None
    ttft_p90 = percentile(ttfts, 90)
    ev_p10 = percentile(ev, 10)

    gates = {
        "output_tps_p10>=20": ev_p10 is not None and ev_p10 >= GATE_OUTPUT_TPS_P10,
        "ttft_p90<=5s": ttft_p90 is not None and ttft_p90 <= GATE_TTFT_P90_S,
        "cache_hit>=50%": hit is not None and hit >= GATE_CACHE_HIT,
        "success>=99%": success is not None and success >= GATE_SUCCESS,
    }
    return {
        "n_requests": n,
        "n_ok": len(ok),
        "status_counts": dict(sorted(status_counts.items())),
        "success_rate": success,
        "wall_s": wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "uncached_prompt_tokens": uncached,
        "completion_tokens": completion,
        "cache_hit": hit,
        "n_ok_without_cached_field": sum(1 for r in ok if r.get("cached_tokens") is None),
        "ttft_s": {**_pcts(ttfts, (50, 90, 99)), "mean": _mean(ttfts), "n": len(ttfts)},
        "output_tps_evaluator": {**_pcts(ev, (10, 50, 90)), "mean": _mean(ev), "n": len(ev)},
        "output_tps_decode": {**_pcts(dec, (10, 50, 90)), "mean": _mean(dec), "n": len(dec)},
        "output_tps": out_tps,
        "input_tps": in_tps,
        "cache_tps": cache_tps,
        "weighted_score": weighted_score(out_tps, in_tps, cache_tps),
        "weighted_score_uses": "aggregate output_tps (sum completion / wall)",
        "gates": gates,
        "gates_pass": all(gates.values()),
    }


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------- presentation


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def render_table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    """Plain fixed-width table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(c) for c in row] for row in rows]
    if header:
        cells.insert(0, [str(h) for h in header])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    out = []
    for k, row in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if header and k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def metrics_rows(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    g = m["gates"]
    return [
        ("requests (ok / total)", f"{m['n_ok']} / {m['n_requests']}"),
        ("status counts", ", ".join(f"{k}={v}" for k, v in m["status_counts"].items())),
        ("success rate", pct(m["success_rate"]) + ("" if g["success>=99%"] else "  (gate 99 %)")),
        ("wall window", f"{m['wall_s']:.2f} s"),
        ("prompt / cached / completion tok",
         f"{m['prompt_tokens']:,} / {m['cached_tokens']:,} / {m['completion_tokens']:,}"),
        ("cache hit", pct(m["cache_hit"]) + ("" if g["cache_hit>=50%"] else "  (gate 50 %)")),
        ("TTFT P50 / P90 / P99 (s)", " / ".join(fmt(m["ttft_s"][k], 3) for k in
                                               ("p50", "p90", "p99"))
         + ("" if g["ttft_p90<=5s"] else "  (gate P90 5 s)")),
        ("Output TPS/req evaluator P10 / P50", " / ".join(
            fmt(m["output_tps_evaluator"][k]) for k in ("p10", "p50"))
         + ("" if g["output_tps_p10>=20"] else "  (gate P10 20)")),
        ("Output TPS/req decode P10 / P50", " / ".join(
            fmt(m["output_tps_decode"][k]) for k in ("p10", "p50"))),
        ("Output TPS (aggregate)", fmt(m["output_tps"])),
        ("Input TPS (uncached prompt)", fmt(m["input_tps"])),
        ("Cache TPS", fmt(m["cache_tps"])),
        ("weighted score (aggregate out)", fmt(m["weighted_score"])),
        ("gates", "all pass" if m["gates_pass"] else
         "FAIL: " + ", ".join(k for k, v in g.items() if not v)),
    ]


LEDGER_HEADER = ("| version/config | result file | success | hit | TTFT P90 (s) | Output TPS P10 "
                 "| Input TPS | Cache TPS | weighted |\n|---|---|---|---|---|---|---|---|---|")


def ledger_row(label: str, result_file: str, m: Mapping[str, Any]) -> str:
    return (f"| {label} | `{result_file}` | {pct(m['success_rate'])} | {pct(m['cache_hit'])} "
            f"| {fmt(m['ttft_s']['p90'], 3)} | {fmt(m['output_tps_evaluator']['p10'])} "
            f"| {fmt(m['input_tps'])} | {fmt(m['cache_tps'])} | {fmt(m['weighted_score'])} |")


COMPARE_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("success rate", ("success_rate",)),
    ("cache hit", ("cache_hit",)),
    ("TTFT P50 (s)", ("ttft_s", "p50")),
    ("TTFT P90 (s)", ("ttft_s", "p90")),
    ("TTFT P99 (s)", ("ttft_s", "p99")),
    ("Output TPS P10 (evaluator)", ("output_tps_evaluator", "p10")),
    ("Output TPS P10 (decode)", ("output_tps_decode", "p10")),
    ("Output TPS (aggregate)", ("output_tps",)),
    ("Input TPS", ("input_tps",)),
    ("Cache TPS", ("cache_tps",)),
    ("weighted score", ("weighted_score",)),
    ("wall (s)", ("wall_s",)),
)


def _dig(m: Mapping[str, Any], path: Sequence[str]) -> Any:
    cur: Any = m
    for k in path:
        cur = cur.get(k) if isinstance(cur, Mapping) else None
    return cur


def compare_rows(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(metric, A, B, B/A) for two metrics dicts."""
    rows = []
    for name, path in COMPARE_KEYS:
        va, vb = _dig(a, path), _dig(b, path)
        ratio = (f"{vb / va:.3f}x" if isinstance(va, int | float) and isinstance(vb, int | float)
                 and va else "-")
        rows.append((name, fmt(va, 4), fmt(vb, 4), ratio))
    return rows


def plot_distributions(records: Sequence[Record], metrics: Mapping[str, Any], path: str,
                       title: str) -> None:
    """PNG: TTFT and per-request Output TPS (both definitions) as histograms with gate lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.get("status") == "ok"]
    ttfts = [t for t in (ttft_s(r) for r in ok) if t is not None]
    ev = [t for t in (evaluator_tps(r) for r in ok) if t is not None]
    dec = [t for t in (decode_tps(r) for r in ok) if t is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if ttfts:
        ax.hist(ttfts, bins=min(40, max(5, len(ttfts))), color="tab:blue", alpha=0.8)
    ax.axvline(GATE_TTFT_P90_S, color="red", ls="--", label="gate 5 s")
    if metrics["ttft_s"]["p90"] is not None:
        ax.axvline(metrics["ttft_s"]["p90"], color="black", ls=":",
                   label=f"P90 {metrics['ttft_s']['p90']:.2f} s")
    ax.set_title("TTFT (s)")
    ax.set_xlabel("seconds")
    ax.legend()
    for ax, vals, key, name in ((axes[1], ev, "output_tps_evaluator", "evaluator: tok / whole"),
                                (axes[2], dec, "output_tps_decode", "decode: tok / after TTFT")):
        if vals:
            ax.hist(vals, bins=min(40, max(5, len(vals))), color="tab:green", alpha=0.8)
        ax.axvline(GATE_OUTPUT_TPS_P10, color="red", ls="--", label="gate P10 20")
        p10 = metrics[key]["p10"]
        if p10 is not None:
            ax.axvline(p10, color="black", ls=":", label=f"P10 {p10:.1f}")
        ax.set_title(f"Output TPS per request ({name})")
        ax.set_xlabel("tokens / s")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
