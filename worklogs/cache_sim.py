#!/usr/bin/env python3
"""Prefix-cache hits at the platform's scale, by simulation: vLLM 0.32.0's own scheduler and KV
cache manager, no model execution.

Usage::

    python worklogs/cache_sim.py --dataset /tmp/perfdata/replay881.jsonl \\
        --out worklogs/results/cache-sim-replay881.json \\
        [--mnbt 8192 16384] [--capacity-scale 1.0 0.5] [--prefix-match-unit 528 16] \\
        [--checkpoint 0 1] [--offload-gib 0 128] [-c CONCURRENCY] [--max-tokens 16] [-r N]

What it builds (the way vLLM's scheduler tests do, with the real model's layout):

* the KV cache groups of Qwen3.6-35B-A3B at TP4 from ``vllm_overrides.preflight.kv_layout`` (one
  full-attention group of 10 layers, three Gated-DeltaNet groups of 10, block size 528, one
  padded page per block and layer), mamba cache mode ``align``;
* the pool size from the KV capacity ``make preflight`` predicts for ``computility-run.yaml``
  at each ``--mnbt`` (``--capacity-scale`` shrinks it to show how capacity moves the hit);
* ``--checkpoint 1``: the GDN groups reserve one prefill-checkpoint block per request
  (``MambaSpec.num_prefill_checkpoint_blocks``), what patch 0006 turns on for the native GDN
  path; the pool loses the blocks the preflight then charges for it;
* ``--offload-gib S`` (default: the YAML's ``--kv-offloading-size``): vLLM's native CPU tier
  (``OffloadingConnector``, its scheduler side and CPU manager as the server runs them) of S GiB
  for the 4 ranks, assumed to fit the host (the server shrinks it where it does not: patch
  0012); the connector's worker is emulated: every load and store is done by the next step.

It renders every request with the chat template (the tiny model's tokenizer is the real one),
replays them in dataset order at the YAML's concurrency with each session's turns in order
(as ``formal_perf_bench.py`` sends them), feeds the scheduler a fake model output per step, and
records per request the cached tokens vLLM's scheduler granted and the token-level ideal
(longest common prefix with any earlier prompt). Images are text-only here (their placeholder
tokens are not expanded). Writes JSON (config, per-config totals, per-request records) and
prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import heapq
import io
import json
import logging
import os
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "worklogs"))

import perf_metrics as pm  # noqa: E402

SCHEMA = "cache_sim/1"
TINY_MODEL = REPO / "build" / "tiny-model"
TEMPLATE = REPO / "chat_template_multi_system.jinja"
TEXT_ONLY = {"image": 0, "video": 0}


# ----------------------------------------------------------------------------------------------
# Token streams
# ----------------------------------------------------------------------------------------------


def render_dataset(path: Path, limit: int | None, cache_dir: Path) -> tuple[list[dict], str]:
    """Token ids of every request (chat template + tokenizer), cached by dataset hash."""
    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    lines = [json.loads(x) for x in raw.splitlines() if x.strip()]
    if limit is not None:
        lines = lines[:limit]
    cache = cache_dir / f"{sha[:16]}-{len(lines)}.npz"
    metas = [ln.get("meta", {}) for ln in lines]
    if cache.exists():
        data = np.load(cache)
        return [
            {"id": ln.get("id"), "meta": m, "ids": data[f"r{i}"]}
            for i, (ln, m) in enumerate(zip(lines, metas, strict=True))
        ], sha
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    template = TEMPLATE.read_text(encoding="utf-8")
    out = []
    for ln, meta in tqdm(list(zip(lines, metas, strict=True)), desc="tokenize", unit="req"):
        body = ln["body"]
        msgs = []
        for m in body["messages"]:
            m = dict(m)
            if isinstance(m.get("content"), list):  # images: text parts only
                m["content"] = "".join(
                    p.get("text", "") for p in m["content"] if p.get("type") == "text"
                )
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    fn = dict(c.get("function", {}))
                    if isinstance(fn.get("arguments"), str):
                        with contextlib.suppress(ValueError):
                            fn["arguments"] = json.loads(fn["arguments"])
                    calls.append({**c, "function": fn})
                m["tool_calls"] = calls
            msgs.append(m)
        ids = tok.apply_chat_template(
            msgs,
            tools=body.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
            chat_template=template,
            return_dict=False,
        )
        out.append({"id": ln.get("id"), "meta": meta, "ids": np.asarray(ids, dtype=np.int32)})
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **{f"r{i}": r["ids"] for i, r in enumerate(out)})
    return out, sha


# ----------------------------------------------------------------------------------------------
# The scheduler at the platform's scale
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    mnbt: int
    capacity_scale: float
    prefix_match_unit: int | None
    checkpoint: bool
    retention_interval: int | None
    concurrency: int
    max_tokens: int
    layout: str = "platform"
    # --kv-offloading-size (GiB, all TP ranks together as vLLM takes it); 0: no CPU tier.
    offload_gib: float = 0.0


def platform_pool(mnbt: int, checkpoint: bool) -> dict[str, Any]:
    """KV pool of one TP4 rank as the preflight predicts it for computility-run.yaml."""
    from vllm_overrides import preflight as pf
    from vllm_overrides.launcher import DEFAULT_CONFIG, get_flag, load_run_config

    facts = pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)
    cfg = load_run_config(DEFAULT_CONFIG)
    util = float(get_flag(cfg.command, "--gpu-memory-utilization") or 0.9)
    max_len = int(get_flag(cfg.command, "--max-model-len") or facts.max_position_embeddings)
    plan = pf.memory_plan(
        facts,
        tp=4,
        mem_per_card_gib=32,
        gpu_memory_utilization=util,
        max_num_batched_tokens=mnbt,
        max_model_len=max_len,
        checkpoint_blocks=int(checkpoint),
    )
    layout = pf.kv_layout(facts, 4, checkpoint_blocks=int(checkpoint))
    return {
        "layout": layout,
        "num_blocks": int(plan.kv_gib * pf.GIB // layout.bytes_per_block),
        "capacity_tokens": plan.kv_capacity_tokens,
        "max_model_len": max_len,
        "util": util,
    }


@functools.cache
def _model_config(max_model_len: int) -> Any:
    """The tiny model's config (same architecture; only its name and flags reach the
    scheduler), text only: the replay's images are not expanded here."""
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(TINY_MODEL),
        max_model_len=max_model_len,
        dtype="float16",
        # CACHE_SIM_MM=1 keeps the vision side (the scheduler then builds its encoder budget as
        # the server does; it made no difference to the cached tokens of quick8).
        **({} if os.environ.get("CACHE_SIM_MM") else {"limit_mm_per_prompt": TEXT_ONLY}),
    )


