#!/usr/bin/env python3
"""vLLM 0.6.3's V0 engine with our overlay on a GPU: the tiny model against transformers, one
TP4 rank of Qwen3.6-35B-A3B at real size, and the card's paper score (issue 48, items 3 and 4).

Subcommands (each engine in a process of its own: vLLM's parallel state is per process):

``rank-config --template CONFIG.json --out DIR [--tp 4]``
    A TP 1 model directory (config.json only) whose every layer has the sizes one rank of
    ``--tp`` has: Qwen3.6-35B-A3B's sizes (``vllm_overrides/model_facts/qwen3_6_35b_a3b.json``)
    with heads, expert / shared intermediate sizes and the vocabulary (the rank's shard of the
    vocab-parallel embedding and LM head) divided by ``--tp``; KV heads ``max(1, 2 / tp)`` (at
    TP 4 each rank keeps one replicated KV head). The keys the facts file lacks come from the
    template (the tiny model's config.json, which has the real key set). ``--shrink`` makes a
    CPU-sized look-alike (for a dry run of ``real`` on the stand-in).

``tiny --model DIR --oracle JSON --dtype float32|float16 --out F.json``
    ``vllm.LLM`` (V0, greedy, chunked prefill with a 256-token budget so the long prompts cross
    chunk boundaries, prefix caching asked for as the YAML does, every prompt in one
    ``generate`` call) against the oracle's transformers tokens. float32 must be
    token-identical; float16 is reported as matched-prefix lengths.

``real --model DIR --out F.json [--contexts 4096,32768] [--prefill 16384]``
    The rank-sized model with random weights (``load_format="dummy"``: made on the device, none
    read) at TP 1, ``dtype=half``, ``enforce_eager``, chunked prefill at 8,192 tokens a step
    (the YAML's). Per case the engine's own ``step()`` wall time, and inside it the model's
    forward (synchronised around it); kernel launches of one decode step and of one forward
    (``torch.profiler``); the copy floor (weights read by a B = 1 step -- the 8 routed experts
    of each layer, every dense weight, the LM-head shard -- + GDN state read and write + KV read,
    over the device-to-device copy rate measured in this run, read + written bytes per second
    as ``decode_step_bench.copy_gbps``) and a matmul floor (the step's GEMM FLOPs over a large
    fp16 ``torch.mm``'s rate measured in this run). Prefill: one prompt of ``--prefill`` tokens,
    each 8,192-token chunk timed (fresh, then over the cached context); the ``--contexts``
    prompts' chunks are timed too.

``collectives --model DIR --out F.json``
    Issue 49's count on one device: the collectives a TP > 1 decode step of our model runs, by
    forward hooks on the modules that run them, counted on a TP 1 engine (see
    :func:`cmd_collectives`).

``paper --result F.json [--dataset replay881.jsonl] --out P.json``
    The paper score for the card from a ``real`` result: see :func:`paper_score`.

Progress goes to stdout; each subcommand writes its JSON and a text table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FACTS = REPO / "vllm_overrides" / "model_facts" / "qwen3_6_35b_a3b.json"
CHUNK = 8192  # computility-run.yaml --max-num-batched-tokens


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write(out: Path, data: dict[str, Any], table: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    out.with_suffix(".txt").write_text(table + "\n")
    print(table, flush=True)


def env_meta() -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "host": platform.node(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "commit": os.environ.get("COMMIT", "unknown"),
        "env": {k: os.environ[k] for k in ("NATIVE_KERNELS", "GDN_CHUNK_KERNEL",
                                            "MOE_PREFILL_GEMM", "VO_ATTENTION") if k in os.environ},
    }  # fmt: skip
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001 - recorded
        meta["vllm"] = f"not importable: {exc}"
    return meta


# ---------------------------------------------------------------------------------------------
# rank-config
# ---------------------------------------------------------------------------------------------


def rank_text_config(facts: dict[str, Any], tp: int) -> dict[str, Any]:
    """Qwen3.6-35B-A3B's text sizes as one rank of TP ``tp`` holds them."""
    t = facts["text_config"]
    return {
        "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_hidden_layers"],
        "layer_types": t["layer_types"], "full_attention_interval": t["full_attention_interval"],
        "num_attention_heads": t["num_attention_heads"] // tp,
        "num_key_value_heads": max(1, t["num_key_value_heads"] // tp),
        "head_dim": t["head_dim"], "partial_rotary_factor": t["partial_rotary_factor"],
        "linear_num_key_heads": t["linear_num_key_heads"] // tp,
        "linear_num_value_heads": t["linear_num_value_heads"] // tp,
        "linear_key_head_dim": t["linear_key_head_dim"],
        "linear_value_head_dim": t["linear_value_head_dim"],
        "linear_conv_kernel_dim": t["linear_conv_kernel_dim"],
        "num_experts": t["num_experts"], "num_experts_per_tok": t["num_experts_per_tok"],
        "moe_intermediate_size": t["moe_intermediate_size"] // tp,
        "shared_expert_intermediate_size": t["shared_expert_intermediate_size"] // tp,
        "vocab_size": t["vocab_size"] // tp,
        "max_position_embeddings": t["max_position_embeddings"],
        "mtp_num_hidden_layers": 0,
    }  # fmt: skip


SHRINK = {"hidden_size": 256, "num_hidden_layers": 8, "num_experts": 16,
          "num_experts_per_tok": 4, "vocab_size": 4096}  # fmt: skip


