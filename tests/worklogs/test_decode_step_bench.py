"""CPU smoke of worklogs/decode_step_bench.py: the whole decode step runs and reports sanely."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "worklogs" / "decode_step_bench.py"
VARIANTS = {"torch", "cuda", "fla"}


def test_decode_step_bench_smoke(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "decode_step_bench.json").read_text())
    m = res["meta"]
    assert m["smoke"] and m["torch"] and m["device"] and m["commit"]
    assert "decode_step_bench.py" in m["command"] and "--smoke" in m["command"]
    s = m["shapes"]
    n_attn = sum((i + 1) % s["attn_every"] == 0 for i in range(s["layers"]))
    n_gdn = s["layers"] - n_attn
    assert n_attn >= 1 and n_gdn >= 2
    assert m["allreduce_left_out_per_step"] == 2 * s["layers"] + 1
    assert 0 < res["copy_GBps"] < 1e5

    cases = res["cases"]
    keys = {(c["batch"], c["context"], c["variant"]) for c in cases}
    assert keys == {(b, 64, v) for b in (1, 2) for v in VARIANTS}, keys
    assert len(cases) == len(keys)
    ran = {c["batch"]: c for c in cases if c["variant"] == "torch"}
    for c in cases:
        if c["variant"] != "torch":  # no CUDA here: skipped, with the reason
            assert "eager_ms" not in c and c["skipped"], c
    for B, c in ran.items():
        assert "error" not in c and "skipped" not in c, c.get("traceback", c)
        assert c["backend"] == "torch" and c["logits_finite"] is True
        # a step from restored states repeats exactly (the cross-variant check relies on it)
        assert c["logits_rel_err_vs_torch"] == 0.0
        assert len(c["eager_ms_reps"]) == 3
        assert math.isfinite(c["eager_ms"]) and 0 < c["eager_ms"] < 10_000
        assert math.isclose(c["tokens_per_s_eager"], B * 1e3 / c["eager_ms"])
        assert c["graph_ms"] is None and "CUDA graphs" in c["graph_error"]  # CPU: recorded why
        n = c["launches"]
        assert all(n[k] > 0 for k in ("step", "gdn_layer", "attn_layer", "moe_block", "head"))
        assert n["moe_block"] < min(n["gdn_layer"], n["attn_layer"])
        # the step is its layers and head (the first layer's plain norm differs by a few ops)
        parts = n_gdn * n["gdn_layer"] + n_attn * n["attn_layer"] + n["head"]
        assert abs(n["step"] - parts) <= 10, (n, parts)
        assert math.isclose(n["per_layer_avg"], n["step"] / s["layers"])
        b = c["bytes"]
        assert b["weights"] > 0 and b["gdn_state_rw"] > 0 and b["kv_read"] > 0
        assert 0 < c["floor_ms"] < c["eager_ms"]
        assert math.isclose(c["eager_over_floor"], c["eager_ms"] / c["floor_ms"])
    # two sequences touch more experts and more state than one
    assert ran[2]["bytes"]["weights"] > ran[1]["bytes"]["weights"]
    assert ran[2]["bytes"]["kv_read"] == 2 * ran[1]["bytes"]["kv_read"]

    table = (tmp_path / "decode_step_bench.txt").read_text()
    assert table.splitlines()[0].startswith("decode step")
    assert all(v in table for v in VARIANTS) and "all-reduce left out" in table


def test_decode_step_bench_emulated_fused_ops(tmp_path: Path) -> None:
    """--emulate: the fused variant runs on the CPU emulation of the kernels; it must agree with
    the PyTorch ops and take far fewer operators per layer (the launch-count stand-in)."""
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--emulate", "--variants", "torch,cuda",
         "--batches", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    cases = {
        c["variant"]: c
        for c in json.loads((tmp_path / "decode_step_bench.json").read_text())["cases"]
    }
    fused, ref = cases["cuda"], cases["torch"]
    assert fused["backend"] == "cuda (CPU emulation)", fused.get("traceback", fused)
    assert fused["logits_finite"] and fused["logits_rel_err_vs_torch"] < 0.1  # bf16 step
    for part in ("gdn_layer", "moe_block"):
        assert 0 < fused["compute_ops"][part] < ref["compute_ops"][part] / 3, (fused, ref)


def test_prefill_step_bench_smoke(tmp_path: Path) -> None:
    """--prefill: the whole prefill step (fresh prompt and resume from cached states) runs on the
    CPU at tiny shapes, with its GEMM-FLOP floor, part breakdown and the paper TTFT estimate."""
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--prefill", "128,192", "--prefill-cached", "64",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "prefill_step_bench.json").read_text())
    m = res["meta"]
    assert m["smoke"] and "--prefill" in m["command"]
    s = m["shapes"]
    n_attn = sum((i + 1) % s["attn_every"] == 0 for i in range(s["layers"]))
    n_gdn = s["layers"] - n_attn
    assert m["n_attn"] == n_attn >= 1
    assert 0 < res["matmul_TFps"] and 0 < res["copy_GBps"]
    card = res["target_card"]
    assert "BI-V100" in card["name"] and card["copy_GBps"] == 584.0
    assert all(card[k] for k in ("copy_GBps_source", "peak_fp16_TFps_source",
                                 "matmul_efficiency_source", "launch_us_source"))  # fmt: skip

    cases = res["cases"]
    keys = {(c["tokens"], c["mode"], c["variant"]) for c in cases}
    assert keys == {(t, md, v) for t in (128, 192) for md in ("fresh", "resume") for v in VARIANTS}
    ran = {(c["tokens"], c["mode"]): c for c in cases if c["variant"] == "torch"}
    for c in cases:
        if c["variant"] == "fla":  # no CUDA here: skipped, with the reason
            assert "ms" not in c and c["skipped"], c
        if c["variant"] == "cuda":  # the fused variant's calls, served by the PyTorch ops
            assert "error" not in c and "skipped" not in c, c.get("traceback", c)
            assert c["backend"] == "torch" and c["note"].startswith("CPU smoke")
            chunk, moe = m["kernels_chunk_gated_delta_rule"], m["kernels_moe_prefill"]
            assert c["gdn_chunk_impl"] == f"{'kernels' if chunk else 'gdn'}.chunk_gated_delta_rule"
            assert c["moe_impl"] == ("kernels.moe_prefill" if moe else "moe.sparse_moe_block")
            assert c["logits_finite"] and c["logits_rel_err_vs_torch"] < 1e-2
            assert c["fused_ops_used"] == []
    for (T, mode), c in ran.items():
        assert "error" not in c and "skipped" not in c, c.get("traceback", c)
        assert c["cached"] == (0 if mode == "fresh" else 64)
        assert c["backend"] == "torch" and c["logits_finite"] is True
        assert c["gdn_chunk_impl"] == "gdn.chunk_gated_delta_rule"
        assert c["moe_impl"] == "moe.sparse_moe_block"
        # the variant's step from restored states repeats the reference step exactly
        assert c["logits_rel_err_vs_torch"] == 0.0
        assert math.isfinite(c["ms"]) and 0 < c["ms"] < 60_000
        assert math.isclose(c["tokens_per_s"], T * 1e3 / c["ms"])
        # the GEMM FLOPs, counted independently
        H, E, k, inter, Is = s["hidden"], s["experts"], s["top_k"], s["inter"], s["shared_inter"]
        conv = 2 * s["k_heads"] * s["head_k"] + s["v_heads"] * s["head_v"]
        hvv = s["v_heads"] * s["head_v"]
        qd, kvd = s["q_heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        C = c["cached"]
        pairs = T * C + T * (T + 1) / 2
        flops = (
            n_gdn * 2 * T * (H * (conv + hvv + 2 * s["v_heads"]) + hvv * H)
            + n_attn * (2 * T * H * (2 * qd + 2 * kvd) + 2 * T * qd * H + 4 * qd * pairs)
            + s["layers"] * 2 * T * (H * E + k * 3 * inter * H + 3 * Is * H + H)
            + 2 * H * s["vocab"]
        )
        assert math.isclose(c["gemm_tflop"] * 1e12, flops, rel_tol=1e-9), (c["gemm_tflop"], flops)
        assert math.isclose(c["floor_ms"], flops / (res["matmul_TFps"] * 1e12) * 1e3)
        assert math.isclose(c["ms_over_floor"], c["ms"] / c["floor_ms"])
        p = c["parts_ms"]
        assert set(p) == {"gdn_mixer", "gdn_chunk_core", "attn_mixer", "attn_sdpa", "moe_block",
                          "head"} and all(v > 0 for v in p.values())  # fmt: skip
        assert c["launches"] > 0 and c["compute_ops"] > 0
        t = c["target"]
        assert t["ms"] > 0 and math.isclose(t["tokens_per_s"], T * 1e3 / t["ms"])
    # resuming after 64 cached tokens attends over more keys
    for T in (128, 192):
        fr, rs = ran[(T, "fresh")]["matmul_flops"], ran[(T, "resume")]["matmul_flops"]
        assert rs["attn_qk_pv"] > fr["attn_qk_pv"] and rs["moe_experts"] == fr["moe_experts"]

    tt = res["ttft"]
    assert tt["variant"] in ("torch", "cuda") and "cache-sim-replay881" in tt["lengths_source"]
    for where in ("measured", "target"):
        d = tt[where]
        assert d["prompt_tokens"]["p50"] < d["prompt_tokens"]["p90"] <= d["prompt_tokens"]["p100"]
        assert 0 < d["ttft_cold_s"]["p50"] < d["ttft_cold_s"]["p90"]
        assert d["ttft_with_cache_s"]["p90"] <= d["ttft_cold_s"]["p90"]
    # the resumed rows against the fresh rows' card model, and the card model fitted to all rows
    assert [(r["tokens"], r["cached"]) for r in tt["resumed_vs_model"]] == [(128, 64), (192, 64)]
    assert set(tt["model"]) == {"measured", "target", "target_all_rows"}

    tg = res["target_step"]
    assert tg["tokens"] == 128 and set(tg["by_variant"]) == {"torch", "cuda"}
    for c in (c for c in cases if c["tokens"] == 128 and c["mode"] == "fresh" and "ms" in c):
        assert tg["by_variant"][c["variant"]]["ms_over_floor"] == c["ms_over_floor"]

    table = (tmp_path / "prefill_step_bench.txt").read_text()
    assert table.splitlines()[0].startswith("prefill step")
    assert "issue 15 target, fresh step of 128 tokens" in table
    assert "BI-V100" in table and "PLATFORM.md" in table and "TTFT" in table
    assert "resumed: 192 new after 64 cached" in table and "target_all_rows: t = " in table
    assert "tp4 = target + 81 all-reduces" in table and "link 16 GB/s: gate P90 with cache" in table


def test_ttft_estimate_takes_the_cards_path() -> None:
    """The paper TTFT comes from a variant the card can run (never FLA's Triton kernels, however
    fast here), and says where its rows are not the card's path or its fit is short of lengths."""
    sys.path.insert(0, str(SCRIPT.parent))
    import decode_step_bench as bench

    def row(variant: str, tokens: int, ms: float, used: tuple[str, ...] = ()) -> dict:
        return {"mode": "fresh", "variant": variant, "tokens": tokens, "ms": ms,
                "tokens_per_s": tokens * 1e3 / ms, "target": {"ms": 7 * ms},
                "fused_ops_used": list(used)}  # fmt: skip

    card = dict(bench.TARGET_CARD)
    rows = [row("fla", 16384, 90.0), row("cuda", 16384, 100.0), row("torch", 16384, 300.0)]
    tt = bench.ttft_estimate(rows, card, "bfloat16")
    assert tt["variant"] == "cuda" and tt["moe_gemms"] == "library"
    assert len(tt["caveats"]) == 3, tt["caveats"]  # bf16, library GEMMs, one length
    assert tt["model"]["measured"]["b_s_per_pair"] == 0
    assert bench.ttft_estimate(rows[2:], card, "float16")["variant"] == "torch"
    assert "error" in bench.ttft_estimate(rows[:1], card, "float16")

    ours = ("moe_prefill_with_shared", "moe_grouped_gemm")
    rows = [row("cuda", 16384, 100.0, ours), row("cuda", 65536, 480.0, ours)]
    tt = bench.ttft_estimate(rows, card, "float16")
    assert tt["caveats"] == [] and tt["moe_gemms"].startswith("ours")
    mdl, mdl_t = tt["model"]["measured"], tt["model"]["target"]
    assert mdl["b_s_per_pair"] > 0  # 64K costs more than 4 x 16K: attention's quadratic term
    for T, ms in ((16384, 100.0), (65536, 480.0)):
        assert math.isclose(mdl["a_s_per_token"] * T + mdl["b_s_per_pair"] * T * T / 2, ms / 1e3)
    assert tt["target"]["ttft_cold_s"]["p90"] > tt["measured"]["ttft_cold_s"]["p90"]
    assert "target_all_rows" not in tt["model"] and tt["resumed_vs_model"] == []

    # tp4: the card model plus the all-reduces and chunk re-reads, at each assumed link rate
    import perf_metrics as pm
    from perf_metrics import prefill_seconds

    t4 = tt["tp4"]
    assert t4["chunk_tokens"] == pm.prefill_chunk_tokens()[0]
    assert list(t4["by_link_GBps"]) == [f"{g:g}" for g in card["link_GBps"]]
    lens = bench.replay_lengths()
    longest = max(lens["prompt"])
    for g, d in t4["by_link_GBps"].items():  # the cost grows with the prompt: P100 = the longest
        want = (prefill_seconds(mdl_t["a_s_per_token"], mdl_t["b_s_per_pair"], longest, 0)
                + pm.tp4_overhead_s(longest, float(g), t4["chunk_tokens"], card))  # fmt: skip
        assert math.isclose(d["ttft_cold_s"]["p100"], want)
        assert d["ttft_with_cache_s"]["p90"] > tt["target"]["ttft_with_cache_s"]["p90"]
    p90 = [d["ttft_with_cache_s"]["p90"] for d in t4["by_link_GBps"].values()]
    assert p90 == sorted(p90, reverse=True)  # a slower link, a later first token

    # A resumed prefill (64K new after 64K cached) at 1.5x what the fresh rows' model says:
    # reported against that model, and a second card model fitted to all rows, cached included.
    from perf_metrics import fit_prefill_cost

    fit = tt["model"]["target"]
    model_ms = prefill_seconds(fit["a_s_per_token"], fit["b_s_per_pair"], 65536, 65536) * 1e3
    resumed = row("cuda", 65536, 1.5 * model_ms / 7, ours) | {"mode": "resume", "cached": 65536}
    tt2 = bench.ttft_estimate([*rows, resumed], card, "float16")
    assert tt2["model"]["target"] == fit  # the fresh fit is unchanged
    (r,) = tt2["resumed_vs_model"]
    assert (r["tokens"], r["cached"]) == (65536, 65536)
    assert math.isclose(r["model_ms"], model_ms) and math.isclose(r["over_model"], 1.5)
    a, b = fit_prefill_cost([16384, 65536, 65536], [0, 0, 65536], [0.7, 3.36, 1.5 * model_ms / 1e3])
    assert tt2["model"]["target_all_rows"] == {"a_s_per_token": a, "b_s_per_pair": b}
    # the resumed row pulls the attention term up: long prompts read slower
    assert b > fit["b_s_per_pair"]
    assert tt2["target_all_rows"]["ttft_cold_s"]["p99"] > tt2["target"]["ttft_cold_s"]["p99"]
