"""Drive our V0 Qwen3.5 model class directly, step by step, without the engine.

Why: the model's own logic (weight loading, GDN states carried across prefill chunks and
decode steps, forks, MoE, gated attention) is checked here against the Hugging Face oracle on
the stand-in without depending on the engine's worker or the paged attention backend. The
attention layers' ``attn`` is replaced by :class:`DictKVAttention`, a plain causal attention
that keeps each sequence's keys and values in a dict (test-only; the engine tests use the real
backend). Everything else is the model as V0 runs it, fed with V0's batch layout: prefill
chunks first, then one token per decoding sequence, ``request_ids_to_seq_ids`` in that order.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[3]
TINY_MODEL = REPO / "build" / "tiny-model"
ORACLE_JSON = Path(os.environ.get("HF_ORACLE_JSON", REPO / "build" / "hf_oracle.json"))

_dist_ready = False


def init_dist() -> None:
    """vLLM's TP-1 process groups (gloo), once per process."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    _dist_ready = True


@dataclass
class StepMeta:
    """The fields of V0's attention metadata our model reads, plus the sequences (for the
    test attention)."""

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    query_start_loc: torch.Tensor
    context_lens_tensor: torch.Tensor
    seq_keys: list[tuple[str, int]]
    query_lens: list[int]
    context_lens: list[int]


@dataclass
class DictKVAttention(torch.nn.Module):
    """Causal GQA attention with per-sequence KV kept in a dict (float32 math)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        torch.nn.Module.__init__(self)

    def __hash__(self) -> int:
        return id(self)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                meta: StepMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        off = 0
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        for key, n, ctx in zip(meta.seq_keys, meta.query_lens, meta.context_lens, strict=True):
            kk, vv = k[off:off + n].view(n, KV, D), v[off:off + n].view(n, KV, D)
            if ctx > 0:
                pk, pv = self.kv[key]
                assert pk.shape[0] == ctx, (key, pk.shape, ctx)
                kk, vv = torch.cat([pk, kk]), torch.cat([pv, vv])
            self.kv[key] = (kk, vv)
            qq = q[off:off + n].view(n, H, D).transpose(0, 1)  # [H, n, D]
            rep = H // KV
            ka = kk.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, D]
            va = vv.repeat_interleave(rep, dim=1).transpose(0, 1)
            s = (qq @ ka.transpose(1, 2)) * self.scale  # [H, n, L]
            L = ka.shape[1]
            pos_q = torch.arange(ctx, ctx + n)[:, None]
            mask = torch.arange(L)[None, :] > pos_q
            s = s.masked_fill(mask, float("-inf"))
            o = torch.softmax(s.float(), dim=-1).to(q.dtype) @ va  # [H, n, D]
            out[off:off + n] = o.transpose(0, 1).reshape(n, H * D)
            off += n
        return out

    def fork(self, src: tuple[str, int], dst: tuple[str, int]) -> None:
        self.kv[dst] = self.kv[src]


def load_model(dtype: torch.dtype = torch.float32, max_seqs: int = 8) -> Any:
    """Our model class on CPU with the tiny checkpoint's weights and the test attention."""
    from safetensors import safe_open
    from vllm.config import SchedulerConfig

    from vllm_overrides.engines.v0 import register

    register()
    init_dist()
    from transformers import AutoConfig

    from vllm_overrides.engines.v0.qwen3_5 import Qwen3_5MoeForConditionalGeneration

    config = AutoConfig.from_pretrained(TINY_MODEL)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max_seqs,
                                max_model_len=4096)
        model = Qwen3_5MoeForConditionalGeneration(config, None, None, sched)
    finally:
        torch.set_default_dtype(old)
    with safe_open(str(TINY_MODEL / "model.safetensors"), "pt") as f:
        model.load_weights((name, f.get_tensor(name)) for name in f.keys())
    for layer in model.model.layers:
        if layer.layer_type == "full_attention":
            a = layer.self_attn
            a.attn = DictKVAttention(a.nh, a.nkv, a.D, a.D**-0.5)
    return model.eval()


@dataclass
class Seq:
    """One sequence as the engine sees it: its request, its tokens, how many are computed."""

    req: str
    sid: int
    tokens: list[int]
    computed: int = 0


class Driver:
    """Runs V0-shaped steps on the model and samples greedily (argmax of the full logits)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.finished: list[str] = []

    def _attn_layers(self) -> list[DictKVAttention]:
        return [layer.self_attn.attn for layer in self.model.model.layers
                if layer.layer_type == "full_attention"]

    def fork(self, parent: Seq, child_sid: int, token: int) -> Seq:
        """A sibling after the prompt's sample (n > 1): same tokens except its own last one."""
        child = Seq(parent.req, child_sid, parent.tokens[:-1] + [token], parent.computed)
        for a in self._attn_layers():
            a.fork((parent.req, parent.sid), (child.req, child.sid))
        return child

    @torch.inference_mode()
    def step(
        self, prefills: list[tuple[Seq, int]], decodes: list[Seq], mrope: bool = False
    ) -> list[int]:
        """One engine step: ``prefills`` as ``(seq, chunk_len)`` then ``decodes``; returns the
        greedy next token of every sequence whose step ends at its last token (else -1).
        ``mrope``: positions as the ``[3, T]`` (t, h, w) rows V0's runner passes for an MRoPE
        model, all three equal as for text tokens."""
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        keys: list[tuple[str, int]] = []
        req_to_seqs: dict[str, list[int]] = {}
        for seq, n in prefills:
            ids += seq.tokens[seq.computed:seq.computed + n]
            pos += list(range(seq.computed, seq.computed + n))
            qlens.append(n)
            ctxs.append(seq.computed)
            keys.append((seq.req, seq.sid))
            req_to_seqs.setdefault(seq.req, []).append(seq.sid)
        for seq in decodes:
            assert seq.computed == len(seq.tokens) - 1
            ids.append(seq.tokens[-1])
            pos.append(seq.computed)
            qlens.append(1)
            ctxs.append(seq.computed)
            keys.append((seq.req, seq.sid))
            req_to_seqs.setdefault(seq.req, []).append(seq.sid)
        qsl = torch.tensor([0, *qlens]).cumsum(0)
        meta = StepMeta(
            num_prefills=len(prefills),
            num_prefill_tokens=sum(n for _, n in prefills),
            num_decode_tokens=len(decodes),
            query_start_loc=qsl,
            context_lens_tensor=torch.tensor(ctxs),
            seq_keys=keys,
            query_lens=qlens,
            context_lens=ctxs,
        )
        positions = torch.tensor(pos)
        if mrope:
            positions = positions.expand(3, -1).contiguous()
        hidden = self.model(
            torch.tensor(ids), positions, [], meta,
            request_ids_to_seq_ids=req_to_seqs, finished_requests_ids=self.finished,
        )  # fmt: skip
        self.finished = []
        last_rows = (qsl[1:] - 1).tolist()
        logits = self.model.lm_head.weight @ hidden[last_rows].T  # [V, N]
        nxt = logits.argmax(0).tolist()
        out = []
        for (seq, n), tok in zip(prefills, nxt[:len(prefills)], strict=True):
            seq.computed += n
            out.append(tok if seq.computed == len(seq.tokens) else -1)
        for seq, tok in zip(decodes, nxt[len(prefills):], strict=True):
            seq.computed += 1
            out.append(tok)
        return out

    def finish(self, req: str) -> None:
        self.finished.append(req)
        for a in self._attn_layers():
            for key in [k for k in a.kv if k[0] == req]:
                del a.kv[key]
