"""Bookkeeping of one tier: which block sits where, in which state, pinned by whom.

Slot lifecycle (explicit, as SGLang's HiCache does it)::

    free -> WRITING -> READY -> (readers > 0: loading) -> READY -> evicted -> free
                  \\-> failed store -> free

A block is only readable (``lookup`` / ``prepare_load``) in READY, and only evictable in READY
with no readers and no flush in flight. The index never touches bytes; slot ids are handed to
the worker side, which owns the memory.

Storage is column-wise: each resident block owns a *handle* (its CPU slot id on the CPU tier,
an internal number on the disk tier) and its state, pin count and flags live in arrays indexed
by it; ``key -> handle`` is a :class:`KeyShards`. A tier of a million blocks therefore holds
no per-block Python objects (a full garbage collection does not walk them) and no big dict
that rebuilds its table on one request. :class:`Entry` is a short-lived view of one handle.
The columns (:class:`~kvtier.manager.index.tier_entry.TierColumns`) are shared, explicitly, with the
tier's eviction-order walks (:class:`~kvtier.manager.index.tier_walks.TierWalks`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Iterator, Sequence

from kvtier.manager.index.keyed_list import KeyShards
from kvtier.manager.policies import EvictionPolicy
from kvtier.manager.specs import BlockKey, Medium
from kvtier.manager.index.tier_entry import CODES as _CODES
from kvtier.manager.index.tier_entry import FLUSH_FAILED as _FLUSH_FAILED
from kvtier.manager.index.tier_entry import FLUSHING as _FLUSHING
from kvtier.manager.index.tier_entry import FREE as _FREE
from kvtier.manager.index.tier_entry import ON_DISK as _ON_DISK
from kvtier.manager.index.tier_entry import PROMOTED as _PROMOTED
from kvtier.manager.index.tier_entry import READY as _READY
from kvtier.manager.index.tier_entry import WRITING as _WRITING
from kvtier.manager.index.tier_entry import BlockState, Entry, TierColumns  # noqa: F401 - tier types
from kvtier.manager.index.tier_walks import TierWalks


class TierIndex:
    """Entries, eviction order and capacity of one tier (its walks: ``TierWalks``)."""

    def __init__(self, medium: Medium, capacity_blocks: int, policy: EvictionPolicy,
                 with_slots: bool, first_handle: int = 0) -> None:
        """``first_handle``: the tier's handles are ``first_handle ..`` + capacity (the CPU
        tier's region of a host tier pool, whose slot ids are the pool's)."""
        if capacity_blocks <= 0:
            raise ValueError(f"{medium.value} tier capacity must be at least one block")
        if first_handle < 0:
            raise ValueError(f"{medium.value}: first handle must be >= 0, got {first_handle}")
        n = self.capacity = capacity_blocks
        end = self.handle_end = first_handle + n
        # handles (< end) index the policy's columns
        limit = getattr(policy, "handle_limit", getattr(policy, "capacity", end))
        if limit < end:
            raise ValueError(f"{medium.value}: eviction policy sized for handles below "
                             f"{limit}, tier's go up to {end}")
        self.medium = medium
        self.policy = policy
        self.with_slots = with_slots
        self._handles = KeyShards(n)  # key -> handle
        self._shards, self._nshards = self._handles.shards, self._handles.n
        self._len = 0
        self.columns = TierColumns(end, with_slots)
        # the columns bound once: _FREE / _WRITING / _READY, flag bits, pin counts
        self._state, self._flags = self.columns.state, self.columns.flags
        self._readers = self.columns.readers
        # Free handles, chained: _free_next[h] is the next free one; ``end`` ends the chain.
        # The lowest handle goes first while the tier fills (the CPU pool fills front to back).
        self._free_next = array("i", bytes(4 * first_handle)) + array(
            "i", range(first_handle + 1, end + 1))
        self._free_head = first_handle
        self._walks = TierWalks(self._shards, self.columns)
        self.entries = Entries(self)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) % self._nshards]

    def __len__(self) -> int:
        return self._len

    def keys(self) -> Iterator[BlockKey]:
        """The keys here, in no particular order (do not change the tier while iterating)."""
        return self._handles.keys()

    def get(self, key: BlockKey) -> Entry | None:
        h = self._shards[hash(key) % self._nshards].get(key)
        return None if h is None else Entry(self.columns, h)

    def entry_at(self, handle: int) -> Entry:
        """The view of the resident block at ``handle`` (CPU: its slot id)."""
        return Entry(self.columns, handle)

    def ready(self, key: BlockKey) -> Entry | None:
        h = self._shards[hash(key) % self._nshards].get(key)
        return Entry(self.columns, h) if h is not None and self._state[h] == _READY else None

    def is_ready(self, key: BlockKey) -> bool:
        h = self._shards[hash(key) % self._nshards].get(key)
        return h is not None and self._state[h] == _READY

    def ready_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are READY here (a lookup's hot loop: no Entry objects)."""
        shards, nshards, st = self._shards, self._nshards, self._state
        n = 0
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is None or st[h] != _READY:
                break
            n += 1
        return n

    def ready_handles(self, keys: Sequence[BlockKey]) -> list[int]:
        """Handles (CPU: slot ids) of the leading READY ``keys``, pinning nothing: what a
        ``pin_ready_prefix`` right now would return (a load's prefetch hint reads them)."""
        shards, nshards, st = self._shards, self._nshards, self._state
        out: list[int] = []
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is None or st[h] != _READY:
                break
            out.append(h)
        return out

    def pin_ready_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Add one reader to each of the leading READY ``keys``; their handles, in order."""
        out = self.ready_handles(keys)
        readers = self._readers
        for h in out:
            readers[h] += 1
        return out

    def unpin_ready(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Drop one reader of each READY ``key`` that has one; returns, in order, the keys
        that are not in that state (absent, WRITING, unpinned) for the caller to handle."""
        shards, nshards, st, readers = self._shards, self._nshards, self._state, self._readers
        rest: list[BlockKey] = []
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is not None and st[h] == _READY and readers[h] > 0:
                readers[h] -= 1
            else:
                rest.append(key)
        return rest

    @property
    def free_count(self) -> int:
        return self.capacity - self._len

    def add(self, key: BlockKey, state: BlockState, parent: BlockKey | None = None) -> Entry:
        """Take a free slot for ``key``; caller made sure one is free."""
        return Entry(self.columns, self.add_many((key,), state, (parent,))[0])

    def add_many(self, keys: Sequence[BlockKey], state: BlockState,
                 parents: Sequence[BlockKey | None] | None = None) -> list[int]:
        """``add`` for a batch (one call per request, not per block); returns the handles.
        A refused batch (no room, a key already here or twice in it) changes nothing."""
        if self.capacity - self._len < len(keys):
            raise RuntimeError(f"{self.medium.value}: add() with no free capacity")
        shards, nshards = self._shards, self._nshards
        code = _CODES[state]
        free_next, st, flags, readers = self._free_next, self._state, self._flags, self._readers
        out: list[int] = []
        h = self._free_head
        for key in keys:  # one lookup per key: the presence check is the insert's own probe
            shard = shards[hash(key) % nshards]
            if shard.setdefault(key, h) != h:
                for k, placed in zip(keys, out):  # undo; the free chain was not moved yet
                    del shards[hash(k) % nshards][k]
                    st[placed] = _FREE
                raise KeyError(f"{self.medium.value}: block already present")
            st[h] = code
            flags[h] = 0
            readers[h] = 0
            out.append(h)
            h = free_next[h]
        self._free_head = h
        self._len += len(keys)
        self.policy.insert_at(keys, out, parents)
        return out

    def partition(self, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[BlockKey]]:
        """``keys`` (first occurrences only) split into those here and those not, in order."""
        shards, nshards = self._shards, self._nshards
        here: list[BlockKey] = []
        absent: list[BlockKey] = []
        for key in dict.fromkeys(keys) if len(set(keys)) != len(keys) else keys:
            if key in shards[hash(key) % nshards]:
                here.append(key)
            else:
                absent.append(key)
        return here, absent

    def access(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The ``keys`` here were used: tell the policy, in order, by handle (found in this
        index, which the request has just read: cheaper than the policy's own). Returns the
        keys not here, in order."""
        shards, nshards = self._shards, self._nshards
        here: list[BlockKey] = []
        handles: list[int] = []
        rest: list[BlockKey] = []
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is None:
                rest.append(key)
            else:
                here.append(key)
                handles.append(h)
        if here:
            self.policy.access_at(here, handles)
        return rest

    def stored_writes(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The ``keys`` that are WRITING because of a store (not a promotion), in order."""
        shards, nshards, st, flags = self._shards, self._nshards, self._state, self._flags
        out: list[BlockKey] = []
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is not None and st[h] == _WRITING and not flags[h] & _PROMOTED:
                out.append(key)
        return out

    def publish_stored_writes(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The ``keys`` that are WRITING because of a store (not a promotion) become READY
        (their bytes are written); returns them, in order (``stored_writes`` + marking them,
        in one lookup per key)."""
        shards, nshards, st, flags = self._shards, self._nshards, self._state, self._flags
        out: list[BlockKey] = []
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is not None and st[h] == _WRITING and not flags[h] & _PROMOTED:
                st[h] = _READY
                out.append(key)
        return out

    def remove(self, key: BlockKey) -> bool:
        """Forget ``key`` and free its handle; False if it was not here. Views of it die."""
        return bool(self.remove_many((key,)))

    def remove_many(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Forget the ``keys`` that are here (returned, in order) and free their handles."""
        shards, nshards, st, free_next = self._shards, self._nshards, self._state, self._free_next
        gone: list[BlockKey] = []
        handles: list[int] = []
        for key in keys:
            h = shards[hash(key) % nshards].pop(key, None)
            if h is None:
                continue
            st[h] = _FREE
            gone.append(key)
            handles.append(h)
        # Chained in ascending order, so the next store gets a batch's neighbouring CPU slots
        # as ascending runs: one strided DMA per layer on a load. The eviction order is not
        # the slot order (a request's blocks go tail first, so that a prefix outlives its
        # extensions), and slots handed out descending make every block its own copy: a long
        # hit's load got markedly slower once the tier evicted (figures:
        # docs/design-measurements.md, "kvtier/manager/index/tier_index.py").
        head = self._free_head
        for h in sorted(handles, reverse=True):
            free_next[h] = head
            head = h
        self._free_head = head
        self._len -= len(gone)
        self.policy.remove_at(gone, handles)
        return gone

    def start_flushes(self, handles: Sequence[int]) -> None:
        """Mark these READY blocks as being copied to disk (pinned: not evictable)."""
        flags = self._flags
        for h in handles:
            flags[h] |= _FLUSHING

    def forget_disk_copies(self, keys: Sequence[BlockKey]) -> None:
        """The disk evicted ``keys``: those here are dirty again (no copy on disk)."""
        shards, nshards, flags = self._shards, self._nshards, self._flags
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is not None:
                flags[h] &= ~_ON_DISK & 0xFF

    def finish_flushes(self, keys: Sequence[BlockKey], success: bool) -> None:
        """The flushes of ``keys`` ended: unpinned, and clean (``success``: a copy on disk)
        or marked failed (evictable without a copy: the disk would not keep it)."""
        shards, nshards, flags = self._shards, self._nshards, self._flags
        keep = ~(_FLUSHING | _ON_DISK | _FLUSH_FAILED) & 0xFF
        mark = _ON_DISK if success else _FLUSH_FAILED
        for key in keys:
            h = shards[hash(key) % nshards].get(key)
            if h is not None:
                flags[h] = flags[h] & keep | mark

    def shard_count(self) -> int:
        """Number of key shards (fixed for the tier's life)."""
        return self._nshards

    def shard_keys(self, i: int) -> list[BlockKey]:
        """The keys of shard ``i``, copied (a key always lives in the same shard): lets a walk
        over the tier pause between shards while the tier changes (event resyncs)."""
        return list(self._shards[i])

    def free_handles(self) -> list[int]:
        """The free chain, in the order it hands handles out. O(capacity): checks only."""
        out, h = [], self._free_head
        while h < self.handle_end and len(out) <= self.capacity:
            out.append(h)
            h = self._free_next[h]
        return out

    def pins(self) -> int:
        """Pins held in this tier: readers, flushes in flight, blocks being written."""
        state, readers, flags = self._state, self._readers, self._flags
        return sum(readers[h] + bool(flags[h] & _FLUSHING) + (state[h] == _WRITING)
                   for h in self._handles.values())

    # ------------------------------------------------------------------ eviction-order walks
    def victims(self, n: int, evictable=None) -> list[BlockKey]:
        """Up to ``n`` unpinned READY keys in the policy's order (``TierWalks.victims``)."""
        return self._walks.victims(self.policy, n, evictable)

    def victims_preferring(self, n: int, preferred, budget: int) -> tuple[list[BlockKey], int]:
        """Clean or ``preferred`` victims first (``TierWalks.victims_preferring``)."""
        return self._walks.victims_preferring(self.policy, n, preferred, budget)

    def dirty_among_coldest(self, n: int) -> tuple[list[BlockKey], list[int]]:
        """What write-back copies next (``TierWalks.dirty_among_coldest``)."""
        return self._walks.dirty_among_coldest(self.policy, n)


class Entries(Mapping):
    """Read-only ``key -> Entry`` mapping over a tier (stats, resyncs, tests)."""

    def __init__(self, index: TierIndex) -> None:
        self._index = index

    def __getitem__(self, key: BlockKey) -> Entry:
        entry = self._index.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[BlockKey]:
        return self._index.keys()

    def __len__(self) -> int:
        return len(self._index)