def cmd_rank_config(args: argparse.Namespace) -> int:
    cfg = json.loads(Path(args.template).read_text())
    text = rank_text_config(json.loads(FACTS.read_text()), args.tp)
    if args.shrink:
        text.update(SHRINK)
        text["layer_types"] = text["layer_types"][: SHRINK["num_hidden_layers"]]
    cfg["text_config"].update(text)
    # The template's (tiny) vision tower stays; its output must meet the text width.
    if "vision_config" in cfg:
        cfg["vision_config"]["out_hidden_size"] = text["hidden_size"]
    # Special token ids inside the rank's vocabulary shard (the profiling prompt of a multimodal
    # model may open with an image; its ids must index the shard's embedding).
    specials = sorted(k for k, v in cfg.items() if k.endswith("_token_id") and isinstance(v, int))
    for i, k in enumerate(specials):
        cfg[k] = text["vocab_size"] - 1 - i
    cfg["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    cfg["_v0_gpu_bench"] = f"one rank of TP {args.tp} as a TP 1 model (worklogs/v0_gpu_bench.py)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    # The image processor's settings (the profiling prompt's largest image is sized by them).
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        src = Path(args.template).parent / name
        if src.exists():
            (out / name).write_text(src.read_text())
    log(f"wrote {out / 'config.json'}: {json.dumps(text)[:300]}")
    return 0


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------


def make_llm(model: str, dtype: str, **kw: Any) -> Any:
    """``vllm.LLM`` with our plugin registered (a deployed overlay's entry point does it too)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the stand-in's KV (CPU only)
    from vllm import LLM

    from vllm_overrides.engines.v0 import register

    register()
    base = dict(model=model, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                enable_chunked_prefill=True, seed=0, enable_prefix_caching=True)  # fmt: skip
    return LLM(**{**base, **kw})


def engine_paths(llm: Any) -> dict[str, Any]:
    """What ran: the runner, the model class, the attention backend, the op paths."""
    from vllm_overrides.native import kernels

    worker = llm.llm_engine.model_executor.driver_worker
    runner = worker.model_runner
    return {
        "executor": type(llm.llm_engine.model_executor).__name__,
        "runner": type(runner).__name__, "model": type(runner.model).__name__,
        "attn_backend": runner.attn_backend.get_name(),
        "kv_tensors": len(worker.cache_engine[0].gpu_cache),
        "kv_device": str(worker.cache_engine[0].gpu_cache[0].device),
        "chunked_prefill": llm.llm_engine.scheduler_config.chunked_prefill_enabled,
        "prefix_caching": llm.llm_engine.cache_config.enable_prefix_caching,
        "ops_fused": sorted(kernels.FUSED_USED), "ops_torch": sorted(kernels.TORCH_USED),
        "extension_error": kernels._load_error,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# tiny
# ---------------------------------------------------------------------------------------------

TINY_NAMES = ["len20", "len500", "len2000", "prefix_hit", "batch0", "batch1", "batch2", "batch3"]


def compare(outs: list[Any], names: list[str], oracle: dict[str, Any], max_new: int
            ) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for name, out in zip(names, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want = oracle[name]["tokens"][:max_new]
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)))  # fmt: skip
        lps = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got, strict=False)]
        lp_diff = [abs(a - b) for a, b in zip(lps[:same], oracle[name]["logprobs"], strict=False)]
        rows.append({
            "name": name, "prompt_tokens": len(oracle[name]["prompt"]), "identical": got == want,
            "matched_prefix": same, "generated": len(got),
            "max_logprob_diff_on_match": max(lp_diff) if lp_diff else None,
            "oracle_top2_gap_at_divergence": (oracle[name]["top2_gap"][same]
                                              if same < len(want) else None),
        })  # fmt: skip
    return rows


def cmd_tiny(args: argparse.Namespace) -> int:
    """Every oracle must hold the same prompts (hf_oracle.py's); the engine runs once."""
    from vllm import SamplingParams

    missing = [o for o in args.oracle if not Path(o).exists()]
    if missing:
        log(f"oracles missing, left out: {missing}")
    oracles = {o: json.loads(Path(o).read_text()) for o in args.oracle if o not in missing}
    if not oracles:
        raise SystemExit("no oracle to compare with")
    first = next(iter(oracles.values()))
    names = [n for n in TINY_NAMES if n in first]
    t0 = time.perf_counter()
    llm = make_llm(args.model, args.dtype, max_num_batched_tokens=256, max_num_seqs=16,
                   max_model_len=4096, gpu_memory_utilization=args.gpu_mem)  # fmt: skip
    t_start = time.perf_counter() - t0
    log(f"engine up in {t_start:.1f} s ({args.dtype})")
    max_new = args.max_new
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": first[n]["prompt"]} for n in names], params,
                        use_tqdm=False)  # fmt: skip
    t_gen = time.perf_counter() - t0
    res: dict[str, Any] = {
        "meta": env_meta(), "dtype": args.dtype, "model": args.model, "max_new": max_new,
        "engine_start_s": t_start, "generate_s": t_gen, "paths": engine_paths(llm),
        "by_oracle": {},
    }  # fmt: skip
    lines = [f"V0 tiny model vs transformers, {args.dtype}, {res['meta'].get('device', 'cpu')}, "
             f"paths {res['paths']}"]  # fmt: skip
    ok = True
    for path, oracle in oracles.items():
        same_prompts = all(oracle[n]["prompt"] == first[n]["prompt"] for n in names)
        rows = compare(outs, names, oracle, max_new) if same_prompts else []
        ident = bool(rows) and all(r["identical"] for r in rows)
        ok = ok and ident
        res["by_oracle"][path] = {"rows": rows, "all_identical": ident,
                                  "same_prompts": same_prompts}  # fmt: skip
        lines += [f"oracle {path}: {sum(r['identical'] for r in rows)}/{len(rows)} identical",
                  f"{'prompt':<12}{'tokens':>8}{'identical':>11}{'matched':>9}{'max dlogp':>11}"
                  f"{'HF gap@div':>12}"]  # fmt: skip
        for r in rows:
            d, g = r["max_logprob_diff_on_match"], r["oracle_top2_gap_at_divergence"]
            lines.append(f"{r['name']:<12}{r['prompt_tokens']:>8}{r['identical']!s:>11}"
                         f"{r['matched_prefix']:>9}{'' if d is None else f'{d:.2e}':>11}"
                         f"{'' if g is None else f'{g:.3f}':>12}")  # fmt: skip
    res["all_identical"] = ok
    write(Path(args.out), res, "\n".join(lines))
    return 0 if (ok or args.dtype != "float32") else 1


# ---------------------------------------------------------------------------------------------
# real
# ---------------------------------------------------------------------------------------------


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_gbps(small: bool) -> float | None:
    """Device-to-device copy, read + written bytes per second (decode_step_bench's definition)."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.randn((1 << 20) if small else (1 << 28), device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(20):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    gbps = 2 * src.numel() * 4 / best / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbps


def matmul_tfps(small: bool) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    n = 1024 if small else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(10):
        sync()
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / best / 1e12


def model_bytes(model: Any) -> dict[str, Any]:
    """Parameter bytes by kind, and what a B = 1 decode step reads of them."""
    text = model.text_config
    frac = text.num_experts_per_tok / text.num_experts
    total = experts = embed = 0
    gemm_params = 0.0  # weights a token multiplies (GEMM FLOPs = 2 x this per token)
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        total += b
        if ".experts.w" in name:
            experts += b
            gemm_params += p.numel() * frac
        elif "embed_tokens" in name:
            embed += b
        elif p.dim() == 2:
            gemm_params += p.numel()
    read = total - embed - experts * (1 - frac) + embed / text.vocab_size
    return {"total_bytes": total, "expert_bytes": experts, "embedding_bytes": embed,
            "decode_weight_bytes_read": read, "gemm_params_per_token": gemm_params}  # fmt: skip


def state_bytes(model: Any, ctx: int) -> dict[str, float]:
    """Per sequence and step: GDN state read + written, conv state read + written, KV read."""
    text, m = model.text_config, model
    g = m._gdn_layers[0]
    n_gdn, n_attn = len(m._gdn_layers), sum(t == "full_attention" for t in text.layer_types)
    ssm = n_gdn * g.HV * g.V * g.K * 4  # float32
    conv = n_gdn * g.conv_dim * (g.W - 1) * 2
    kv_heads = max(1, text.num_key_value_heads)
    kv = n_attn * 2 * kv_heads * text.head_dim * 2 * ctx
    return {"gdn_state_rw": 2 * ssm, "conv_state_rw": 2 * conv, "kv_read": kv}


def attn_flops(model: Any, new: int, cached: int) -> float:
    """QK^T and PV FLOPs of the full-attention layers for ``new`` tokens over ``cached``."""
    text = model.text_config
    n_attn = sum(t == "full_attention" for t in text.layer_types)
    pairs = new * cached + new * (new + 1) / 2
    return n_attn * text.num_attention_heads * 2 * 2 * text.head_dim * pairs


class ForwardTimer:
    """Wraps the model's forward: its synchronised wall time per call (the rest of an engine
    step is scheduling, input preparation, logits, sampling and output processing)."""

    def __init__(self, model: Any) -> None:
        self.model, self.orig, self.ms = model, model.forward, []
        self.profile_next = False
        self.profile: dict[str, Any] | None = None
        model.forward = self

    def __call__(self, *a: Any, **k: Any) -> Any:
        sync()
        t = time.perf_counter()
        if self.profile_next:
            self.profile_next = False
            self.profile, out = profile_call(lambda: self.orig(*a, **k))
        else:
            out = self.orig(*a, **k)
        sync()
        self.ms.append((time.perf_counter() - t) * 1e3)
        return out


def profile_call(fn: Any) -> tuple[dict[str, Any], Any]:
    """Kernel launches (CUDA kernels + memcpy/memset) of one call, and the top kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        out = fn()
        sync()
    if not cuda:
        ops = [e for e in prof.events() if e.cpu_parent is None and "::" in e.name]
        return {"launches": len(ops), "note": "CPU: top-level operators"}, out
    dev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by: dict[str, list[float]] = {}
    for e in dev:
        by.setdefault(e.name[:80], []).append(e.time_range.elapsed_us())
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "launches": len(dev),
        "copies": sum(1 for e in dev if e.name.startswith(("Memcpy", "Memset"))),
        "device_busy_us": sum(sum(v) for v in by.values()),
        "top_kernels": [{"name": k, "calls": len(v), "us": round(sum(v), 1)} for k, v in top],
    }, out


