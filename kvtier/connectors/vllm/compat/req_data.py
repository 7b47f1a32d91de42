"""A step's block tables per request, with one meaning on every supported vLLM.

vLLM's ``yield_req_data`` yields ``(req_id, block_id_groups, flag)``; the flag was
``preempted`` in 0.32 (False for new requests) and is ``is_full_table`` in 0.33 (True for new
and resumed requests). kvtier needs the 0.33 meaning — a full table starts at block 0, so the
locally cached prefix is in it and is not rewritten this step — and computes it from the
``SchedulerOutput`` fields both releases have, instead of trusting the flag's position.
"""

from __future__ import annotations

from typing import Any, Iterator

StepBlocks = tuple[str, tuple[list[int], ...] | None, bool, int]


def scheduled_blocks(so: Any) -> Iterator[StepBlocks]:
    """Yields ``(req_id, block_id_groups, is_full_table, num_computed_tokens)`` for every
    request scheduled in ``so``: new requests and resumed ones carry their whole table; the
    others only the blocks added this step (or None)."""
    for r in so.scheduled_new_reqs:
        yield r.req_id, r.block_ids, True, r.num_computed_tokens
    cached = so.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or set()
    for i, req_id in enumerate(cached.req_ids):
        yield req_id, cached.new_block_ids[i], req_id in resumed, cached.num_computed_tokens[i]


def written_block_ids(so: Any, block_size: int) -> set[int]:
    """Engine blocks (any group) that this step's forward writes: a full table's blocks past
    the local hit, every block added to a running request, copy-on-write destinations. The
    null block (0) is never written."""
    out: set[int] = set()
    for _req_id, groups, full, computed in scheduled_blocks(so):
        if not groups:
            continue
        skip = computed // block_size if full else 0
        for ids in groups:
            out.update(ids[skip:])
    for copy in getattr(so, "kv_cache_block_copies", None) or ():
        out.add(copy.dst_block_id)
    out.discard(0)
    return out
