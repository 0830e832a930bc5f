"""Keep a GDN state at the end of a prompt's system block (patch 0008).

In vLLM's ``align`` mode a hybrid model resumes from the cache only where a Gated-DeltaNet state
was saved. Agent traffic has two kinds of reuse: a session's next turn extends its previous
prompt (patch 0007's checkpoint at the prompt's last full block serves it), and a new session
starts with the same system prompt and tool list as earlier sessions of the same agent. vLLM
keeps a state for the second kind only once it has *seen* two prompts share that prefix: the
second request finds the attention blocks but no GDN state, recomputes everything, and stops at
the shared-prefix junction (``request.shared_prefix_boundary``) so that the *third* one hits.
The first sharer of every system prompt gets nothing (on quick8: 12,227 of 142,473 ideal tokens,
8.6 %).

This module names the junction before anyone has shared it: when the scheduler's cache lookup
for a new request found no junction of its own, the end of the prompt's first message block
(the first ``<|im_end|>``: system prompt plus the tool list, which the Qwen template renders
inside it) becomes the request's ``shared_prefix_boundary``. vLLM's own machinery does the
rest: ``_mamba_block_aligned_split`` stops a prefill chunk at the block-floored junction, and
the KV cache manager keeps the state ending there as a reachable boundary under the default
sparse retention. Cost: at most one extra prefill chunk and one retained state (one block per
GDN group: 15.4 MiB at TP4) per request whose system block is not yet cached; none for later
turns or sessions, whose cache hit already covers it.

``CACHE_SYSTEM_JUNCTION=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm.vllm_overrides.prefix_junction")

ENABLED = os.environ.get("CACHE_SYSTEM_JUNCTION", "1") != "0"
END_OF_MESSAGE = "<|im_end|>"
_UNSET = -2


def _end_token_id(scheduler: Any) -> int:
    """The tokenizer's ``<|im_end|>`` id, looked up once per scheduler (-1: none)."""
    cached = getattr(scheduler, "_vo_im_end_id", _UNSET)
    if cached != _UNSET:
        return cached
    token_id = -1
    try:
        from transformers import AutoTokenizer

        mc = scheduler.vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(
            mc.tokenizer, revision=mc.tokenizer_revision, trust_remote_code=mc.trust_remote_code
        )
        found = tok.convert_tokens_to_ids(END_OF_MESSAGE)
        if isinstance(found, int) and found != tok.unk_token_id:
            token_id = found
    except Exception as exc:  # noqa: BLE001 - no tokenizer: the feature stays off
        logger.warning("CACHE_SYSTEM_JUNCTION: no %s token (%s); off", END_OF_MESSAGE, exc)
    scheduler._vo_im_end_id = token_id
    logger.info("CACHE_SYSTEM_JUNCTION: %s id %d", END_OF_MESSAGE, token_id)
    return token_id


def first_block_end(prompt: Any, token_id: int, limit: int) -> int:
    """Position just after the first ``token_id`` within the first ``limit`` tokens (0: none)."""
    try:
        if isinstance(prompt, list):
            return prompt.index(token_id, 0, limit) + 1
        return list(prompt[:limit]).index(token_id) + 1
    except ValueError:
        return 0


def system_junction(scheduler: Any, request: Any, num_local_computed: int, boundary: int) -> int:
    """``request.shared_prefix_boundary`` after the scheduler's cache lookup.

    Keeps vLLM's own junction when it found one; otherwise returns the end of the prompt's
    first message block when that lies past the cached prefix, at least one scheduler block
    in and at least one block before the prompt's end (the prompt-end state covers it there).
    """
    if not ENABLED or boundary or not scheduler.need_mamba_block_aligned_split:
        return boundary
    token_id = _end_token_id(scheduler)
    prompt = request.prompt_token_ids
    if token_id < 0 or prompt is None:
        return boundary
    block = scheduler.cache_config.block_size
    end = request.num_prompt_tokens
    pos = first_block_end(prompt, token_id, end)
    if pos // block * block > max(num_local_computed, 0) and pos + block < end:
        return pos
    return boundary
