"""One tier block's columns seen as an object: its state, its pins and flags (:class:`Entry`),
and the read-only ``key -> Entry`` mapping over a tier (:class:`Entries`).

The tier (:mod:`kvtier.manager.tier_index`) stores blocks column-wise, with no per-block Python
object; these views are made on demand (stats, resyncs, the rarer manager paths, tests) and
die with the block. The column codes live here so that both sides read the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Iterator

from kvtier.manager.specs import BlockKey

if TYPE_CHECKING:
    from kvtier.manager.tier_index import TierIndex


class BlockState(Enum):
    WRITING = "writing"  # bytes are being written (store, promotion or flush); not readable
    READY = "ready"


FREE, WRITING, READY = 0, 1, 2  # values of the state column
STATES = (None, BlockState.WRITING, BlockState.READY)  # column value -> state
CODES = {BlockState.WRITING: WRITING, BlockState.READY: READY}
FLUSHING, ON_DISK, FLUSH_FAILED, PROMOTED = 1, 2, 4, 8


def _flag(bit: int, doc: str) -> property:
    def get(self: "Entry") -> bool:
        return bool(self._ix._flags[self.handle] & bit)

    def put(self: "Entry", on: bool) -> None:
        flags = self._ix._flags
        flags[self.handle] = (flags[self.handle] | bit) if on else (flags[self.handle] & ~bit)

    return property(get, put, doc=doc)


class Entry:
    """View of one resident block's columns; valid until the block is removed."""

    __slots__ = ("_ix", "handle")

    def __init__(self, index: "TierIndex", handle: int) -> None:
        self._ix = index
        self.handle = handle

    @property
    def slot(self) -> int:
        """CPU slot id; -1 on tiers addressed by key (disk)."""
        return self.handle if self._ix.with_slots else -1

    @property
    def state(self) -> BlockState:
        return STATES[self._ix._state[self.handle]]

    @state.setter
    def state(self, state: BlockState) -> None:
        self._ix._state[self.handle] = CODES[state]

    @property
    def readers(self) -> int:
        """In-flight loads reading this block (pins)."""
        return self._ix._readers[self.handle]

    @readers.setter
    def readers(self, n: int) -> None:
        self._ix._readers[self.handle] = n

    flushing = _flag(FLUSHING, "CPU only: a copy to disk is reading this slot (pin)")
    on_disk = _flag(ON_DISK, "CPU only: a READY copy also exists on disk (clean)")
    flush_failed = _flag(FLUSH_FAILED, "CPU only: the disk refused it; drop, don't retry")
    promoted = _flag(PROMOTED, "CPU only: WRITING because a load promotes it from disk")

    @property
    def pinned(self) -> bool:
        ix, h = self._ix, self.handle
        return ix._readers[h] > 0 or bool(ix._flags[h] & FLUSHING) or ix._state[h] != READY


class Entries(Mapping):
    """Read-only ``key -> Entry`` mapping over a tier (stats, resyncs, tests)."""

    def __init__(self, index: "TierIndex") -> None:
        self._ix = index

    def __getitem__(self, key: BlockKey) -> Entry:
        entry = self._ix.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._ix

    def __iter__(self) -> Iterator[BlockKey]:
        return self._ix._handles.keys()

    def __len__(self) -> int:
        return len(self._ix)
