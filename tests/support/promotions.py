"""Promotions as the tests drive them by hand: what the connector's engine steps do between a
lookup that answered "not yet" and the one that finds the blocks in CPU memory.

A lookup that finds blocks on disk (or in the shared tier) queues their promotion into the CPU
tier as a background transfer. ``settle_promotions`` plays the workers for those transfers
only: each is reported as read (``failed`` keys as unreadable, ``ok=False`` as a read that
raised), and every other background transfer taken on the way is put back in the manager's
queue, in order, for the test to run as it wants.
"""

from __future__ import annotations

from typing import Collection, Sequence

from kvtier.manager.specs import BackgroundTransfer, BlockKey, LookupResult
from kvtier.transfer.jobs import is_promotion as promotes


def is_promotion(t: BackgroundTransfer) -> bool:
    return promotes(t.src.medium, t.dst.medium)


def _tiered(m):
    while hasattr(m, "inner"):  # admission wrappers
        m = m.inner
    return m


def settle_promotions(m, failed: Collection[BlockKey] = (), ok: bool = True,
                      transient: Collection[BlockKey] = ()) -> list[BackgroundTransfer]:
    """Complete every promotion ``m`` has queued; returns them."""
    taken = m.take_background_transfers()
    promotions = [t for t in taken if is_promotion(t)]
    others = [t for t in taken if not is_promotion(t)]
    _tiered(m).background.ready[:0] = others  # not ours to run: back in the queue, in order
    for t in promotions:
        bad = [k for k in t.keys if k in set(failed)]
        m.complete_background(t.id, ok, bad, [k for k in bad if k in set(transient)])
    return promotions


def lookup_promoted(m, keys: Sequence[BlockKey], failed: Collection[BlockKey] = (),
                    ok: bool = True, rounds: int = 8, **kw) -> LookupResult:
    """``m.lookup(keys)``, its promotions settled and asked again until it no longer answers
    "not yet" (at most ``rounds`` times: a lookup pending for good is a test failure)."""
    found = m.lookup(keys, **kw)
    for _ in range(rounds):
        if not found.pending:
            return found
        settle_promotions(m, failed, ok)
        found = m.lookup(keys, sighting=False)
    raise AssertionError(f"lookup still pending after {rounds} rounds of promotions")
