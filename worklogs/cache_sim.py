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
import io
import json
import logging
import os
import sys
import time
from collections import deque
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
    args = ap.parse_args(argv)

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
