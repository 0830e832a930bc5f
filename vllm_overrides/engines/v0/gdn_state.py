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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

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
