"""Per-sequence Gated DeltaNet state slots for vLLM 0.6.3's V0 engine.

V0 keeps no state for state-space layers: a model that declares ``has_inner_state`` gets, each
step, ``request_ids_to_seq_ids`` (the batch's sequences, in batch order) and
``finished_requests_ids`` (requests that ended since the last step) and must keep its own
cache. This class owns one slot per running sequence, holding every GDN layer's conv state
(the last ``kernel - 1`` pre-activation inputs) and recurrent state:

* a sequence gets a slot the first time it is seen and keeps it until its request finishes;
* a sequence seen for the first time in a request that already has a slot is a fork (``n > 1``
  after the prompt's first sample): it starts from a copy of its sibling's state;
* slot 0 is never handed out: the native decode ops treat slot ``<= 0`` as padding.

Whether a slot's content is used is the caller's decision per step: a prefill chunk that starts
at position 0 (a new prompt, or one recomputed after preemption) must ignore it
(``has_initial_state`` False); a later chunk or a decode step continues from it. Slots are
addressed in place by index (``index_select`` / ``index_copy_`` in the ops), so nothing is
swapped or compacted between steps.

With hybrid prefix caching (:mod:`.prefix_cache`) the cache also holds a fixed pool of
*checkpoints*: states saved at KV block boundaries. A prefill that resumes from a prefix hit
gets its checkpoint copied into its slot before the forward (:meth:`GDNStateCache.load`); a
GDN layer writes the states at the planned boundaries of its chunks into the pool
(:func:`chunk_rule_with_cuts` runs the chunked rule in segments that end there, and
:func:`conv_window` takes the conv state from the chunk's inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)


class GDNStateCache:
    """Conv + recurrent state slots of all GDN layers, one slot per running sequence.

    Args:
        num_layers: GDN layers of this rank.
        conv_shape: ``(conv_dim, kernel - 1)`` per slot (the native ops' view).
        ssm_shape: ``(HV, V, K)`` per slot.
        conv_dtype, ssm_dtype: storage dtypes (the recurrent state stays float32).
        device: where the states live.
        max_seqs: slots to start with (grown by doubling when more sequences run at once).
        checkpoints: size of the checkpoint pool (0: none).
    """

    def __init__(
        self,
        num_layers: int,
        conv_shape: Sequence[int],
        ssm_shape: Sequence[int],
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str,
        max_seqs: int,
        checkpoints: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        self.device = torch.device(device)
        n = max(int(max_seqs), 1) + 1  # + the reserved slot 0
        self.conv = [
            torch.zeros((n, *self.conv_shape), dtype=conv_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.ssm = [
            torch.zeros((n, *self.ssm_shape), dtype=ssm_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # Checkpoint pool, same layout; its slot numbers are the scheduler's (prefix_cache).
        self.ck_conv = [
            torch.zeros((checkpoints, *self.conv_shape), dtype=conv_dtype, device=self.device)
            for _ in range(num_layers if checkpoints else 0)
        ]
        self.ck_ssm = [
            torch.zeros((checkpoints, *self.ssm_shape), dtype=ssm_dtype, device=self.device)
            for _ in range(num_layers if checkpoints else 0)
        ]
        self._free: list[int] = list(range(n - 1, 0, -1))  # pop() hands out low slots first
        # request id -> {seq id -> slot}
        self._slots: dict[str, dict[int, int]] = {}
        # Requests that ran in a step while already reported finished (the profile run's
        # dummy requests): freed at the next step, once their step is done with the slots.
        self._deferred: list[str] = []

    @property
    def num_slots(self) -> int:
        """Usable slots (slot 0 excluded)."""
        return self.conv[0].shape[0] - 1 if self.conv else 0

    def slots_in_use(self) -> int:
        return sum(len(s) for s in self._slots.values())

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [slots, D, W-1], ssm [slots, HV, V, K])`` of GDN layer ``i``."""
        return self.conv[i], self.ssm[i]

    def checkpoints(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(conv [pool, D, W-1], ssm [pool, HV, V, K])`` of GDN layer ``i``'s checkpoint pool,
        or None without one."""
        if not self.ck_conv:
            return None
        return self.ck_conv[i], self.ck_ssm[i]

    def load(self, pool: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy checkpoints ``pool[j]`` into state slots ``slots[j]`` for every layer."""
        if pool.numel() == 0:
            return
        for dst, src in zip(self.conv, self.ck_conv, strict=True):
            dst.index_copy_(0, slots, src.index_select(0, pool))
        for dst, src in zip(self.ssm, self.ck_ssm, strict=True):
            dst.index_copy_(0, slots, src.index_select(0, pool))

    def release(self, finished_requests_ids: Iterable[str]) -> None:
        """Free every slot of the finished requests."""
        for rid in finished_requests_ids:
            for slot in self._slots.pop(rid, {}).values():
                self._free.append(slot)

    def _grow(self) -> None:
        old = self.conv[0].shape[0]
        new = 2 * old - 1  # double the usable slots
        logger.info("GDN state cache: %d -> %d slots", old - 1, new - 1)
        for lst in (self.conv, self.ssm):
            for i, t in enumerate(lst):
                bigger = torch.zeros((new, *t.shape[1:]), dtype=t.dtype, device=t.device)
                bigger[:old].copy_(t)
                lst[i] = bigger
        self._free.extend(range(new - 1, old - 1, -1))

    def _take(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def _copy_slot(self, src: int, dst: int) -> None:
        for t in self.conv:
            t[dst].copy_(t[src])
        for t in self.ssm:
            t[dst].copy_(t[src])

    def prepare(
        self,
        request_ids_to_seq_ids: Mapping[str, Sequence[int]],
        finished_requests_ids: Iterable[str] | None = None,
    ) -> torch.Tensor:
        """Free finished requests, give every sequence of this step a slot (forks copy their
        sibling's state) and return the slots ``[num_seqs]`` (int64) in batch order."""
        finished = set(finished_requests_ids or ())
        self.release(self._deferred)
        self._deferred = [rid for rid in request_ids_to_seq_ids if rid in finished]
        self.release(finished - set(self._deferred))
        order: list[int] = []
        for rid, seq_ids in request_ids_to_seq_ids.items():
            known = self._slots.setdefault(rid, {})
            for sid in seq_ids:
                slot = known.get(sid)
                if slot is None:
                    slot = self._take()
                    if known:
                        # A fork: the new sequence continues from its sibling's state (the
                        # prompt's state after the step that sampled both).
                        self._copy_slot(next(iter(known.values())), slot)
                    known[sid] = slot
                order.append(slot)
        return torch.tensor(order, dtype=torch.long, device=self.device)


# --------------------------------------------------------------------------------------------
# States at intermediate positions of a prefill chunk (checkpoint saves)
# --------------------------------------------------------------------------------------------


def _ranges(bounds: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    parts = [torch.arange(s, e, device=device) for s, e in bounds]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def _cu(bounds: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    lens = torch.tensor([0] + [e - s for s, e in bounds], dtype=torch.long)
    return torch.cumsum(lens, 0).to(device=device, dtype=torch.int32)


def chunk_rule_with_cuts(
    rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    qsl: Sequence[int],
    cuts: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """The chunked delta rule over packed prefill rows, stopping at each row's ``cuts``.

    ``q, k, v, g, beta``: token-major ``[T, ...]``; ``h0``: ``[N, ...]`` initial states;
    ``qsl``: host ``[N + 1]`` row offsets; ``cuts[r]``: sorted offsets into row ``r``'s query
    (``0 < cut <= len``) where its recurrent state is wanted. Each row runs as consecutive
    segments ending at its cuts, one call of ``rule`` per segment index over all rows that have
    it (the same math chained; outputs agree with one call to rounding). Returns
    ``(o [1, T, ...], final [N, ...], {(row, cut): state})``.
    """
    dev = q.device
    points = []
    for r in range(len(qsl) - 1):
        n = qsl[r + 1] - qsl[r]
        inner = sorted({c for c in cuts[r] if 0 < c < n})
        points.append([0, *inner, n])
    state = h0.clone()
    o: torch.Tensor | None = None
    at_cut: dict[tuple[int, int], torch.Tensor] = {}
    for j in range(max(len(p) for p in points) - 1):
        rows = [r for r, p in enumerate(points) if len(p) - 1 > j]
        bounds = [(qsl[r] + points[r][j], qsl[r] + points[r][j + 1]) for r in rows]
        ids = _ranges(bounds, dev)
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        o_j, fin = rule(
            q.index_select(0, ids).unsqueeze(0),
            k.index_select(0, ids).unsqueeze(0),
            v.index_select(0, ids).unsqueeze(0),
            g.index_select(0, ids).unsqueeze(0),
            beta.index_select(0, ids).unsqueeze(0),
            initial_state=state.index_select(0, rows_t),
            output_final_state=True,
            cu_seqlens=_cu(bounds, dev),
            use_qk_l2norm_in_kernel=False,
        )
        assert fin is not None
        if o is None:
            o = o_j.new_empty((1, q.shape[0], *o_j.shape[2:]))
        o[0, ids] = o_j[0]
        state.index_copy_(0, rows_t, fin.to(state.dtype))
        for i, r in enumerate(rows):
            at_cut[(r, points[r][j + 1])] = fin[i]
    assert o is not None
    return o, state, at_cut


def conv_window(raw_x: torch.Tensor, init_conv: torch.Tensor, start: int, cut: int) -> torch.Tensor:
    """The conv state ``[D, W-1]`` after ``cut`` tokens of a row whose conv inputs start at
    ``raw_x[start]`` and whose state before the row was ``init_conv [D, W-1]`` (zeros when the
    row starts a sequence): the last ``W-1`` inputs, oldest first."""
    width = init_conv.shape[-1]
    if cut >= width:
        win = raw_x[start + cut - width : start + cut]
    else:
        before = init_conv.transpose(0, 1)[cut:].to(raw_x.dtype)
        win = torch.cat([before, raw_x[start : start + cut]])
    return win.transpose(0, 1)
