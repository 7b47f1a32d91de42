"""Splitting an event batch whose encoded size is over the message limit, losing nothing.

The publisher keeps each message within ``MAX_MESSAGE_BYTES`` so that a socket's per-client
message-count limit is also a byte limit (sender.py). A batch is halved by its events; a single
event by its blocks: a chain ``BlockStored`` becomes two chains, the second one's parent being
the first one's last block, with the token ids (``block_size`` per block) and extra keys divided
the same way, which is exactly what a consumer would have built from the whole event.
"""

from __future__ import annotations

from msgspec.structs import replace

from kvtier.observe.events.wire import (
    BlockAccessed,
    BlockRemoved,
    BlockStored,
    KvtierEventBatch,
)


def _split_event(ev):
    """Two events meaning the same as ``ev``, or None if it cannot be divided."""
    hashes = getattr(ev, "block_hashes", None)
    if not hashes or len(hashes) < 2:
        return None
    n, m = len(hashes), len(hashes) // 2
    if isinstance(ev, BlockStored):
        tokens, extra = ev.token_ids, ev.extra_keys
        if tokens and len(tokens) != n * ev.block_size:
            return None
        if extra is not None and len(extra) != n:
            return None
        cut = m * ev.block_size
        return (replace(ev, block_hashes=hashes[:m], token_ids=tokens[:cut],
                        extra_keys=None if extra is None else extra[:m]),
                replace(ev, block_hashes=hashes[m:], parent_block_hash=hashes[m - 1],
                        token_ids=tokens[cut:], extra_keys=None if extra is None else extra[m:]))
    if isinstance(ev, BlockRemoved):
        return replace(ev, block_hashes=hashes[:m]), replace(ev, block_hashes=hashes[m:])
    if isinstance(ev, BlockAccessed):
        first_tokens = ev.num_tokens * m // n
        return (replace(ev, block_hashes=hashes[:m], num_tokens=first_tokens),
                replace(ev, block_hashes=hashes[m:], num_tokens=ev.num_tokens - first_tokens))
    return None


def split_batch(batch: KvtierEventBatch) -> tuple[KvtierEventBatch, KvtierEventBatch] | None:
    """Two batches carrying ``batch``'s events in order, or None if it is one indivisible
    event. State events stay before access events, as in one batch."""
    state, access = batch.events, batch.access
    n = len(state) + len(access)
    if n == 1:
        parts = _split_event(state[0] if state else access[0])
        if parts is None:
            return None
        a, b = parts
        if state:
            return replace(batch, events=[a], access=[]), replace(batch, events=[b], access=[])
        return replace(batch, events=[], access=[a]), replace(batch, events=[], access=[b])
    half = n // 2
    cut = max(0, half - len(state))
    return (replace(batch, events=state[:half], access=access[:cut]),
            replace(batch, events=state[half:], access=access[cut:]))
