"""Keep a GDN state at the end of a prompt's system block (patch 0008); align chunk splits to
the KV block size (patch 0009).

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
DEBUG = os.environ.get("CACHE_SYSTEM_JUNCTION_DEBUG") == "1"  # log every lookup
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


def _wrap_for_debug(scheduler: Any) -> None:
    """CACHE_SYSTEM_JUNCTION_DEBUG=1: log vLLM's chunk splits and mamba block caching."""
    scheduler._vo_debug_wrapped = True
    split = scheduler._mamba_block_aligned_split

    def logged_split(request: Any, n: int, *args: Any) -> int:
        out = split(request, n, *args)
        logger.info(
            "split %s: computed %d, asked %d -> %d (junction %d)",
            request.request_id, request.num_computed_tokens, n, out,
            request.shared_prefix_boundary,
        )  # fmt: skip
        return out

    scheduler._mamba_block_aligned_split = logged_split
    for mgr in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if type(mgr).__name__ != "MambaManager":
            continue
        cache = mgr.cache_blocks
        free = mgr.remove_skipped_blocks

        def logged_cache(request: Any, num_tokens: int, *a: Any, _c=cache, _m=mgr, **k: Any):
            before = _m.num_cached_block.get(request.request_id, 0)
            out = _c(request, num_tokens, *a, **k)
            blocks = _m.req_to_blocks.get(request.request_id, [])
            hashed = [i for i, b in enumerate(blocks) if not b.is_null and b.block_hash]
            logger.info(
                "mamba g%d cache_blocks %s: tokens %d, cached blocks %d -> %d, hashed %s",
                _m.kv_cache_group_id, request.request_id, num_tokens, before,
                _m.num_cached_block.get(request.request_id, 0), hashed,
            )  # fmt: skip
            return out

        def logged_free(rid: str, tokens: int, *a: Any, _f=free, _m=mgr, **k: Any):
            out = _f(rid, tokens, *a, **k)
            blocks = _m.req_to_blocks.get(rid, [])
            live = [i for i, b in enumerate(blocks) if not b.is_null]
            logger.info("mamba g%d skip %s @%d: live %s", _m.kv_cache_group_id, rid, tokens, live)
            return out

        mgr.cache_blocks = logged_cache
        mgr.remove_skipped_blocks = logged_free
        break


def split_block_size(scheduler: Any) -> int:
    """The block size ``Scheduler._mamba_block_aligned_split`` aligns chunk ends to (patch 0009).

    Upstream reads ``self.cache_config.block_size``. With the engine core in its own process
    (the server's default, and every TP > 1 launch) that field still holds the platform's
    pre-alignment default (128 on CPU; the tiny model's KV blocks are 256), so chunks end at
    128-token multiples that are not KV block boundaries, the states written there are never
    cached, and every prefix hit that needs one is lost (issue 13: quick8 efficiency 65 %
    before the fix). The scheduler's own ``block_size`` comes from the KV cache groups
    (``resolve_kv_cache_block_sizes``: the LCM of the group block sizes, i.e. the Mamba block
    size in align mode) and is what the KV cache manager uses.
    """
    configured = scheduler.cache_config.block_size
    actual = scheduler.block_size
    if configured != actual and not getattr(scheduler, "_vo_split_logged", False):
        scheduler._vo_split_logged = True
        logger.info(
            "mamba align split: block size %d from the KV cache groups (cache_config says %d)",
            actual, configured,
        )  # fmt: skip
    return actual


def system_junction(scheduler: Any, request: Any, num_local_computed: int, boundary: int) -> int:
    """``request.shared_prefix_boundary`` after the scheduler's cache lookup.

    Keeps vLLM's own junction when it found one; otherwise returns the end of the prompt's
    first message block when that lies past the cached prefix, at least one scheduler block
    in and at least one block before the prompt's end (the prompt-end state covers it there).
    """
    if DEBUG and not getattr(scheduler, "_vo_debug_wrapped", False):
        _wrap_for_debug(scheduler)
    if DEBUG:
        logger.info(
            "CACHE_SYSTEM_JUNCTION lookup %s: prompt %d, cached %d, vLLM junction %d",
            request.request_id, request.num_prompt_tokens, num_local_computed, boundary,
        )  # fmt: skip
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
