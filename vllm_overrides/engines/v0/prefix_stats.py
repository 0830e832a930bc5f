"""How many prompt tokens vLLM 0.6.3 served from its prefix cache, per request (patches 0012/0013).

0.6.3 reports no cached-token count anywhere. Its model runner skips the cached part of a
prefill chunk by one rule (``ModelInputForGPUBuilder._compute_for_prefix_cache_hit``): with
``prefix`` cached tokens (``len(computed_block_nums) * block_size``), a chunk over positions
``[context, context + chunk)``

- computes all of it when ``prefix <= context``;
- skips ``prefix - context`` tokens when the cached prefix ends inside the chunk;
- computes only its last token when the cached prefix covers the whole chunk.

The scheduler (patch 0012) calls ``note_prefill_chunk`` for each prefill chunk it schedules with
the same inputs the runner gets, so the sum is the number of prompt tokens the engine did not
compute; ``RequestOutput.from_seq_group`` (patch 0013) copies it to
``RequestOutput.num_cached_tokens``, which the API reports as
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ATTR = "vo_num_cached_tokens"


def skipped_tokens(prefix: int, context: int, chunk: int) -> int:
    """Tokens of the chunk ``[context, context + chunk)`` the runner takes from the cache."""
    end = context + chunk
    if prefix <= context or chunk <= 0:
        return 0
    if prefix < end:
        return prefix - context
    return chunk - 1


def note_prefill_chunk(
    seq_group: Any, computed_block_nums: Sequence[int] | None, context: int, chunk: int,
    block_size: int,
) -> None:  # fmt: skip
    """Add one scheduled prefill chunk's cache hit to the request's count."""
    prefix = len(computed_block_nums or ()) * block_size
    total = getattr(seq_group, ATTR, 0) + skipped_tokens(prefix, context, chunk)
    setattr(seq_group, ATTR, total)


def cached_tokens(seq_group: Any) -> int | None:
    """The request's count so far (None when the scheduler never noted a prefill)."""
    return getattr(seq_group, ATTR, None)