def run_prompt(llm: Any, rid: str, n_prompt: int, max_tokens: int, timer: ForwardTimer,
               profile_step: int | None = None,
               profile_forward_step: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One request alone: each engine step's wall time and forward time, split into the prefill
    chunks and the decode steps that follow."""
    import random

    from vllm import SamplingParams

    eng = llm.llm_engine
    rng = random.Random(n_prompt)
    vocab = eng.model_config.hf_text_config.vocab_size
    ids = [rng.randrange(0, vocab) for _ in range(n_prompt)]
    eng.add_request(rid, {"prompt_token_ids": ids},
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    steps: list[dict[str, Any]] = []
    step_profile = None
    while eng.has_unfinished_requests():
        n_before = len(timer.ms)
        prof = profile_step is not None and len(steps) == profile_step
        timer.profile_next = len(steps) == profile_forward_step
        t = time.perf_counter()
        if prof:
            step_profile, outs = profile_call(eng.step)
        else:
            outs = eng.step()
        ms = (time.perf_counter() - t) * 1e3
        fwd = sum(timer.ms[n_before:])
        out = next((o for o in outs if o.request_id == rid), None)
        steps.append({"ms": ms, "forward_ms": fwd, "profiled": prof,
                      "generated": len(out.outputs[0].token_ids) if out else None})  # fmt: skip
    prefill = [s for s in steps if not s["generated"]]
    first = next(i for i, s in enumerate(steps) if s["generated"])
    prefill.append(steps[first])  # the last chunk samples the first token
    decode = steps[first + 1 :]
    return {"prompt": n_prompt, "max_tokens": max_tokens, "steps": steps,
            "prefill_steps": prefill, "decode_steps": decode, "step_profile": step_profile}


def chunk_row(model: Any, new: int, cached: int, step: dict[str, Any]) -> dict[str, Any]:
    return {"new": new, "cached": cached, "ms": step["ms"], "forward_ms": step["forward_ms"],
            "attn_flops": attn_flops(model, new, cached)}  # fmt: skip


def cmd_real(args: argparse.Namespace) -> int:
    import torch

    small = not torch.cuda.is_available()
    res: dict[str, Any] = {"meta": env_meta(), "model_dir": args.model, "chunk": args.chunk,
                           "dtype": args.dtype}  # fmt: skip
    out = Path(args.out)
    bw, tf = copy_gbps(small), matmul_tfps(small)
    res.update(copy_GBps=bw, matmul_fp16_TFps=tf)
    log(f"copy {bw} GB/s (read+write), fp16 mm {tf} TF/s")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    max_len = max(contexts + [args.prefill]) + args.decode_steps + 64
    t0 = time.perf_counter()
    llm = make_llm(args.model, args.dtype, load_format="dummy", max_model_len=max_len,
                   max_num_batched_tokens=args.chunk, max_num_seqs=2,
                   gpu_memory_utilization=args.gpu_mem)  # fmt: skip
    res["engine_start_s"] = time.perf_counter() - t0
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    model = runner.model
    res["bytes"] = model_bytes(model)
    log(f"engine up in {res['engine_start_s']:.1f} s; weights {res['bytes']['total_bytes']/1e9:.2f}"
        f" GB; paths {engine_paths(llm)}")
    timer = ForwardTimer(model)
    # Warm-up: a short request (first calls of each op; the extension loaded).
    run_prompt(llm, "warm", min(512, args.chunk), 4, timer)
    cases = []
    for ctx in contexts:
        log(f"decode at context {ctx}: prompt {ctx}, {args.decode_steps} timed decode steps")
        r = run_prompt(llm, f"ctx{ctx}", ctx, args.decode_steps + 4, timer)
        dec = r["decode_steps"][3:]  # after 3 warm decode steps
        # One more request of the same context: its second decode step profiled whole, its
        # third one's forward alone.
        n_pre = -(-ctx // args.chunk)
        r2 = run_prompt(llm, f"ctx{ctx}p", ctx, 4, timer, profile_step=n_pre + 1,
                        profile_forward_step=n_pre + 2)
        step_prof, fwd_prof = r2["step_profile"], timer.profile
        b = {**{"weights": res["bytes"]["decode_weight_bytes_read"]},
             **state_bytes(model, ctx)}
        floor_ms = sum(b.values()) / (bw * 1e9) * 1e3 if bw else None
        gemm_flops = 2 * res["bytes"]["gemm_params_per_token"] + attn_flops(model, 1, ctx)
        step_ms = statistics.median(s["ms"] for s in dec)
        fwd_ms = statistics.median(s["forward_ms"] for s in dec)
        case = {
            "context": ctx, "decode_step_ms_median": step_ms, "forward_ms_median": fwd_ms,
            "decode_step_ms_all": [round(s["ms"], 3) for s in dec],
            "host_rest_ms": step_ms - fwd_ms, "tokens_per_s": 1e3 / step_ms,
            "bytes_per_step": b, "copy_floor_ms": floor_ms,
            "step_over_copy_floor": step_ms / floor_ms if floor_ms else None,
            "gemm_flops": gemm_flops,
            "matmul_floor_ms": gemm_flops / (tf * 1e12) * 1e3 if tf else None,
            "step_profile": step_prof, "forward_profile": fwd_prof,
            "prefill_chunks": [
                chunk_row(model, min(args.chunk, ctx - i * args.chunk), i * args.chunk, s)
                for i, s in enumerate(r["prefill_steps"])
            ],
        }  # fmt: skip
        layers = model.text_config.num_hidden_layers
        for k in ("step_profile", "forward_profile"):
            if case[k]:
                case[k]["launches_per_layer"] = case[k]["launches"] / layers
        cases.append(case)
        log(f"  ctx {ctx}: step {step_ms:.2f} ms (forward {fwd_ms:.2f}), copy floor "
            f"{floor_ms} ms, launches/step "
            f"{(step_prof or {}).get('launches')}, forward {(fwd_prof or {}).get('launches')}")
        res["decode"] = cases
        write(out, res, render_real(res))
    # Prefill: one prompt of --prefill tokens, chunk by chunk.
    log(f"prefill {args.prefill} tokens in chunks of {args.chunk}")
    r = run_prompt(llm, "prefill", args.prefill, 1, timer)
    chunks = []
    for i, s in enumerate(r["prefill_steps"]):
        new, cached = min(args.chunk, args.prefill - i * args.chunk), i * args.chunk
        flops = 2 * res["bytes"]["gemm_params_per_token"] * new + attn_flops(model, new, cached)
        chunks.append({
            **chunk_row(model, new, cached, s),
            "gemm_flops": flops, "matmul_floor_ms": flops / (tf * 1e12) * 1e3 if tf else None,
            "ms_over_matmul_floor": s["ms"] / (flops / (tf * 1e12) * 1e3) if tf else None,
            "weights_copy_floor_ms": (res["bytes"]["total_bytes"] / (bw * 1e9) * 1e3
                                      if bw else None),
        })  # fmt: skip
        log(f"  chunk {i}: {new} new over {cached}: {s['ms']:.1f} ms")
    res["prefill"] = chunks
    res["paths"] = engine_paths(llm)
    write(out, res, render_real(res))
    return 0


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render_real(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [
        f"V0 engine, one TP4 rank of Qwen3.6-35B-A3B at TP 1, {res.get('dtype')}, eager, "
        f"random weights; "
        f"{m.get('device', 'cpu')}, torch {m['torch']}, vLLM {m.get('vllm')}, commit "
        f"{m['commit']}; copy {_f(res.get('copy_GBps'), '.0f')} GB/s (read+write), fp16 mm "
        f"{_f(res.get('matmul_fp16_TFps'), '.0f')} TF/s; weights "
        f"{res['bytes']['total_bytes'] / 1e9:.2f} GB",
        "decode B=1:",
        f"{'context':>8}{'step ms':>9}{'fwd ms':>8}{'host ms':>8}{'tok/s':>7}{'copy fl':>8}"
        f"{'x floor':>8}{'mm fl':>7}{'launch/step':>12}{'/layer':>7}{'fwd launch':>11}",
    ]
    for c in res.get("decode", []):
        sp, fp = c.get("step_profile") or {}, c.get("forward_profile") or {}
        lines.append(
            f"{c['context']:>8}{c['decode_step_ms_median']:>9.2f}{c['forward_ms_median']:>8.2f}"
            f"{c['host_rest_ms']:>8.2f}{c['tokens_per_s']:>7.1f}{_f(c['copy_floor_ms'], '.2f'):>8}"
            f"{_f(c['step_over_copy_floor'], '.1f'):>8}{_f(c['matmul_floor_ms'], '.3f'):>7}"
            f"{_f(sp.get('launches'), 'd'):>12}{_f(sp.get('launches_per_layer'), '.1f'):>7}"
            f"{_f(fp.get('launches'), 'd'):>11}")  # fmt: skip
    if res.get("prefill"):
        lines += ["prefill chunks:", f"{'new':>7}{'cached':>8}{'ms':>9}{'fwd ms':>9}"
                  f"{'mm floor':>9}{'x mm fl':>8}"]  # fmt: skip
        for c in res["prefill"]:
            lines.append(f"{c['new']:>7}{c['cached']:>8}{c['ms']:>9.1f}{c['forward_ms']:>9.1f}"
                         f"{_f(c['matmul_floor_ms'], '.1f'):>9}"
                         f"{_f(c['ms_over_matmul_floor'], '.2f'):>8}")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# paper
# ---------------------------------------------------------------------------------------------


def cmd_collectives(args: argparse.Namespace) -> int:
    """Where a TP > 1 step of our V0 model communicates, counted on a TP 1 engine: forward hooks
    on every module that runs a collective when the tensor-parallel size is above 1 (vLLM 0.6.3's
    ``RowParallelLinear`` with ``reduce_results``, ``VocabParallelEmbedding``, our MoE block's
    one all-reduce, ``LogitsProcessor``'s gather of the vocab shards), one B = 1 decode step of
    a prompt. Bytes are this TP 1 run's tensor sizes; at TP 4 a rank's share of the logits
    gather is a quarter of the vocabulary."""
    from vllm import SamplingParams
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vllm_overrides.engines.v0.qwen3_5 import Qwen3_5SparseMoe

    llm = make_llm(args.model, args.dtype, max_num_batched_tokens=256, max_num_seqs=2,
                   max_model_len=1024)  # fmt: skip
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    calls: dict[str, list[int]] = {}
    counting = [False]

    def hook(kind: str) -> Any:
        def fn(mod: Any, inp: Any, out: Any) -> None:
            if counting[0]:
                t = out[0] if isinstance(out, tuple) else out
                calls.setdefault(kind, []).append(t.numel() * t.element_size())
        return fn

    for name, mod in model.named_modules():
        if isinstance(mod, RowParallelLinear) and mod.reduce_results:
            kind = f"all_reduce: {type(mod).__name__} {name.split('.')[-1]}"
            mod.register_forward_hook(hook(kind))
        elif isinstance(mod, VocabParallelEmbedding) and "lm_head" not in name:
            mod.register_forward_hook(hook("all_reduce: embedding"))
        elif isinstance(mod, Qwen3_5SparseMoe):
            mod.register_forward_hook(hook("all_reduce: MoE block output"))
    orig = LogitsProcessor._get_logits

    def get_logits(self: Any, hidden: Any, lm_head: Any, embedding_bias: Any) -> Any:
        out = orig(self, hidden, lm_head, embedding_bias)
        if counting[0] and out is not None:
            calls.setdefault("gather: logits (LogitsProcessor)", []).append(
                out.numel() * out.element_size())
        return out

    LogitsProcessor._get_logits = get_logits  # type: ignore[method-assign]
    eng = llm.llm_engine
    eng.add_request("c", {"prompt_token_ids": list(range(100, 164))},
                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    eng.step()  # the prefill
    counting[0] = True
    eng.step()  # one decode step
    counting[0] = False
    rows = {k: {"calls": len(v), "bytes_per_call": v[0]} for k, v in sorted(calls.items())}
    n_ar = sum(r["calls"] for k, r in rows.items() if k.startswith("all_reduce"))
    res = {"meta": env_meta(), "model": args.model, "dtype": args.dtype, "per_decode_step": rows,
           "all_reduces_per_step": n_ar,
           "layers": model.text_config.num_hidden_layers}  # fmt: skip
    lines = [f"collectives of one B = 1 decode step at TP > 1 (counted at TP 1 on {args.model}, "
             f"{model.text_config.num_hidden_layers} layers): {n_ar} all-reduces"]  # fmt: skip
    lines += [f"  {k}: {r['calls']} x {r['bytes_per_call']} B" for k, r in rows.items()]
    write(Path(args.out), res, "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("rank-config")
    a.add_argument("--template", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", type=int, default=4)
    a.add_argument("--shrink", action="store_true")
    a = sub.add_parser("tiny")
    a.add_argument("--model", required=True)
    a.add_argument("--oracle", action="append", required=True, help="repeatable")
    a.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    a.add_argument("--max-new", type=int, default=64)
    a.add_argument("--gpu-mem", type=float, default=0.3)
    a.add_argument("--out", required=True)
    a = sub.add_parser("real")
    a.add_argument("--model", required=True)
    a.add_argument("--contexts", default="4096,32768")
    a.add_argument("--prefill", type=int, default=2 * CHUNK)
    a.add_argument("--chunk", type=int, default=CHUNK)
    a.add_argument("--decode-steps", type=int, default=24)
    a.add_argument("--gpu-mem", type=float, default=0.6)
    a.add_argument("--dtype", default="half", help="half (the YAML's); float32 for a CPU dry run")
    a.add_argument("--out", required=True)
    a = sub.add_parser("collectives")
    a.add_argument("--model", required=True)
    a.add_argument("--dtype", default="float32")
    a.add_argument("--out", required=True)
    a = sub.add_parser("paper")
    a.add_argument("--result", required=True)
    a.add_argument("--dataset", default=None, help="replay881 jsonl (output lengths)")
    a.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return {"rank-config": cmd_rank_config, "tiny": cmd_tiny, "real": cmd_real,
            "collectives": cmd_collectives, "paper": cmd_paper}[args.cmd](args)  # fmt: skip


# The card (PLATFORM.md unless marked): what the paper score scales the measured step by.
CARD = {
    "copy_GBps": 584.0, "launch_us": 6.2,
    "allreduce_ms_per_call": {"ipc_2k": 0.021, "ipc_64k": 0.080, "nccl": 0.163},
    "allreduce_source": "PLATFORM.md: ixformer's IPC all-reduce 0.021 ms at 2,048 elements (a "
    "B = 1 decode call is [1, 2048]), 0.080 ms at 65,536; NCCL 13.2 ms over 81 calls a token",
    "allreduces_per_token": 81, "gathers_per_token": 1,
    "peak_fp16_TFps": 147.0, "matmul_efficiency": 0.5,
    "matmul_source": "assumption, as decode_step_bench.TARGET_CARD (launch report's 147 TF/s "
    "fp16 x 0.5; unmeasured)",
    "prefill_link_GBps": 16.0,
    "prefill_link_source": "assumption, perf_metrics.CARD_TP4 (half of PCIe 4.0 x16)",
}
REPLAY_SIM = REPO / "worklogs" / "results" / "cache-sim-replay881-offload.json"


def replay_requests(dataset: Path | None) -> tuple[list[dict[str, Any]], str]:
    """replay881's requests: prompt and simulated cached tokens (cache_sim.py, mnbt 8192, GDN
    checkpoints, the YAML's 128 GiB CPU tier) and the output length the dataset targets."""
    sim = json.loads(REPLAY_SIM.read_text())
    run = next(r for r in sim["runs"] if r["config"].get("offload_gib") == 128.0)
    outs: dict[str, int] = {}
    src = "PLATFORM.md's average completion (510 tokens) for every request"
    if dataset and dataset.exists():
        for line in dataset.read_text().splitlines():
            d = json.loads(line)
            outs[d["id"]] = int(d["meta"]["target_output_tokens"])
        src = f"{dataset.name} meta.target_output_tokens (generate_official_like_dataset.py)"
    reqs = [{"prompt": r["prompt_tokens"], "cached": r["cached_tokens"],
             "out": outs.get(r["id"], 510)}
            for r in run["records"] if r.get("status") == "ok"]  # fmt: skip
    return reqs, f"{REPLAY_SIM.name} (128 GiB tier, hit {run['hit']:.3f}); outputs: {src}"


def card_decode_model(res: dict[str, Any], card: dict[str, Any], ar_ms: float,
                      host_scale: float = 1.0) -> tuple[float, float, dict[str, Any]]:  # fmt: skip
    """Card ms per decode token at context c = ``t0 + t1 c`` (one rank + the all-reduces).

    Per measured context: GPU time = the step's device-busy time here x (copy GB/s here / the
    card's) (a B = 1 step is memory-bound); host time = max(this host's forward time, launches x
    the card's launch cost); the forward takes the larger of the two (eager: the host issues
    while the GPU runs); + the engine's time outside the forward (scheduler, inputs, sampler),
    as measured here x ``host_scale``; + 81 all-reduces and the logits gather at ``ar_ms``."""
    pts = []
    for c in res["decode"]:
        prof = c["step_profile"]
        gpu = prof["device_busy_us"] / 1e3 * res["copy_GBps"] / card["copy_GBps"]
        host = max(c["forward_ms_median"], prof["launches"] * card["launch_us"] / 1e3)
        comm = (card["allreduces_per_token"] + card["gathers_per_token"]) * ar_ms
        ms = max(gpu, host * host_scale) + c["host_rest_ms"] * host_scale + comm
        pts.append({"context": c["context"], "gpu_ms": gpu, "host_ms": host, "comm_ms": comm,
                    "card_ms": ms})  # fmt: skip
    (lo, hi) = (pts[0], pts[-1])
    t1 = (hi["card_ms"] - lo["card_ms"]) / max(hi["context"] - lo["context"], 1)
    t0 = lo["card_ms"] - t1 * lo["context"]
    return t0, max(t1, 0.0), {"points": pts}


def card_prefill_fit(res: dict[str, Any], card: dict[str, Any]) -> tuple[float, float, list]:
    """Each measured chunk on the card: its GEMM floor at the card's matmul rate + the rest of
    its time x (copy GB/s here / the card's); then ``t = a N + b (N C + N^2 / 2)`` fitted."""
    import perf_metrics as pm

    rate = card["peak_fp16_TFps"] * card["matmul_efficiency"]
    rows = []
    chunks = list(res["prefill"]) + [c for d in res["decode"] for c in d["prefill_chunks"]]
    for c in chunks:
        flops = 2 * res["bytes"]["gemm_params_per_token"] * c["new"] + c.get("attn_flops", 0.0)
        floor_here = flops / (res["matmul_fp16_TFps"] * 1e12) * 1e3
        gemm = flops / (rate * 1e12) * 1e3
        rest = max(c["ms"] - floor_here, 0.0) * res["copy_GBps"] / card["copy_GBps"]
        rows.append({"new": c["new"], "cached": c["cached"], "ms": c["ms"],
                     "card_ms": gemm + rest})  # fmt: skip
    a, b = pm.fit_prefill_cost([r["new"] for r in rows], [r["cached"] for r in rows],
                               [r["card_ms"] / 1e3 for r in rows])  # fmt: skip
    return a, b, rows


def paper_score(res: dict[str, Any], reqs: list[dict[str, Any]], card: dict[str, Any],
                ar_ms: float, hit: bool = True, host_scale: float = 1.0,
                link_gbps: float | None = None, prefill_scale: float = 1.0,
                decode_scale: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """The replay at concurrency 1 on the card, request by request:

    * TTFT = the fitted card prefill of its uncached tokens over its cached ones (all of the
      prompt when ``hit`` is False: the V0 model turned prefix caching off until GDN state
      checkpoints landed, b00296b) + the TP4 all-reduces of those tokens at ``link_gbps`` and their
      latency per chunk (``perf_metrics.tp4_overhead_s`` without its weight re-read term: each
      measured chunk already read the weights);
    * decode = (out - 1) steps at the card's per-token time at the mean context of the request's
      decode;
    * Output TPS = out / (TTFT + decode), the evaluator's per-request figure; the leaderboard
      figure from the totals over the summed request times (no gaps between requests).

    ``prefill_scale`` / ``decode_scale`` multiply the card's prefill / decode time (what-if rows
    that say which part is short)."""
    import numpy as np
    import perf_metrics as pm

    t0, t1, dec = card_decode_model(res, card, ar_ms, host_scale)
    a, b, rows = card_prefill_fit(res, card)
    link = link_gbps or card["prefill_link_GBps"]
    P = np.array([r["prompt"] for r in reqs], dtype=float)
    C = np.array([r["cached"] for r in reqs], dtype=float) if hit else np.zeros(len(reqs))
    Out = np.array([r["out"] for r in reqs], dtype=float)
    N = P - C
    tp4 = {**pm.CARD_TP4, "weights_GB": 0.0}
    chunk = res.get("chunk", CHUNK)
    ttft = prefill_scale * pm.prefill_seconds(a, b, N, C) + pm.tp4_overhead_s(N, link, chunk, tp4)
    dec_s = decode_scale * np.maximum(Out - 1, 0) * (t0 + t1 * (P + Out / 2)) / 1e3
    total = ttft + dec_s
    tps = Out / total
    wall = float(total.sum())
    out_tps, in_tps, cache_tps = Out.sum() / wall, N.sum() / wall, C.sum() / wall
    return {
        "output_tps_p10": pm.percentile(tps.tolist(), 10),
        "output_tps_p50": pm.percentile(tps.tolist(), 50),
        "ttft_p90_s": pm.percentile(ttft.tolist(), 90),
        "ttft_p50_s": pm.percentile(ttft.tolist(), 50),
        "hit": float(C.sum() / P.sum()), "success": "assumed 100 %",
        "replay_wall_s": wall, "output_tps": out_tps, "input_tps": in_tps, "cache_tps": cache_tps,
        "leaderboard": pm.weighted_score(out_tps, in_tps, cache_tps),
        "decode_ms_per_token": {"t0_ms": t0, "per_1k_context_ms": t1 * 1e3,
                                "at_4k": t0 + t1 * 4096, "at_32k": t0 + t1 * 32768, **dec},
        "prefill_fit": {"a_us_per_token": a * 1e6, "b_ns_per_pair": b * 1e9, "rows": rows},
        "allreduce_ms_per_call": ar_ms, "link_GBps": link, "host_scale": host_scale,
        "uses_cache_hits": hit,
    }  # fmt: skip


def cmd_paper(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "worklogs"))
    res = json.loads(Path(args.result).read_text())
    reqs, src = replay_requests(Path(args.dataset) if args.dataset else None)
    base = paper_score(res, reqs, CARD, CARD["allreduce_ms_per_call"]["ipc_2k"])
    no_hit = paper_score(res, reqs, CARD, CARD["allreduce_ms_per_call"]["ipc_2k"], hit=False)
    sens = []
    for label, kw in [
        ("all-reduce IPC 0.080 ms/call", {"ar_ms": CARD["allreduce_ms_per_call"]["ipc_64k"]}),
        ("all-reduce NCCL 0.163 ms/call", {"ar_ms": CARD["allreduce_ms_per_call"]["nccl"]}),
        ("card copy 438 GB/s (x0.75)", {"card": {**CARD, "copy_GBps": 0.75 * CARD["copy_GBps"]}}),
        ("card launch 12.4 us (x2)", {"card": {**CARD, "launch_us": 2 * CARD["launch_us"]}}),
        ("card host 2x slower", {"host_scale": 2.0}),
        ("card matmul 0.25 x peak", {"card": {**CARD, "matmul_efficiency": 0.25}}),
        ("prefill link 8 GB/s", {"link_gbps": 8.0}),
        ("prefill link 31.5 GB/s", {"link_gbps": 31.5}),
        ("no cache hits (prefix caching off, as at 56cbc73)", {"hit": False}),
        ("what if: prefill (one rank) 2x faster", {"prefill_scale": 0.5}),
        ("what if: decode 2x faster", {"decode_scale": 0.5}),
        ("what if: both 2x faster", {"prefill_scale": 0.5, "decode_scale": 0.5}),
    ]:
        kw = {"card": CARD, "ar_ms": CARD["allreduce_ms_per_call"]["ipc_2k"], **kw}
        r = paper_score(res, reqs, kw.pop("card"), kw.pop("ar_ms"), **kw)
        sens.append({"case": label, **{k: r[k] for k in ("output_tps_p10", "ttft_p90_s", "hit",
                                                          "leaderboard")}})  # fmt: skip
    out = {"paper": True, "method": paper_score.__doc__, "decode_method": card_decode_model.__doc__,
           "prefill_method": card_prefill_fit.__doc__, "card": CARD, "measured": args.result,
           "measured_meta": res["meta"], "replay": src, "requests": len(reqs),
           "base": base, "base_no_hits": no_hit, "sensitivity": sens,
           "gates": {"output_tps_p10": 20, "ttft_p90_s": 5.0,
                     "issue48_target_tps_p10": 25}}  # fmt: skip
    m = res["meta"]
    lines = [
        f"PAPER estimate for the card (BI-V100, TP4, concurrency 1), from the V0 step measured on "
        f"{m.get('device')} at {m['commit']} ({args.result}); replay: {src}",
        f"decode per token on the card: {base['decode_ms_per_token']['at_4k']:.2f} ms at 4K, "
        f"{base['decode_ms_per_token']['at_32k']:.2f} ms at 32K (81 all-reduces + 1 gather at "
        f"{base['allreduce_ms_per_call']} ms included); prefill a = "
        f"{base['prefill_fit']['a_us_per_token']:.1f} us/token, b = "
        f"{base['prefill_fit']['b_ns_per_pair']:.3f} ns/pair",
        f"{'case':<46}{'TPS P10':>9}{'TTFT P90':>10}{'hit':>7}{'leaderboard':>13}",
    ]
    named = [("base (IPC 0.021 ms, simulated hits)", base),
             ("base, no cache hits (as at 56cbc73)", no_hit)]
    for label, r in named + [(x["case"], x) for x in sens]:
        lines.append(f"{label:<46}{r['output_tps_p10']:>9.2f}{r['ttft_p90_s']:>10.2f}"
                     f"{r['hit']:>7.1%}{r['leaderboard']:>13.1f}")  # fmt: skip
    write(Path(args.out), out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
