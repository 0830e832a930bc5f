"""GDN prefill checkpoints for prefix caching in vLLM's ``align`` mode (patch 0007).

A hybrid model resumes from the cache only where a Gated-DeltaNet state was saved. vLLM 0.32.0
saves one at the end of every scheduler step that lands on a block boundary, and it has a
backend-neutral mechanism for one more: a *prefill checkpoint*. A layer whose KV spec declares
``MambaSpec.num_prefill_checkpoint_blocks = 1`` gets, in the chunk that ends a prompt, one more
state block at column ``cdiv(seq_len, block) - 2`` and the metadata ``md.checkpoint`` (offset into
the query, destination slot); the layer must write its conv and recurrent state *after*
``offset`` tokens of that query into the slot. The position is the prompt's last hash boundary
strictly below its end (``get_mamba_prefill_checkpoint_position``), exactly where the next turn of
an agent loop resumes. Upstream's Qwen GDN never declares it (its Triton kernels have no
exporter), so the scheduler instead splits the final chunk there: one more forward pass per
prompt, and with ``--prefix-match-unit`` below the block size a separately registered partial
tail. Kimi's KDA and Mamba2 declare it; this module does it for Qwen's GDN on our native path.

``spec_with_checkpoint`` is the KV-spec hook (only with ``GDN_NATIVE=1``, ``align`` mode, no
speculative decoding -- spec batches run upstream's kernels, which would leave the slot
unwritten -- and unless ``GDN_PREFILL_CHECKPOINT=0``). ``chunk_rule_with_checkpoints`` is the
prefill side: rows with a checkpoint are run as two chained segments (the state after the first
is the checkpoint and the second's initial state), rows without one as before. Memory: one more
GDN state block per running request and GDN group (3 blocks = 15.4 MiB at TP4 for the real
model; ``make preflight`` charges it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch


def checkpoint_wanted(vllm_config: Any) -> bool:
    from vllm_overrides.engines.v1_0_32.native_switch import GDN_NATIVE

    cache = vllm_config.cache_config
    return (
        GDN_NATIVE
        and os.environ.get("GDN_PREFILL_CHECKPOINT", "1") != "0"
        and getattr(cache, "mamba_cache_mode", "none") == "align"
        and vllm_config.speculative_config is None
    )


def spec_with_checkpoint(vllm_config: Any, spec: Any) -> Any:
    """The GDN layer's ``MambaSpec`` with one prefill-checkpoint block (alignment 1: our
    chained segments can stop at any token), or ``spec`` unchanged when not wanted."""
    if spec is None or not checkpoint_wanted(vllm_config):
        return spec
    return dataclasses.replace(
        spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
    )


def prefill_checkpoints(md: Any, nd: int, npf: int) -> tuple[list[int], torch.Tensor] | None:
    """(offset into each prefill row's query, destination slot per prefill row) or None.

    ``md.checkpoint`` covers the batch's non-spec rows in batch order (decodes first); offset 0
    means no checkpoint for that row.
    """
    ck = getattr(md, "checkpoint", None)
    if ck is None or ck.offsets is None:
        return None
    offsets = list(ck.offsets[nd : nd + npf])
    if not any(offsets):
        return None
    from vllm_overrides.engines.v1_0_32.native_switch import _mark

    _mark("gdn_prefill_checkpoint")
    return offsets, ck.state_indices[nd : nd + npf]


def _ranges(bounds: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    parts = [torch.arange(s, e, device=device) for s, e in bounds if e > s]
    if not parts:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(parts)


def _cu(bounds: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    lens = torch.tensor([0] + [e - s for s, e in bounds], dtype=torch.long)
    return torch.cumsum(lens, 0).to(device=device, dtype=torch.int32)


def chunk_rule_with_checkpoints(
    rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    query_start_loc: torch.Tensor,
    offsets: Sequence[int],
    slots: torch.Tensor,
    raw_x: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule over the prefill rows, exporting each row's checkpoint.

    ``q, k, v, g, beta``: token-major prefill tensors (``[T, ...]``); ``h0``: ``[N, ...]``
    initial states; ``query_start_loc``: ``[N + 1]``; ``offsets``/``slots``: from
    :func:`prefill_checkpoints`; ``raw_x``: the prefill's conv *inputs* ``[T, D]``;
    ``conv_state``: ``[slots, D, W - 1]`` view; ``ssm_state``: the recurrent state cache.
    Writes the checkpoint states into ``conv_state`` / ``ssm_state`` at ``slots`` and returns
    ``(o [1, T, ...], final [N, ...])`` exactly as one call of ``rule`` would (the same math
    chained at the checkpoint; outputs agree to rounding).
    """
    dev = q.device
    qsl = [int(x) for x in query_start_loc.tolist()]  # one host sync, checkpoint steps only
    first: list[tuple[int, int]] = []
    second: list[tuple[int, int]] = []
    split_rows: list[int] = []
    for r, (s, e) in enumerate(zip(qsl[:-1], qsl[1:], strict=True)):
        off = int(offsets[r])
        cut = s + off if 0 < off < e - s else e
        first.append((s, cut))
        if cut < e:
            second.append((cut, e))
            split_rows.append(r)

    def run(bounds: Sequence[tuple[int, int]], init: torch.Tensor):
        ids = _ranges(bounds, dev)
        o, fin = rule(
            q.index_select(0, ids).unsqueeze(0),
            k.index_select(0, ids).unsqueeze(0),
            v.index_select(0, ids).unsqueeze(0),
            g.index_select(0, ids).unsqueeze(0),
            beta.index_select(0, ids).unsqueeze(0),
            initial_state=init,
            output_final_state=True,
            cu_seqlens=_cu(bounds, dev),
            use_qk_l2norm_in_kernel=False,
        )
        assert fin is not None
        return ids, o, fin

    ids1, o1, fin1 = run(first, h0)
    rows = torch.tensor(split_rows, dtype=torch.long, device=dev)
    ids2, o2, fin2 = run(second, fin1.index_select(0, rows))

    # The checkpoint: recurrent state after the first segment, conv state = its last W-1
    # inputs (the checkpoint is at least one hash block into the query, so they are all in it).
    ck_slots = slots.to(dev, torch.long).index_select(0, rows)
    ssm_state.index_copy_(0, ck_slots, fin1.index_select(0, rows).to(ssm_state.dtype))
    width = conv_state.shape[-1]
    cuts = torch.tensor([first[r][1] for r in split_rows], dtype=torch.long, device=dev)
    win = cuts.view(-1, 1) + torch.arange(-width, 0, device=dev).view(1, -1)  # [Ns, W-1]
    conv_state[ck_slots] = raw_x[win].transpose(1, 2).to(conv_state.dtype)

    o = o1.new_empty((1, q.shape[0], *o1.shape[2:]))
    o[0, ids1] = o1[0]
    o[0, ids2] = o2[0]
    final = fin1.clone()
    final[rows] = fin2
    return o, final
