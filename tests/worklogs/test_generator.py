"""worklogs/generate_official_like_dataset.py: exact token counts, determinism, preset shapes."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

WORKLOGS = Path(__file__).resolve().parents[2] / "worklogs"
sys.path.insert(0, str(WORKLOGS))

import generate_official_like_dataset as gen  # noqa: E402
import textbank  # noqa: E402

GEN = str(WORKLOGS / "generate_official_like_dataset.py")


@pytest.fixture(scope="module")
def tok() -> textbank.TokenizerLike:
    return textbank.load_tokenizer()


@pytest.fixture(scope="module")
def bank(tok: textbank.TokenizerLike) -> textbank.TextBank:
    return textbank.TextBank(tok, seed=0)


@pytest.fixture(scope="module")
def quick8(tok: textbank.TokenizerLike) -> list[dict[str, Any]]:
    return gen.generate("quick8", seed=0, tok=tok)


@pytest.fixture(scope="module")
def replay88(tok: textbank.TokenizerLike) -> list[dict[str, Any]]:
    return gen.generate("replay88", seed=0, tok=tok)


def test_tokenizer_is_the_qwen35_one(tok: textbank.TokenizerLike) -> None:
    # special tokens of the Qwen3.5 vocabulary (248,320 entries), not the Qwen2 ones
    assert tok.encode("<|im_start|>") == [248045]
    assert tok.encode("<tool_call>") == [248058]


@settings(max_examples=80, deadline=None)
@given(n=st.one_of(st.just(0), st.integers(2, 6000)), kind=st.sampled_from(textbank.KINDS),
       seed=st.integers(0, 2**32))
def test_fill_is_exact(bank: textbank.TextBank, n: int, kind: str, seed: int) -> None:
    text = bank.fill(random.Random(seed), kind, n)
    assert bank.count(text) == n
    # the concatenation rules: ends with a newline, first line not blank (may be indented code)
    assert text == "" or (text.endswith("\n") and text.split("\n", 1)[0].strip() != "")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 5000), seed=st.integers(0, 2**32))
def test_fill_mixed_is_exact_and_additive(bank: textbank.TextBank, n: int, seed: int) -> None:
    rng = random.Random(seed)
    a = bank.fill_mixed(rng, ("prose", "code", "log"), n)
    b = bank.fill(rng, "diff", 37)
    assert bank.count(a) == n
    assert bank.count(a + b) == n + 37  # concatenations never merge tokens


def test_fill_rejects_one_token(bank: textbank.TextBank) -> None:
    with pytest.raises(ValueError):
        bank.fill(random.Random(0), "prose", 1)


def test_counted_pieces_definition(tok: textbank.TokenizerLike) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"tools": [tool], "messages": [
        {"role": "system", "content": "Be brief.\n"},
        {"role": "user", "content": [{"type": "text", "text": "Look.\n"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "done\n"}]}
    pieces = list(gen.counted_pieces(body))
    assert pieces == [json.dumps(tool, ensure_ascii=False), "Be brief.\n", "Look.\n", "f", "{}",
                      "done\n"]
    assert gen.count_request_tokens(body, tok) == sum(len(tok.encode(p)) for p in pieces)


def _check_exact(lines: list[dict[str, Any]], tok: textbank.TokenizerLike) -> None:
    for ln in lines:
        n = gen.count_request_tokens(ln["body"], tok)
        assert n == ln["meta"]["counted_tokens"], ln["id"]
        assert n <= ln["meta"]["cap"], ln["id"]


def test_smoke4_exact_and_shaped(tok: textbank.TokenizerLike) -> None:
    lines = gen.generate("smoke4", seed=0, tok=tok)
    assert len(lines) == 4
    _check_exact(lines, tok)
    sizes = [ln["meta"]["counted_tokens"] for ln in lines]
    assert max(sizes) == 2000  # the preset promises its cap exactly on the last turn
    assert all(ln["body"]["max_completion_tokens"] == 16 for ln in lines)
    assert any(ln["meta"]["shape"]["system_messages"] == 2 for ln in lines)
    assert any(ln["meta"]["shape"]["assistant_null_content"] for ln in lines)


def test_quick8_exact_and_shaped(quick8: list[dict[str, Any]], tok: textbank.TokenizerLike
                                 ) -> None:
    assert len(quick8) == 8
    _check_exact(quick8, tok)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for ln in quick8:
        by_session.setdefault(ln["meta"]["session_id"], []).append(ln)
        body = ln["body"]
        assert body["model"] == "llm" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_completion_tokens"] == 256
        assert ln["meta"]["shape"]["tool_messages"] > 0
        for m in body["messages"]:
            for call in m.get("tool_calls") or ():
                assert "index" not in call
                json.loads(call["function"]["arguments"])
    assert len(by_session) == 2
    for reqs in by_session.values():
        assert [r["meta"]["counted_tokens"] for r in reqs] == [16_000, 24_000, 32_000, 40_000]
        for a, b in zip(reqs, reqs[1:], strict=False):  # growing history: exact message prefix
            n = len(a["body"]["messages"])
            assert b["body"]["messages"][:n] == a["body"]["messages"]
        assert any(m["role"] == "assistant" and m["content"] is None and m.get("tool_calls")
                   for m in reqs[-1]["body"]["messages"])
    # both sessions share the system prompt and tool schemas (the long shared prefix)
    s0, s1 = (reqs[0]["body"] for reqs in by_session.values())
    assert s0["messages"][0] == s1["messages"][0] and s0["tools"] == s1["tools"]
    reused, total, _, sizes = gen.prefix_reuse(quick8, tok)
    assert sizes == [ln["meta"]["counted_tokens"] for ln in quick8]
    assert 0.6 < reused / total < 0.8


def test_cap_override(tok: textbank.TokenizerLike) -> None:
    lines = gen.generate("quick8", seed=0, cap=12_000, output_tokens=32, tok=tok)
    _check_exact(lines, tok)
    assert max(ln["meta"]["counted_tokens"] for ln in lines) == 12_000
    assert {ln["body"]["max_completion_tokens"] for ln in lines} == {32}


def test_cli_is_deterministic(tmp_path: Path) -> None:
    outs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / f"{name}.jsonl"
        subprocess.run([sys.executable, GEN, "--preset", "smoke4", "--out", str(out), "--seed",
                        str(seed), "--verify", "all"], check=True, capture_output=True)
        outs.append(hashlib.sha256(out.read_bytes()).hexdigest())
        summary = json.loads((tmp_path / f"{name}.summary.json").read_text())
        assert summary["sha256"] == outs[-1] and summary["verified_requests"] == 4
    assert outs[0] == outs[1]  # same seed, identical bytes
    assert outs[0] != outs[2]


def test_same_seed_same_bytes_in_process(tok: textbank.TokenizerLike, tmp_path: Path) -> None:
    a = gen.write_jsonl(gen.generate("quick8", seed=5, tok=tok), str(tmp_path / "a.jsonl"))
    b = gen.write_jsonl(gen.generate("quick8", seed=5, tok=tok), str(tmp_path / "b.jsonl"))
    assert a == b


def test_replay88_statistics(replay88: list[dict[str, Any]], tok: textbank.TokenizerLike
                             ) -> None:
    """The 1/10-scale preset keeps replay881's shape; exact counts on every request."""
    _check_exact(replay88, tok)
    reused, total, _, _ = gen.prefix_reuse(replay88, tok)
    s = gen.summarize(replay88, reused, total, "replay88")
    assert s["requests"] == 88 and s["sessions"] == 77
    assert s["requests_with_tool_messages"] == 69
    assert s["requests_with_images"] == 3 and s["requests_with_two_images"] == 1
    assert s["requests_with_several_system"] == 3
    assert 2 <= s["median_turns"] <= 4
    ct = s["counted_tokens"]
    assert ct["max"] == 254_336
    assert 18_000 < ct["mean"] < 36_000
    assert 9_000 < ct["median"] < 18_000
    assert 55 < s["input_output_ratio"] < 65
    assert 0.5 < s["prefix_reuse"] < 0.8
    assert set(s["max_completion_tokens"]) <= {"4096", "8192", "32000", "32768", "65536"}
    for ln in replay88:
        assert ln["meta"]["counted_tokens"] + ln["body"]["max_completion_tokens"] \
            <= gen.CONTEXT_BUDGET
    # session follow-ups extend the previous request's messages byte for byte
    last: dict[str, list[dict[str, Any]]] = {}
    for ln in replay88:
        sid = ln["meta"]["session_id"]
        if sid in last:
            prev = last[sid]
            assert ln["body"]["messages"][:len(prev)] == prev
        last[sid] = ln["body"]["messages"]