def tiny_pool() -> dict[str, Any]:
    """The tiny model's CPU server (TP1, bf16, VLLM_CPU_KVCACHE_SPACE=1): 1 attention + 3 GDN
    layers, block 256 ("Setting attention block size to 256 tokens" in its log), 1 GiB of KV
    = 2,048 blocks of 512 KiB; its log reports "CPU KV cache size: 521,233 tokens". Used to
    check the simulator against the real server's per-request cached tokens."""
    from vllm_overrides import preflight as pf

    block, attn_tok = 256, 2 * 256 * 2 * 2
    layout = pf.KVLayout(
        kv_heads_per_rank=2, attn_bytes_per_token_layer=attn_tok,
        mamba_state_bytes_per_layer=block * attn_tok, block_size=block,
        page_bytes=block * attn_tok, group_size=1, attention_groups=1, mamba_groups=3,
        mamba_blocks_per_group=2,
    )  # fmt: skip
    return {"layout": layout, "num_blocks": 2048, "capacity_tokens": 521_233,
            "max_model_len": 262_144, "util": None}  # fmt: skip


def build_scheduler(sim: SimConfig, concurrency: int) -> tuple[Any, dict[str, Any]]:
    import torch
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    pool = platform_pool(sim.mnbt, sim.checkpoint) if sim.layout == "platform" else tiny_pool()
    layout = pool["layout"]
    num_blocks = max(int(pool["num_blocks"] * sim.capacity_scale), 64)
    bs = layout.block_size
    model = _model_config(pool["max_model_len"])
    cache = CacheConfig(
        block_size=bs,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        mamba_block_size=bs,
        prefix_match_unit=sim.prefix_match_unit,
        prefix_cache_retention_interval=sim.retention_interval,
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=sim.mnbt,
        max_num_seqs=max(concurrency, 1),
        max_model_len=pool["max_model_len"],
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    kv_transfer = None
    if sim.offload_gib > 0:
        from vllm.config import KVTransferConfig

        # What `--kv-offloading-size S` sets up (VllmConfig._post_init_kv_transfer_config),
        # for one of the TP4 ranks: vLLM splits the bytes over its workers.
        ranks = 4 if sim.layout == "platform" else 1
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id="cache-sim",
            kv_connector_extra_config={"cpu_bytes_to_use": sim.offload_gib * (1 << 30) / ranks},
        )
    vllm_config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=sched,
        kv_transfer_config=kv_transfer,
    )  # fmt: skip
    attn = FullAttentionSpec(
        block_size=bs, num_kv_heads=layout.kv_heads_per_rank, head_size=256, dtype=torch.float16
    )
    assert attn.page_size_bytes == layout.page_bytes, (attn.page_size_bytes, layout.page_bytes)
    mamba = MambaSpec(
        block_size=bs,
        shapes=((layout.mamba_state_bytes_per_layer // 2,),),
        dtypes=(torch.float16,),
        page_size_padded=layout.page_bytes,
        mamba_type="gdn_attention",
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=int(sim.checkpoint),
        prefill_checkpoint_alignment=1 if sim.checkpoint else None,
    )
    g = layout.group_size
    groups = [KVCacheGroupSpec([f"attn.{i}" for i in range(g)], attn)]
    groups += [
        KVCacheGroupSpec([f"gdn{j}.{i}" for i in range(g)], mamba)
        for j in range(layout.mamba_groups)
    ]
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=sim.retention_interval,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_config, vllm_config)
    align = resolve_cache_hit_alignment_tokens(kv_config, vllm_config, sched_bs, hash_bs)
    kv_config.hash_block_size = hash_bs
    kv_config.cache_hit_alignment_tokens = align
    vllm_config.cache_config.hash_block_size = hash_bs
    vllm_config.cache_config.cache_hit_alignment_tokens = align
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=sched_bs,
        hash_block_size=hash_bs,
    )
    info = {
        "block_size": bs,
        "hash_block_size": hash_bs,
        "cache_hit_alignment_tokens": align,
        "num_blocks": num_blocks,
        "pool_tokens_equiv": num_blocks * bs // layout.attention_groups,
        "predicted_capacity_tokens": pool["capacity_tokens"],
        "gpu_memory_utilization": pool["util"],
    }
    return scheduler, info


