"""The shared tier's side of the manager: presence lookups, promotions, write-back.

:class:`RemoteTier` is built by the tiered manager with the shared tier's presence directory,
its admission, the CPU tier, counters, event bus, background queue and the CPU eviction's
``make_room``. Without a directory (no shared tier configured) every method is a no-op
answering "not here". The manager cannot index the shared tier (other instances write and the
server evicts), so:

* ``lookup`` asks a :class:`~kvtier.tiers.remote.directory.RemoteDirectory` about the keys
  after the local hits, never waiting: keys still being asked make the result ``pending``
  (vLLM asks again next step).
* A remote hit is promoted like a disk hit: a CPU slot reserved (WRITING, ``promoted``) and a
  REMOTE -> CPU read queued; settling publishes the block or, when the read missed, frees the
  slot and forgets the answer.
* ``complete_store`` queues a CPU -> REMOTE write of the newly stored blocks the shared tier
  admits and does not hold yet, at most ``max_writes`` blocks at once, each CPU slot pinned
  until its write is reported. The rest waits in a backlog (oldest first, unpinned, at most
  the CPU tier's size), so a long prompt is shared whole; a backlogged block evicted before
  its turn is skipped (``remote_writes_skipped``). The backlog's next ``max_writes`` blocks
  are asked about again before their turn (``RemoteDirectory.recheck``): another instance
  that recomputed a block the tier missed is often writing it too, and a block found held by
  then is not written twice (``remote_writes_already_held``). "Held" means a valid record
  (``RemoteDirectory.known_held``), never a bare EXISTS: junk planted under a key, or a
  record under an old MAC key, is overwritten."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Callable, Sequence

from kvtier.manager.admission import AdmissionPolicy, AdmitAll
from kvtier.manager.background import BackgroundQueue
from kvtier.manager.events import BlockAccessed, BlockStored, EventBus
from kvtier.manager.remote.lag import WriteLagNotice
from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec, Medium
from kvtier.manager.stats import ManagerStats
from kvtier.manager.index.tier_index import BlockState, Entry, TierIndex


class RemoteTier:
    """Shared-tier bookkeeping; see the module docstring."""

    def __init__(self, directory, *, admission: AdmissionPolicy | None, max_writes: int,
                 capacity_blocks: int | None, cpu: TierIndex, stats: ManagerStats,
                 events: EventBus, background: BackgroundQueue,
                 make_room: Callable[[int], bool]) -> None:
        self.directory = directory  # a RemoteDirectory, or None without a shared tier
        self.admission = admission or AdmitAll()
        self.max_writes = max(1, max_writes)
        self.capacity_blocks = capacity_blocks  # advisory (the server's maxmemory rules)
        self.cpu = cpu
        self.stats = stats
        self.events = events
        self.background = background
        self._make_room = make_room
        self.writing = 0  # blocks whose CPU -> REMOTE write is queued or running
        # admitted, awaiting room; the value: asked about again (``_recheck_next``)
        self.backlog: OrderedDict[BlockKey, bool] = OrderedDict()
        self.max_backlog = max(self.max_writes, cpu.capacity)
        self.promotions: set[BlockKey] = set()  # keys whose REMOTE -> CPU hop is in flight
        self.lag = WriteLagNotice()  # logs when blocks leave before their write
        if directory is not None:  # per-tier counters gain a REMOTE column
            s = self.stats
            for per_tier in (s.hit_blocks, s.stored_blocks, s.evicted_blocks, s.admission_rejected,
                             s.skipped_slower_than_recompute, s.failed_stores):
                per_tier.setdefault("REMOTE", 0)

    def extend_lookup(self, keys: Sequence[BlockKey], tiers: list) -> bool:
        """``lookup``: append REMOTE for the leading run of ``keys[len(tiers):]`` the shared
        tier holds; True when an answer is still pending (nothing is waited for)."""
        if self.directory is None or len(tiers) >= len(keys):
            return False
        self._sync_stats()
        for present in self.directory.query(keys[len(tiers):]):
            if present is None:
                self.stats.remote_pending_lookups += 1
                return True
            if not present:
                break
            tiers.append(Medium.REMOTE)
        return False

    def promote(self, key: BlockKey) -> Entry | None:
        """A lookup's promotion of a key held nowhere locally: a CPU slot reserved for its
        REMOTE -> CPU read (WRITING, promoted), or None (not held there, or no free slot)."""
        if self.directory is None or not self.directory.known_present(key):
            return None
        if not self._make_room(1):
            self.stats.load_truncated_no_space += 1
            return None
        entry = self.cpu.add(key, BlockState.WRITING)
        entry.promoted = True
        self.promotions.add(key)
        return entry

    def settle_promotion(self, key: BlockKey, bad: bool) -> bool:
        """A settled promotion of ``key``: True when it came from the shared tier."""
        if key not in self.promotions:
            return False
        self.promotions.discard(key)
        if bad:
            self.directory.learned([key], present=False)
        return True

    def queue_writes(self, keys: Sequence[BlockKey]) -> None:
        """``complete_store``: write the newly stored ``keys`` the shared tier admits."""
        if self.directory is None or not keys:
            return
        if self.directory.degraded:
            self.stats.remote_writes_skipped += len(keys)
            return
        wanted: list[BlockKey] = []
        for key in keys:
            if self.directory.known_held(key):
                self.stats.remote_writes_already_held += 1
                continue
            if not self.admission.admit(key):
                self.stats.admission_rejected["REMOTE"] += 1
                continue
            wanted.append(key)
        for key in wanted:
            self.backlog.setdefault(key, False)  # a key queued twice keeps its place and state
        overflow = 0
        while len(self.backlog) > self.max_backlog:  # the oldest waiting write gives way
            self.backlog.popitem(last=False)
            overflow += 1
        if overflow:
            self.stats.remote_writes_skipped += overflow
            self.lag.lost(overflow)
        self._drain(grew=bool(wanted))

    def _drain(self, grew: bool = False) -> None:
        """Start the backlog's writes, oldest first, while fewer than ``max_writes`` run.
        ``grew``: keys were just added (the next writes may be new ones)."""
        keys, slots = [], []
        evicted = popped = 0
        while self.backlog and self.writing + len(keys) < self.max_writes:
            key, _ = self.backlog.popitem(last=False)
            popped += 1
            entry = self.cpu.ready(key)
            if entry is None:  # evicted from CPU memory (or rewritten) before its turn
                evicted += 1
                continue
            if self.directory.known_held(key):  # another instance wrote it meanwhile
                self.stats.remote_writes_already_held += 1
                continue
            entry.readers += 1  # pinned until the write is reported
            keys.append(key)
            slots.append(entry.slot)
        if evicted:
            self.stats.remote_writes_skipped += evicted
            self.lag.lost(evicted)
        if keys:
            self.writing += len(keys)
            self.background.queue(LoadStoreSpec.cpu(slots), LoadStoreSpec.remote(keys), keys)
        if popped or grew:  # otherwise the next writes are the ones already asked about
            self._recheck_next()

    def _recheck_next(self) -> None:
        """Ask the server once more about the blocks whose write starts next (the backlog's
        first ``max_writes``), each once: their answers land while the writes before them
        run, and ``_drain`` skips those found held."""
        ask = [key for key, asked in islice(self.backlog.items(), self.max_writes) if not asked]
        for key in ask:
            self.backlog[key] = True
        if ask:
            self.directory.recheck(ask)

    def write_done(self, t: BackgroundTransfer, success: bool) -> None:
        """Settle a reported CPU -> REMOTE transfer (``complete_background``)."""
        self.writing -= len(t.keys)
        for key in t.keys:
            entry = self.cpu.get(key)
            if entry is not None and entry.readers > 0:
                entry.readers -= 1
            else:
                self.stats.protocol_errors += 1
        if success:
            self.directory.learned(t.keys, present=True)
            self.stats.stored_blocks["REMOTE"] += len(t.keys)
            self.lag.written(len(t.keys))
            self.events.emit(BlockStored(Medium.REMOTE, tuple(t.keys)))
        else:
            self.stats.failed_stores["REMOTE"] += len(t.keys)
        self._sync_stats()
        self._drain()

    def count_hits(self, keys: Sequence[BlockKey]) -> None:
        """``prepare_load`` loads ``keys`` promoted from the shared tier: counted, an event."""
        self.stats.hit_blocks["REMOTE"] += len(keys)
        self.events.emit(BlockAccessed(Medium.REMOTE, tuple(keys)))

    def _sync_stats(self) -> None:
        if self.directory is not None:
            self.stats.remote_degraded = self.directory.degraded
            self.stats.remote_degradations = self.directory.degradations

    def usage(self) -> dict[str, int | None]:
        """What ``usage()`` reports for the shared tier: this instance's view only."""
        return {"used_blocks": self.stats.stored_blocks["REMOTE"],
                "capacity_blocks": self.capacity_blocks,
                "writes_in_flight": self.writing}
