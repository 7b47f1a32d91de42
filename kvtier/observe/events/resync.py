"""Incremental resync: the resident blocks announced a chunk at a time, on the manager's thread.

A resync tells consumers everything the manager holds (``AllBlocksCleared``, then
``BlockStored`` per resident block). Walking a million blocks at once would hold vLLM's
scheduler thread for seconds, and the walk cannot move to another thread (the manager is not
thread-safe), so it is spread over the owner's ``publish`` calls, ``chunk`` units of work
each, with the manager's own events published in between, in the order things happened.

Why consumers still end with the exact state, and never hold a block the manager does not:

* every chunk is read on the manager's thread at the moment it is queued, so each
  ``BlockStored`` it carries is true at its place in the stream;
* a key is yielded only if it is READY when yielded (an earlier snapshot could announce a
  block evicted since: a wrong hit);
* keys are walked shard by shard (a key's shard never changes, and each small shard is copied
  in one go, so the walk never iterates a dict that changes under it): a key resident for the
  whole walk is announced; one that arrives or leaves meanwhile has its own event, after the
  ``AllBlocksCleared``.

Until the walk ends consumers hold a subset of the truth (misses, not wrong hits)."""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterator, Mapping

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.specs import BlockKey, Medium

# One item per unit of work: (medium, key) for a resident block, None for a key passed over
# (not READY) or a shard opened, so a chunk bounds the work of a call, not just its output.
WalkItem = tuple[Medium, BlockKey] | None
ResidentWalk = Callable[[], Iterator[WalkItem]]

DEFAULT_CHUNK = 1024  # units per publish call: about a millisecond of scheduler time


def walk_resident(manager: OffloadingManager) -> Iterator[WalkItem]:
    """READY blocks of each tier of a manager (``OffloadingManager.tier``), safe to suspend
    between any two items while the manager changes (see the module docstring)."""
    for medium in (Medium.CPU, Medium.DISK):
        tier = manager.tier(medium)
        if tier is None:
            continue
        medium = tier.medium
        for i in range(tier.shard_count()):
            yield None
            for key in tier.shard_keys(i):
                yield (medium, key) if tier.is_ready(key) else None


class ChunkedWalk:
    """One resync in progress: hands out the next chunk of resident blocks per call."""

    def __init__(self, walk: Iterator[WalkItem], chunk: int = DEFAULT_CHUNK) -> None:
        if chunk < 1:
            raise ValueError("resync chunk must be at least 1")
        self._walk = walk
        self._chunk = chunk
        self.done = False
        self.blocks = 0  # resident blocks announced so far

    def next_chunk(self) -> Mapping[Medium, list[BlockKey]]:
        """At most ``chunk`` units of work; sets ``done`` once the walk is over."""
        items = list(islice(self._walk, self._chunk))
        self.done = len(items) < self._chunk
        out: dict[Medium, list[BlockKey]] = {}
        for item in items:
            if item is not None:
                out.setdefault(item[0], []).append(item[1])
                self.blocks += 1
        return out