def simulate(
    sim: SimConfig,
    reqs: Sequence[dict],
    ideal: Sequence[int],
    built: tuple[Any, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    scheduler, info = built or build_scheduler(sim, sim.concurrency)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(info["hash_block_size"], hash_fn)

    pending = deque(range(len(reqs)))
    session_busy: set[str] = set()
    in_flight: dict[str, int] = {}
    cached: dict[int, int] = {}
    steps = stalled = 0
    unschedulable: set[int] = set()
    prefill_steps: dict[int, int] = {}
    t0 = time.perf_counter()
    bar = tqdm(total=len(reqs), desc=f"sim mnbt={sim.mnbt} ckpt={int(sim.checkpoint)}",
               unit="req", leave=False)
    while pending or in_flight:
        # Admit in dataset order, a session's next turn only after its previous one ended.
        while len(in_flight) < sim.concurrency and pending:
            idx = next(
                (i for i in pending if reqs[i]["meta"].get("session_id") not in session_busy),
                None,
            )
            if idx is None:
                break
            pending.remove(idx)
            r = reqs[idx]
            sid = r["meta"].get("session_id") or f"solo-{idx}"
            session_busy.add(sid)
            rid = f"{idx}"
            ids = r["ids"][: info_max_prompt(info, scheduler, sim)].tolist()
            req = Request(
                request_id=rid,
                prompt_token_ids=ids,
                sampling_params=SamplingParams(
                    max_tokens=sim.max_tokens, ignore_eos=True, temperature=0.0
                ),
                pooling_params=None,
                block_hasher=hasher,
            )
            scheduler.add_request(req)
            in_flight[rid] = idx
        out = scheduler.schedule()
        steps += 1
        if out.total_num_scheduled_tokens == 0:
            # Nothing fits (a prompt longer than the pool can hold): vLLM would keep it
            # waiting forever; record it as unschedulable and move on.
            stalled += 1
            if stalled >= 50:
                stuck = [r for r in in_flight if in_flight[r] not in cached] or list(in_flight)
                unschedulable.update(in_flight[r] for r in stuck)
                scheduler.finish_requests(stuck, RequestStatus.FINISHED_ABORTED)
                stalled = 0
        else:
            stalled = 0
        for new in out.scheduled_new_reqs:
            cached[in_flight[new.req_id]] = new.num_computed_tokens
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            # schedule() has already advanced num_computed_tokens by this step's tokens.
            done_prefill = req.num_computed_tokens >= req.num_prompt_tokens
            if not done_prefill:
                prefill_steps[in_flight[rid]] = prefill_steps.get(in_flight[rid], 0) + 1
            sampled.append([7] if done_prefill else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=offload_worker_output(out.kv_connector_metadata),
        )
        scheduler.update_from_output(out, mro)
        for rid in list(in_flight):
            if rid not in scheduler.requests:
                idx = in_flight.pop(rid)
                sid = reqs[idx]["meta"].get("session_id") or f"solo-{idx}"
                session_busy.discard(sid)
                bar.update(1)
        if steps > 10_000_000:
            raise RuntimeError("simulation does not converge")
    bar.close()
    records = []
    for i, r in enumerate(reqs):
        prompt = min(len(r["ids"]), info_max_prompt(info, scheduler, sim))
        records.append(
            {
                "index": i,
                "id": r["id"],
                "session_id": r["meta"].get("session_id"),
                "prompt_tokens": prompt,
                "ideal_tokens": min(int(ideal[i]), prompt - 1),
                "cached_tokens": int(cached.get(i, 0)),
                "prefill_chunks": prefill_steps.get(i, 0) + 1,
                "status": "unschedulable" if i in unschedulable else "ok",
            }
        )
    summary = pm.cache_efficiency(records)
    return {
        "config": asdict(sim),
        "scheduler": info,
        "steps": steps,
        "sim_seconds": round(time.perf_counter() - t0, 2),
        **summary,
        "n_unschedulable": len(unschedulable),
        "records": records,
    }


def offload_worker_output(meta: Any) -> Any:
    """What the offloading connector's worker would report after this step: every load and
    store of the step done (a prompt's chunk takes the card ~1 s to prefill, its blocks
    ~10-30 ms to copy over PCIe, so transfers keep up). The scheduler side is vLLM's own."""
    if meta is None or not (meta.load_jobs or meta.store_jobs):
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    done = OffloadingWorkerMetadata()
    for job_id in (*meta.load_jobs, *meta.store_jobs):
        done.mark_completed(job_id)
    return KVConnectorOutput(
        finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
        kv_connector_worker_meta=done,
    )


def info_max_prompt(info: dict[str, Any], scheduler: Any, sim: SimConfig) -> int:
    # vLLM refuses prompts that leave no room for one output token.
    return scheduler.max_model_len - sim.max_tokens


# ----------------------------------------------------------------------------------------------
# The platform line: vLLM 0.6.3's V0 block manager + our GDN checkpoints (--engine v0)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class V0SimConfig:
    """One V0 run: the KV pool the preflight predicts with ``checkpoints`` GDN checkpoints."""

    checkpoints: int
    capacity_scale: float
    # "engine": engines/v0/prefix_cache.py's saves (prompt's last full block, system-block
    # end, one block before a block-aligned end; at most 2). "junctions": also the end of the
    # KV prefix the prompt found cached (the previous turn's end), up to 3 saves.
    policy: str
    concurrency: int
    max_tokens: int
    layout: str = "v0"


class V0BlockPool:
    """vLLM 0.6.3's ``PrefixCachingBlockAllocator`` as the replay exercises it, without tensors.

    Full blocks are named by a chained content hash; a prompt's full blocks reuse cached ones
    with the same hash (in use or evictable), the rest get a free block, else the evictor's
    least recently used one (ties: the most hashed tokens first, ``LRUEvictor``). A finished
    sequence's full blocks become evictable with its last access time, its partial block goes
    back to the free pool. ``computed_prefix`` is ``get_common_computed_block_ids``: the leading
    blocks that were cached *and* computed when the prompt arrived, never its last block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks  # hashless free blocks
        self.ref: dict[int, int] = {}  # hash -> sequences using the block (0: evictable)
        self.meta: dict[int, tuple[int, int]] = {}  # hash -> (last access, hashed tokens)
        self.heap: list[tuple[int, int, int]] = []  # (last access, -hashed tokens, hash)
        self.evictions = 0

    def cached(self, h: int) -> bool:
        return h in self.ref

    def _fresh(self) -> None:
        """One block for new content: a free one, else evict the LRU evictable block."""
        if self.free > 0:
            self.free -= 1
            return
        while self.heap:
            access, neg_depth, h = heapq.heappop(self.heap)
            if self.ref.get(h) == 0 and self.meta.get(h) == (access, -neg_depth):
                del self.ref[h]
                del self.meta[h]
                self.evictions += 1
                return
        raise RuntimeError("no block to evict: the watermark check should have refused this")

    def allocate(self, hashes: Sequence[int], partial: bool, now: int) -> int:
        """Blocks for a prompt; returns how many leading full blocks were cached (computed)."""
        leading, gap = 0, False
        for depth, h in enumerate(hashes, start=1):
            if h in self.ref:
                if self.ref[h] == 0:
                    self.meta[h] = (now, depth * self.block_size)  # out of the evictor
                self.ref[h] += 1
                if not gap:
                    leading += 1
            else:
                gap = True
                self._fresh()
                self.ref[h] = 1
                self.meta[h] = (now, depth * self.block_size)
        if partial:
            self._fresh()
        return leading

    def decode(self, out_hashes: Sequence[int], prompt_partial: bool, ends_partial: bool,
               now: int) -> bool:  # fmt: skip
        """Blocks the sampled tokens fill: the prompt's partial block becomes the first full
        one, later ones are new; a full block whose content is already cached is merged into
        the cached one (its own block freed). Returns whether a partial block is left."""
        partial_held = prompt_partial
        for h in out_hashes:
            if partial_held:
                partial_held = False  # this block was the prompt's partial one
            else:
                self._fresh()
            if h in self.ref:
                self.free += 1  # promoted onto the cached copy
                self.ref[h] += 1
            else:
                self.ref[h] = 1
            self.meta[h] = (now, 0)
        if ends_partial and not partial_held:
            self._fresh()
        return ends_partial

    def release(self, hashes: Sequence[int], partial: bool, now: int) -> None:
        for depth, h in enumerate(hashes, start=1):
            self.ref[h] -= 1
            self.meta[h] = (now, depth * self.block_size)
            if self.ref[h] == 0:
                heapq.heappush(self.heap, (now, -depth * self.block_size, h))
        if partial:
            self.free += 1


class V0CheckpointPool:
    """GDN checkpoints keyed by the hash of the block that ends at their boundary, LRU, a
    victim whose KV block is gone taken first (engines/v0/prefix_cache.CheckpointRegistry)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.by_hash: OrderedDict[int, None] = OrderedDict()

    def has(self, h: int) -> bool:
        return h in self.by_hash

    def touch(self, h: int) -> None:
        self.by_hash.move_to_end(h)

    def save(self, h: int, kv: V0BlockPool) -> None:
        if h in self.by_hash:
            self.by_hash.move_to_end(h)
            return
        if self.slots <= 0:
            return
        if len(self.by_hash) >= self.slots:
            victim = next((k for k in self.by_hash if not kv.cached(k)), None)
            if victim is None:
                victim = next(iter(self.by_hash))
            del self.by_hash[victim]
        self.by_hash[h] = None


def v0_block_hashes(ids: np.ndarray, block: int) -> list[int]:
    """Chained hashes of the full blocks (V0 hashes (previous hash, block tokens) the same way:
    a block's hash names its whole prefix)."""
    out, prev = [], 0
    for i in range(len(ids) // block):
        prev = hash((prev, ids[i * block : (i + 1) * block].tobytes()))
        out.append(prev)
    return out


def v0_save_boundaries(ids: np.ndarray, block: int, im_end: int, kv_end: int,
                       policy: str) -> list[int]:  # fmt: skip
    """Where a prompt saves GDN states (engines/v0/prefix_cache.save_boundaries, plus the end
    of its cached KV prefix under the "junctions" policy)."""
    n = len(ids)
    last = n // block * block
    out = [last] if last > 0 else []
    if im_end >= 0:
        where = np.flatnonzero(ids[:last] == im_end)
        j = (int(where[0]) + 1) // block * block if where.size else 0
        if 0 < j < last:
            out.append(j)
    if last == n and n - block > 0 and len(out) < 2:
        out.append(n - block)
    out = out[:2]
    if policy == "junctions" and 0 < kv_end < last and kv_end not in out:
        out.append(kv_end)
    return out


def v0_pool(checkpoints: int, capacity_scale: float) -> dict[str, Any]:
    """The KV pool `make preflight` predicts for computility-run.yaml with that many GDN
    checkpoints (each one costs its bytes of KV)."""
    from vllm_overrides import preflight as pf
    from vllm_overrides.launcher import PLATFORM_CONFIG, get_flag, load_run_config

    facts = pf.ModelFacts.load(pf.DEFAULT_MODEL_CONFIG)
    cfg = load_run_config(PLATFORM_CONFIG)
    plan = pf.v0_memory_plan(
        facts,
        tp=int(get_flag(cfg.command, "-tp") or get_flag(cfg.command, "--tensor-parallel-size")
               or 1),
        gpu_memory_utilization=float(get_flag(cfg.command, "--gpu-memory-utilization") or 0.9),
        max_num_batched_tokens=int(get_flag(cfg.command, "--max-num-batched-tokens") or 8192),
        max_num_seqs=int(get_flag(cfg.command, "--max-num-seqs") or 256),
        max_model_len=int(get_flag(cfg.command, "--max-model-len") or 262_144),
        gdn_checkpoints=checkpoints,
        ipc=cfg.env.get("ENABLE_CUSTOM_IPC") == "1",
    )  # fmt: skip
    blocks = max(int(plan.num_gpu_blocks * capacity_scale), 64)
    return {"num_blocks": blocks, "block_size": pf.V0_BLOCK_SIZE,
            "watermark_blocks": int(pf.V0_WATERMARK * blocks),
            "max_model_len": plan.max_model_len, "preflight_blocks": plan.num_gpu_blocks,
            "util": plan.gpu_memory_utilization}  # fmt: skip


def simulate_v0(sim: V0SimConfig, reqs: Sequence[dict], ideal: Sequence[int],
                im_end: int) -> dict[str, Any]:  # fmt: skip
    """Requests one at a time in dataset order (the replay's concurrency 1): each prompt's hit
    is the longest computed cached prefix whose last block has a GDN checkpoint; its prefill
    saves checkpoints past the hit; ``max_tokens`` fake tokens are decoded into its blocks."""
    if sim.concurrency != 1:
        raise ValueError("the V0 simulator replays at concurrency 1 (the platform's)")
    pool = v0_pool(sim.checkpoints, sim.capacity_scale)
    bs = pool["block_size"]
    kv = V0BlockPool(pool["num_blocks"], bs)
    ckpt = V0CheckpointPool(sim.checkpoints)
    limit = pool["max_model_len"] - sim.max_tokens
    records = []
    t0 = time.perf_counter()
    for i, r in enumerate(tqdm(reqs, desc=f"v0 ckpt={sim.checkpoints}", leave=False)):
        ids = np.asarray(r["ids"][:limit], dtype=np.int32)
        n = len(ids)
        status, hit, chunks = "ok", 0, 0
        if kv.num_blocks - cdiv(n, bs) < pool["watermark_blocks"]:
            status = "unschedulable"  # BlockSpaceManagerV2: AllocStatus.NEVER
        else:
            hashes = v0_block_hashes(ids, bs)
            leading = kv.allocate(hashes, n % bs != 0, now=i)
            computed = min(leading, cdiv(n, bs) - 1)  # never the sequence's last block
            for k in range(computed, 0, -1):
                if ckpt.has(hashes[k - 1]):
                    hit = k * bs
                    ckpt.touch(hashes[k - 1])
                    break
            for b in v0_save_boundaries(ids, bs, im_end, computed * bs, sim.policy):
                if b > hit:
                    ckpt.save(hashes[b // bs - 1], kv)
            chunks = cdiv(n - hit, 8192)
            # Decode: the sampled tokens fill the prompt's partial block and new ones (fake ids:
            # the next turn's prompt renders the answer its own way), then all are freed.
            full = np.concatenate([ids, np.full(sim.max_tokens, -1, dtype=np.int32)])
            out_hashes = v0_block_hashes(full, bs)[len(hashes) :]
            tail = kv.decode(out_hashes, n % bs != 0, len(full) % bs != 0, now=i)
            kv.release(hashes + out_hashes, tail, now=i)
        records.append({
            "index": i, "id": r["id"], "session_id": r["meta"].get("session_id"),
            "prompt_tokens": n, "ideal_tokens": min(int(ideal[i]), n - 1),
            "cached_tokens": hit, "prefill_chunks": chunks, "status": status,
        })  # fmt: skip
    summary = pm.cache_efficiency(records)
    return {
        "config": asdict(sim),
        "scheduler": {
            "engine": "vLLM 0.6.3 V0 (block manager v2, prefix caching) + GDN checkpoints",
            "block_size": bs, "num_blocks": pool["num_blocks"],
            "preflight_blocks": pool["preflight_blocks"],
            "watermark_blocks": pool["watermark_blocks"],
            "pool_tokens_equiv": pool["num_blocks"] * bs,
            "predicted_capacity_tokens": pool["preflight_blocks"] * bs,
            "gpu_memory_utilization": pool["util"], "kv_evictions": kv.evictions,
        },  # fmt: skip
        "sim_seconds": round(time.perf_counter() - t0, 2),
        **summary,
        "n_unschedulable": sum(1 for x in records if x["status"] != "ok"),
        "records": records,
    }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def im_end_id() -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    found = tok.convert_tokens_to_ids("<|im_end|>")
    return found if isinstance(found, int) and found != tok.unk_token_id else -1


def main_v0(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    concurrency = args.concurrency or 1
    reqs, sha = render_dataset(args.dataset, args.requests, args.token_cache)
    ideal = pm.ideal_prefix_tokens([r["ids"] for r in reqs])
    im_end = im_end_id()
    runs = [
        simulate_v0(V0SimConfig(ck, scale, policy, concurrency, args.max_tokens), reqs, ideal,
                    im_end)  # fmt: skip
        for ck in args.checkpoints
        for scale in args.capacity_scale
        for policy in args.policy
    ]
    rows = []
    for run in runs:
        c, s = run["config"], run["scheduler"]
        rows.append((
            c["checkpoints"], c["policy"], c["capacity_scale"], f"{s['num_blocks']:,}",
            f"{s['pool_tokens_equiv']:,}", f"{s['kv_evictions']:,}", pm.pct(run["hit"]),
            pm.pct(run["ideal_hit"]), pm.pct(run["efficiency"]), run["n_unschedulable"],
        ))  # fmt: skip
    print(pm.render_table(rows, ("ckpts", "policy", "cap x", "blocks", "KV tokens",
                                 "evictions", "hit", "ideal", "efficiency", "unsched.")))
    result = {
        "schema": SCHEMA,
        "engine": "v0",
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
        "dataset": {"path": str(args.dataset), "sha256": sha, "n_requests": len(reqs)},
        "concurrency": concurrency,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("-r", "--requests", type=int, help="only the first N requests")
    ap.add_argument("-c", "--concurrency", type=int, help="default: the YAML's concurrency")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mnbt", type=int, nargs="+", default=[8192])
    ap.add_argument("--capacity-scale", type=float, nargs="+", default=[1.0])
    ap.add_argument("--prefix-match-unit", type=int, nargs="+", default=[0],
                    help="0: vLLM's default (the block size)")
    ap.add_argument("--checkpoint", type=int, nargs="+", default=[0], choices=(0, 1))
    ap.add_argument("--retention-interval", type=int, default=0,
                    help="--prefix-cache-retention-interval (vLLM default 0; -1: dense)")
    ap.add_argument("--layout", choices=("platform", "tiny-cpu"), default="platform",
                    help="platform: Qwen3.6-35B-A3B at TP4 with the YAML's capacity; tiny-cpu: "
                    "the tiny model's CPU server (to check the simulator against it)")
    ap.add_argument("--offload-gib", type=float, nargs="+",
                    help="--kv-offloading-size in GiB (all ranks; 0: no CPU tier); default: "
                    "the YAML's")
    ap.add_argument("--token-cache", type=Path, default=Path("/tmp/cache_sim_tokens"))
    ap.add_argument("--engine", choices=("v1", "v0"), default="v1",
                    help="v1: vLLM 0.32.0's scheduler (the reference line); v0: the platform "
                    "line's vLLM 0.6.3 block manager + GDN checkpoints, the KV pool from "
                    "computility-run.yaml's V0 preflight")
    ap.add_argument("--checkpoints", type=int, nargs="+", default=[32],
                    help="v0: GDN checkpoint pool sizes (each one costs its bytes of KV)")
    ap.add_argument("--policy", nargs="+", choices=("engine", "junctions"), default=["engine"],
                    help="v0: where checkpoints are saved (see V0SimConfig)")
    args = ap.parse_args(argv)
    if args.engine == "v0":
        return main_v0(args, argv)

    logging.disable(logging.WARNING)
    from vllm_overrides.launcher import DEFAULT_CONFIG, get_flag, load_run_config

    run_config = load_run_config(DEFAULT_CONFIG)
    concurrency = args.concurrency or run_config.concurrency
    if args.offload_gib is None:
        args.offload_gib = [float(get_flag(run_config.command, "--kv-offloading-size") or 0)]
    reqs, sha = render_dataset(args.dataset, args.requests, args.token_cache)
    ideal = pm.ideal_prefix_tokens([r["ids"] for r in reqs])
    runs = []
    grid = [
        SimConfig(mnbt, scale, pmu or None, bool(ck),
                  None if args.retention_interval < 0 else args.retention_interval,
                  concurrency, args.max_tokens, args.layout, gib)
        for mnbt in args.mnbt
        for gib in args.offload_gib
        for scale in args.capacity_scale
        for pmu in args.prefix_match_unit
        for ck in args.checkpoint
    ]
    for sim in tqdm(grid, desc="configs", unit="cfg"):
        with contextlib.redirect_stdout(io.StringIO()):
            runs.append(simulate(sim, reqs, ideal))
    rows = []
    for run in runs:
        c, s = run["config"], run["scheduler"]
        rows.append((
            c["mnbt"], c["capacity_scale"], s["hash_block_size"], int(c["checkpoint"]),
            f"{c['offload_gib']:g}",
            f"{s['num_blocks']:,}", f"{s['predicted_capacity_tokens']:,}",
            pm.pct(run["hit"]), pm.pct(run["ideal_hit"]), pm.pct(run["efficiency"]),
            f"{run['prefill_chunks_mean']:.2f}",
        ))
    print(pm.render_table(rows, ("mnbt", "cap x", "hash unit", "ckpt", "cpu GiB", "blocks",
                                 "capacity", "hit", "ideal", "efficiency", "chunks/req")))
    result = {
        "schema": SCHEMA,
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
        "dataset": {"path": str(args.dataset), "sha256": sha, "n_requests": len(reqs)},
        "concurrency": concurrency,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
