"""worklogs/kernel_bench.py's target cells: each GDN prefill mode judged by its issue's bar."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import kernel_bench as kb  # noqa: E402

# The H200 run at 1248cc2 (worklogs/results/moe-down-walk-h200-2026-12-03/1248cc2/kb/).
MEASURED = {
    "kind": "gdn_prefill", "tp": 4, "T": 16384, "floor_ms": 0.037,
    "fla": {"graph_ms": 0.4940, "eager_ms": 1.6647}, "fla_err": 4.0e-3, "fla_state_err": 3.1e-3,
    "fused": {"graph_ms": 0.8285, "eager_ms": 0.8420}, "fused_err": 2.9e-3,
    "fused_state_err": 1.6e-3,
    "native_tf32": {"graph_ms": 2.2264, "eager_ms": 6.2570}, "native_tf32_err": 1.7e-3,
}  # fmt: skip


def target(case: dict[str, Any], mode: str) -> str:
    rows = kb.table_rows({"cases": [case]})
    (row,) = [r for r in rows if r[3] == mode.replace("native_", "native ")]
    return row[-1]


def test_fused_is_held_to_issue_15s_bar() -> None:
    assert target(MEASURED, "fused") == "MET (<=2x FLA, err<=FLA, state err<=FLA)"
    slower = {**MEASURED, "fused": {"graph_ms": 2.5 * 0.4940}}  # 2.5x: met issue 5's 3x only
    assert target(slower, "fused").startswith("not met (<=2x FLA")
    worse_state = {**MEASURED, "fused_state_err": 3.2e-3}
    assert target(worse_state, "fused").startswith("not met")
    assert target({**MEASURED, "fused_state_err": None}, "fused").startswith("not met")


def test_pytorch_paths_keep_issue_5s_bar() -> None:
    assert target(MEASURED, "native_tf32") == "not met (<=3x FLA, err<=FLA)"  # 4.51x
    faster = {**MEASURED, "native_tf32": {"graph_ms": 1.4}}  # 2.83x
    assert target(faster, "native_tf32") == "MET (<=3x FLA, err<=FLA)"


def test_other_shapes_have_no_target() -> None:
    assert target({**MEASURED, "T": 65536}, "fused") == ""
