"""worklogs/floor_probe.py on the CPU (``--smoke``): every case is timed and judged against its
budget the way the ledger reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKLOGS = Path(__file__).resolve().parents[2] / "worklogs"


def test_floor_probe_smoke() -> None:
    run = subprocess.run(
        [sys.executable, str(WORKLOGS / "floor_probe.py"), "--smoke"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    out = json.loads(run.stdout)
    cases = {(c["case"], c.get("T", c.get("B"))): c for c in out["cases"]}
    want = {("gdn_decode", 4), ("moe_decode", 1), ("moe_decode", 2), ("moe_prefill", 64)}
    assert set(cases) == want
    for c in out["cases"]:
        skeletons = {k: v for k, v in c.items() if k.startswith("skeleton") and k.endswith("_ms")}
        assert skeletons and all(v > 0 for v in skeletons.values()), c
        assert c["best_skeleton_ms"] == min(skeletons.values())
        if "budget_ms" in c:  # no FLA on the CPU: the GDN budget needs the GPU run
            assert c["skeleton_over_budget"] == c["best_skeleton_ms"] / c["budget_ms"]
    moe = cases[("moe_decode", 1)]
    assert moe["budget_ms"] == 1.5 * moe["gemms_alone_ms"]
    assert {"skeleton_gather_ms", "skeleton_dense_ms"} <= set(moe)
    pre = cases[("moe_prefill", 64)]
    assert pre["budget_ms"] == pytest.approx(pre["gflop"] * 1e9 / 200e12 * 1e3)
    # the table on stderr names every case
    assert run.stderr.count("budget") >= len(out["cases"])
