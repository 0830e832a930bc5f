"""worklogs/replay_partial.py: hit and efficiency of a replay cut short, from its record log."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import replay_partial  # noqa: E402


def test_partial_log_gives_ideal_hit_and_efficiency(tmp_path: Path) -> None:
    lines = [{"id": f"r{i}", "meta": {"session_id": "s"}, "body": {}} for i in range(3)]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sha = hashlib.sha256(dataset.read_bytes()).hexdigest()
    ids = [list(range(100)), list(range(80)) + [7] * 40, list(range(120)) + [9] * 10]
    cache = tmp_path / "tok"
    cache.mkdir()
    # the token ids as cache_sim.render_dataset caches them (no tokenizer needed here)
    np.savez(cache / f"{sha[:16]}-3.npz", **{f"r{i}": np.array(x) for i, x in enumerate(ids)})
    # request 2 is not reached
    recs = [
        {"index": 0, "status": "ok", "prompt_tokens": 100, "cached_tokens": 0,
         "t_start": 0.0, "t_first_token": 0.75, "t_end": 1.0},
        {"index": 1, "status": "ok", "prompt_tokens": 120, "cached_tokens": 64,
         "t_start": 1.0, "t_first_token": 1.75, "t_end": 2.0},
    ]  # fmt: skip
    log = tmp_path / "r.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out, png = tmp_path / "o.json", tmp_path / "p.png"
    mem = tmp_path / "r.memory.jsonl"  # 20 samples 5 s apart, 100 MiB then 110 MiB
    mem.write_text("".join(json.dumps({"t_s": 5.0 * i, "rss": (100 + 10 * (i >= 10)) * 2**20,
                                       "by_process": {}}) + "\n" for i in range(20)))
    assert replay_partial.main(["--records", str(log), "--dataset", str(dataset),
                                "--token-cache", str(cache), "--memory", str(mem),
                                "--out", str(out), "--plot", str(png)]) == 0  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads(out.read_text())
    assert res["n_done"] == 2 and res["success"] == 1.0 and res["wall_s"] == 2.0
    assert res["ideal_tokens"] == 80  # request 1 shares its first 80 tokens with request 0
    assert res["cached_tokens"] == 64 and res["efficiency"] == 64 / 80
    assert res["hit"] == 64 / 220
    m = res["memory"]
    assert (m["n"], m["every_s"], m["start_mib"], m["end_mib"]) == (20, 5.0, 100.0, 110.0)
    assert m["growth_pct"] == 10.0 and m["max_mib"] == 110.0
    # Projection: the cost model fitted to the two TTFTs plus the 0.25 s after the first token
    # gives the done requests' measured 2 s back; every request of the dataset is then priced
    # at its ideal times the efficiency (0.8): request 2 (130 tokens, ideal 100 -> 80 cached).
    pj = res["projection"]
    assert pj["after_first_token_s"] == 0.25 and pj["done_model_s"] == pytest.approx(2.0)
    a, b = pj["a_s_per_token"], pj["b_s_per_pair"]
    assert b > 0 and a * 100 + b * 100 * 100 / 2 == pytest.approx(0.75)

    def cost(p: int, c: float) -> float:
        return a * (p - c) + b * ((p - c) * c + (p - c) ** 2 / 2) + 0.25

    assert pj["rest_s"] == pytest.approx(cost(130, 80))
    assert pj["all_s"] == pytest.approx(cost(100, 0) + cost(120, 64) + cost(130, 80))
