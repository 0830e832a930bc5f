"""End to end: generator -> formal_perf_bench (and decode_microbench) against a live server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

WORKLOGS = Path(__file__).resolve().parents[2] / "worklogs"
sys.path.insert(0, str(WORKLOGS))

import decode_microbench  # noqa: E402
import formal_perf_bench  # noqa: E402
import generate_official_like_dataset as gen  # noqa: E402
import perf_metrics as pm  # noqa: E402

OUT_TOKENS = 8


@pytest.mark.server
def test_generator_to_bench(server: Any, tmp_path: Path) -> None:
    dataset = tmp_path / "smoke4.jsonl"
    assert gen.main(["--preset", "smoke4", "--out", str(dataset), "--verify", "all"]) == 0
    lines = [json.loads(s) for s in dataset.read_text().splitlines()]
    for ln in lines:
        ln["body"]["model"] = server.model
    dataset.write_text("".join(json.dumps(ln) + "\n" for ln in lines))

    out = tmp_path / "result.json"
    argv = ["--base-url", server.base_url, "--dataset", str(dataset), "--out", str(out),
            "-c", "2", "--max-tokens", str(OUT_TOKENS), "--output-len", "exact",
            "--label", "smoke", "--timeout", "300"]
    if getattr(server, "api_key", None):
        argv += ["--api-key", server.api_key]
    assert formal_perf_bench.main(argv) == 0
    result = json.loads(out.read_text())
    recs = result["records"]

    # every request has its record, in dataset order, with its timing
    assert [r["id"] for r in recs] == [ln["id"] for ln in lines]
    assert all(r["t_end"] is not None and r["t_end"] >= r["t_start"] for r in recs)
    # the metrics in the file are exactly what the records give
    assert result["metrics"] == json.loads(json.dumps(pm.compute_metrics(recs)))
    assert result["preflight"]["status"] == "ok", result["preflight"]
    assert result["server"]["models"]["data"][0]["id"] == server.model

    bad = [(r["id"], r["status"], r["error"]) for r in recs if r["status"] != "ok"]
    assert not bad, bad
    for r, ln in zip(recs, lines, strict=True):
        assert r["completion_tokens"] == OUT_TOKENS  # ignore_eos + max_completion_tokens
        assert r["t_first_token"] is not None
        # the chat template only adds to the generator's counted tokens
        assert r["prompt_tokens"] > ln["meta"]["counted_tokens"]
    m = result["metrics"]
    assert m["success_rate"] == 1.0 and m["completion_tokens"] == OUT_TOKENS * len(lines)
    # The token-level ideal comes from the server's own /tokenize: same length as the prompt
    # the server counted, and the efficiency is recomputable from the records.
    eff = result["cache_efficiency"]
    assert eff["n_not_tokenized"] == 0 and eff["n"] == len(lines)
    for r in recs:
        assert r["tokenized_prompt_tokens"] == r["prompt_tokens"], r
        assert 0 <= r["ideal_tokens"] < r["prompt_tokens"]
    assert recs[0]["ideal_tokens"] == 0
    assert eff == json.loads(json.dumps({**pm.cache_efficiency(recs), "n_not_tokenized": 0}))
    assert (tmp_path / "result.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.server
def test_decode_microbench(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    argv = ["--base-url", server.base_url, "--model", server.model, "-c", "2",
            "--output-tokens", str(OUT_TOKENS), "--repeats", "2", "--out", str(out)]
    if getattr(server, "api_key", None):
        argv += ["--api-key", server.api_key]
    assert decode_microbench.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["records"]) == 4 and len(result["waves"]) == 2
    assert all(r["completion_tokens"] == OUT_TOKENS for r in result["records"])
    assert result["metrics"] == json.loads(json.dumps(pm.compute_metrics(result["records"])))
