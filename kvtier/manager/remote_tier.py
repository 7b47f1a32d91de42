"""The shared tier's side of the manager: presence lookups, promotions, write-back (a mixin of
``TieredOffloadingManager``, like ``WriteBack``; it shares the manager's state).

The manager cannot index the shared tier (other instances write and the server evicts), so:

* ``lookup`` asks a :class:`~kvtier.tiers.remote.directory.RemoteDirectory` about the keys
  after the local hits. It never waits: keys still being asked make the result ``pending``
  (the connector answers vLLM "not yet", and vLLM asks again next step).
* ``prepare_load`` promotes a remote hit like a disk hit: a CPU slot is reserved (WRITING,
  ``promoted``) and the worker runs REMOTE -> CPU -> GPU. ``complete_load`` publishes it, or,
  when the read missed (evicted meanwhile, corrupt, server down), frees the slot and forgets
  the answer. A remote promotion is never joined by a second load (a joined load would need
  to be ordered after it by the caller); the second load stops there and recomputes.
* ``complete_store`` queues a CPU -> REMOTE write of the newly stored blocks that the shared
  tier admits and does not hold yet, at most ``max_writes`` blocks at once. The CPU slot is
  pinned (a reader) until the write is reported, so it cannot be evicted or reused under it.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.manager.admission import AdmissionPolicy, AdmitAll
from kvtier.manager.events import BlockAccessed, BlockStored
from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec, Medium
from kvtier.manager.tier_index import BlockState


class RemoteTier:
    """Shared-tier bookkeeping; see the module docstring."""

    def _init_remote(self, directory, admission: AdmissionPolicy | None, max_writes: int,
                     capacity_blocks: int | None) -> None:
        self.remote = directory  # a RemoteDirectory, or None without a shared tier
        self.remote_admission = admission or AdmitAll()
        self.remote_max_writes = max(1, max_writes)
        self.remote_capacity_blocks = capacity_blocks  # advisory (the server's maxmemory rules)
        self._remote_writing = 0
        self._remote_promotions: set[BlockKey] = set()
        if directory is not None:  # per-tier counters gain a REMOTE column
            s = self.stats
            for per_tier in (s.hit_blocks, s.stored_blocks, s.evicted_blocks, s.admission_rejected,
                             s.skipped_slower_than_recompute, s.failed_stores):
                per_tier.setdefault("REMOTE", 0)

    def _extend_with_remote(self, keys: Sequence[BlockKey], tiers: list) -> bool:
        """``lookup``: append REMOTE for the leading run of ``keys[len(tiers):]`` the shared
        tier holds; True when an answer is still pending (nothing is waited for)."""
        if self.remote is None or len(tiers) >= len(keys):
            return False
        self._sync_remote_stats()
        for present in self.remote.query(keys[len(tiers):]):
            if present is None:
                self.stats.remote_pending_lookups += 1
                return True
            if not present:
                break
            tiers.append(Medium.REMOTE)
        return False

    def _promote_from_remote(self, key: BlockKey):
        """``prepare_load`` of a key held nowhere locally: a CPU slot reserved for its
        REMOTE -> CPU hop (WRITING, promoted), or None (not held there, or no free slot)."""
        if self.remote is None or not self.remote.known_present(key):
            return None
        if not self._make_room(1):
            self.stats.load_truncated_no_space += 1
            return None
        entry = self.cpu.add(key, BlockState.WRITING)
        entry.promoted = True
        self._remote_promotions.add(key)
        return entry

    def _settle_remote_promotion(self, key: BlockKey, bad: bool) -> bool:
        """``complete_load`` of a promoted key: True when it came from the shared tier."""
        if key not in self._remote_promotions:
            return False
        self._remote_promotions.discard(key)
        if bad:
            self.remote.learned([key], present=False)
        return True

    def _queue_remote_writes(self, keys: Sequence[BlockKey]) -> None:
        if self.remote is None or not keys:
            return
        if self.remote.degraded:
            self.stats.remote_writes_skipped += len(keys)
            return
        wanted: list[BlockKey] = []
        for key in keys:
            if self.remote.known_present(key):
                continue
            if not self.remote_admission.admit(key):
                self.stats.admission_rejected["REMOTE"] += 1
                continue
            wanted.append(key)
        room = max(0, self.remote_max_writes - self._remote_writing)
        if len(wanted) > room:
            self.stats.remote_writes_skipped += len(wanted) - room
            wanted = wanted[:room]
        slots = []
        for key in wanted:
            entry = self.cpu.ready(key)
            entry.readers += 1  # pinned until the write is reported
            slots.append(entry.slot)
        if wanted:
            self._remote_writing += len(wanted)
            self._queue_bg(LoadStoreSpec.cpu(slots), LoadStoreSpec.remote(wanted), wanted)

    def _remote_write_done(self, t: BackgroundTransfer, success: bool) -> None:
        self._remote_writing -= len(t.keys)
        for key in t.keys:
            entry = self.cpu.get(key)
            if entry is not None and entry.readers > 0:
                entry.readers -= 1
            else:
                self.stats.protocol_errors += 1
        if success:
            self.remote.learned(t.keys, present=True)
            self.stats.stored_blocks["REMOTE"] += len(t.keys)
            self.events.emit(BlockStored(Medium.REMOTE, tuple(t.keys)))
        else:
            self.stats.failed_stores["REMOTE"] += len(t.keys)
        self._sync_remote_stats()

    def _emit_remote_hits(self, keys: Sequence[BlockKey]) -> None:
        self.stats.hit_blocks["REMOTE"] += len(keys)
        self.events.emit(BlockAccessed(Medium.REMOTE, tuple(keys)))

    def _sync_remote_stats(self) -> None:
        if self.remote is not None:
            self.stats.remote_degraded = self.remote.degraded
            self.stats.remote_degradations = self.remote.degradations

    def _remote_usage(self) -> dict[str, int | None]:
        """What ``usage()`` reports for the shared tier: this instance's view only."""
        return {"used_blocks": self.stats.stored_blocks["REMOTE"],
                "capacity_blocks": self.remote_capacity_blocks,
                "writes_in_flight": self._remote_writing}