def _png_size(url: str) -> tuple[int, int]:
    raw = base64.b64decode(url.split(",", 1)[1])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", raw[8:16])
    assert tag == b"IHDR"
    assert zlib.crc32(raw[12:16 + length]) == struct.unpack(">I", raw[16 + length:20 + length])[0]
    return struct.unpack(">II", raw[16:24])


def test_images_are_valid_pngs(replay88: list[dict[str, Any]]) -> None:
    urls = [part["image_url"]["url"] for ln in replay88 for m in ln["body"]["messages"]
            if isinstance(m.get("content"), list) for part in m["content"]
            if part.get("type") == "image_url"]
    assert len(urls) == 4  # 3 requests, one of them with two images
    for url in urls:
        w, h = _png_size(url)
        assert w == h and w in (64, 128, 256)
    pil = pytest.importorskip("PIL.Image")
    import io

    img = pil.open(io.BytesIO(base64.b64decode(gen.png_data_url(
        8, 8, [(255, 0, 0), (0, 255, 0), (0, 0, 255), (9, 9, 9)]).split(",", 1)[1])))
    assert img.size == (8, 8)
    assert img.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    assert img.convert("RGB").getpixel((7, 7)) == (9, 9, 9)


@pytest.mark.slow
def test_replay881_matches_platform_statistics(tmp_path: Path) -> None:
    out = tmp_path / "r881.jsonl"
    subprocess.run([sys.executable, GEN, "--preset", "replay881", "--out", str(out),
                    "--verify", "sample"], check=True, capture_output=True, timeout=600)
    s = json.loads((tmp_path / "r881.summary.json").read_text())
    t = gen.TARGETS["replay881"]
    for key in ("requests", "sessions", "median_turns", "requests_with_tool_messages",
                "requests_with_images", "requests_with_several_system"):
        assert s[key] == t[key], key
    assert s["counted_tokens"]["max"] == t["max_counted_tokens"]
    assert s["counted_tokens"]["mean"] == pytest.approx(t["mean_counted_tokens"], rel=0.05)
    assert s["counted_tokens"]["median"] == pytest.approx(t["median_counted_tokens"], rel=0.05)
    assert s["input_output_ratio"] == pytest.approx(t["input_output_ratio"], rel=0.03)
    assert s["prefix_reuse"] == pytest.approx(t["prefix_reuse"], abs=0.02)
    assert s["max_completion_tokens"]["8192"] > s["requests"] / 2  # "mostly 8192"
