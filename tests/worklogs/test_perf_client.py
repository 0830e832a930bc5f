"""The streaming client against httpx.MockTransport: every outcome becomes a record."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))

import perf_client  # noqa: E402
import perf_metrics as pm  # noqa: E402


def sse(*events: dict | str, delay: float = 0.0) -> Callable[[], AsyncIterator[bytes]]:
    async def gen() -> AsyncIterator[bytes]:
        for ev in events:
            if delay:
                await asyncio.sleep(delay)
            data = ev if isinstance(ev, str) else json.dumps(ev)
            yield f"data: {data}\n\n".encode()
    return gen


def delta(**d: object) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 64}}}
FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}

STREAMS = {
    "ok": sse(delta(role="assistant", content=""), delta(content="Hi"), delta(content="!"),
              FINISH, USAGE, "[DONE]"),
    "reasoning": sse(delta(role="assistant", content=""), delta(reasoning_content="hmm"),
                     delta(content="x"), FINISH, USAGE, "[DONE]"),
    "reasoning_new_name": sse(delta(reasoning="hmm"), FINISH, USAGE, "[DONE]"),
    "toolcall": sse(delta(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                                       "function": {"name": "f", "arguments": "{}"}}]),
                    FINISH, USAGE, "[DONE]"),
    "midstream_error": sse(delta(content="a"), {"error": {"message": "engine dead",
                                                          "code": 500}}),
    "no_usage": sse(delta(content="a"), FINISH, "[DONE]"),
    "no_done": sse(delta(content="a"), FINISH, USAGE),
    "slow": sse(delta(content="a"), FINISH, USAGE, "[DONE]", delay=0.4),
    "seq1": sse(delta(content="a"), FINISH, USAGE, "[DONE]", delay=0.05),
    "seq2": sse(delta(content="a"), FINISH, USAGE, "[DONE]", delay=0.05),
}


def handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    kind = body["messages"][0]["content"]
    if kind == "bad_request":
        return httpx.Response(400, json={"error": {"message": "at most 1 image"}})
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=STREAMS[kind]())


def spec(kind: str, session: str | None = None) -> perf_client.RequestSpec:
    return perf_client.RequestSpec(kind, {"model": "llm", "stream": True, "messages": [
        {"role": "user", "content": kind}]}, session_id=session, counted_tokens=100)


def run(specs: list[perf_client.RequestSpec], concurrency: int = 4, timeout: float = 5.0,
        session_deps: bool = True) -> list[dict]:
    return asyncio.run(perf_client.run_specs(
        "http://test", specs, concurrency, timeout, session_deps=session_deps,
        transport=httpx.MockTransport(handler)))


def test_outcomes_are_all_recorded_in_order() -> None:
    kinds = ["ok", "reasoning", "reasoning_new_name", "toolcall", "bad_request",
             "midstream_error", "no_usage", "no_done", "slow"]
    recs = run([spec(k) for k in kinds], timeout=1.0)
    assert [r["id"] for r in recs] == kinds
    by = {r["id"]: r for r in recs}
    assert by["ok"]["status"] == "ok"
    assert (by["ok"]["prompt_tokens"], by["ok"]["completion_tokens"],
            by["ok"]["cached_tokens"]) == (120, 3, 64)
    assert by["ok"]["finish_reason"] == "stop" and by["ok"]["content_chars"] == 3
    for k in ("ok", "reasoning", "reasoning_new_name", "toolcall"):
        assert by[k]["status"] == "ok", by[k]
        assert by[k]["t_start"] <= by[k]["t_first_token"] <= by[k]["t_end"]
    assert by["reasoning"]["reasoning_chars"] == 3
    assert by["toolcall"]["tool_call_chunks"] == 1
    assert by["bad_request"]["status"] == "http_error"
    assert by["bad_request"]["http_status"] == 400
    assert "at most 1 image" in by["bad_request"]["error"]
    assert by["midstream_error"]["status"] == "stream_error"
    assert "engine dead" in by["midstream_error"]["error"]
    assert by["no_usage"]["status"] == "incomplete"
    assert by["no_done"]["status"] == "incomplete"
    assert by["slow"]["status"] == "timeout"
    assert all(r["t_end"] is not None and r["t_end"] >= r["t_start"] for r in recs)
    m = pm.compute_metrics(recs)
    assert m["n_requests"] == len(kinds) and m["n_ok"] == 4
    assert m["status_counts"]["timeout"] == 1


def test_record_log_keeps_each_record_as_its_request_ends(tmp_path: Path) -> None:
    log = tmp_path / "records.jsonl"
    kinds = ["ok", "bad_request", "slow", "toolcall"]
    recs = asyncio.run(perf_client.run_specs(
        "http://test", [spec(k) for k in kinds], 1, 1.0,
        transport=httpx.MockTransport(handler), record_log=log))  # fmt: skip
    logged = [json.loads(ln) for ln in log.read_text().splitlines()]
    # concurrency 1: in completion order = dataset order, the same records the call returns
    assert logged == recs
    assert [r["status"] for r in logged] == ["ok", "http_error", "timeout", "ok"]


def test_role_only_first_chunk_is_not_the_first_token() -> None:
    rec = run([spec("ok")])[0]
    # the empty-content role chunk came first; TTFT is set by "Hi"
    assert rec["n_chunks"] == 5 and rec["t_first_token"] is not None


def test_session_dependencies() -> None:
    recs = run([spec("seq1", "s"), spec("seq2", "s")], concurrency=2)
    assert recs[1]["t_start"] >= recs[0]["t_end"]
    recs = run([spec("seq1", "s"), spec("seq2", "s")], concurrency=2, session_deps=False)
    assert recs[1]["t_start"] < recs[0]["t_end"]


@pytest.mark.parametrize("mode,expect_max,expect_ignore", [
    ("body", 8192, False), ("target", 300, False), ("exact", 300, True)])
def test_output_len_modes(mode: str, expect_max: int, expect_ignore: bool) -> None:
    import formal_perf_bench as fpb

    line = {"id": "x", "meta": {"session_id": "s", "target_output_tokens": 300,
                                "counted_tokens": 10},
            "body": {"model": "llm", "messages": [], "max_completion_tokens": 8192,
                     "stream": True, "stream_options": {"include_usage": True}}}
    s = fpb.build_specs([line], mode, None, None)[0]
    assert s.body["max_completion_tokens"] == expect_max
    assert s.body.get("ignore_eos", False) is expect_ignore
    assert fpb.build_specs([line], mode, 32, "m")[0].body["max_completion_tokens"] == 32
    assert fpb.build_specs([line], mode, 32, "m")[0].body["model"] == "m"
    assert line["body"]["max_completion_tokens"] == 8192  # the dataset line is not mutated
