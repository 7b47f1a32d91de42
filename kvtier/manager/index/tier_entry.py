"""One tier's per-block columns (:class:`TierColumns`) and a view of one block's columns as an
object: its state, its pins and flags (:class:`Entry`).

The tier (:mod:`kvtier.manager.index.tier_index`) stores blocks column-wise, with no per-block Python
object; :class:`Entry` views are made on demand (stats, resyncs, the rarer manager paths, tests)
and die with the block. The columns and their codes live here, below both the index and its
walks (:mod:`kvtier.manager.index.tier_walks`), so that every reader sees the same values and none
of them imports another.
"""

from __future__ import annotations

from array import array
from enum import Enum


class BlockState(Enum):
    WRITING = "writing"  # bytes are being written (store, promotion or flush); not readable
    READY = "ready"


FREE, WRITING, READY = 0, 1, 2  # values of the state column
STATES = (None, BlockState.WRITING, BlockState.READY)  # column value -> state
CODES = {BlockState.WRITING: WRITING, BlockState.READY: READY}
FLUSHING, ON_DISK, FLUSH_FAILED, PROMOTED = 1, 2, 4, 8


class TierColumns:
    """The per-handle columns of one tier of ``capacity`` blocks: ``state`` (FREE / WRITING /
    READY), ``flags`` (FLUSHING, ON_DISK, ...) and ``readers`` (pin counts). ``with_slots``:
    a handle is a CPU slot id the worker addresses (False: an internal number, disk tier).
    Hot loops bind the arrays to locals once per call; nothing here is per block."""

    __slots__ = ("state", "flags", "readers", "with_slots")

    def __init__(self, capacity: int, with_slots: bool) -> None:
        self.state = bytearray(capacity)
        self.flags = bytearray(capacity)
        self.readers = array("i", bytes(4 * capacity))
        self.with_slots = with_slots


def _flag(bit: int, doc: str) -> property:
    def get(self: "Entry") -> bool:
        return bool(self._cols.flags[self.handle] & bit)

    def put(self: "Entry", on: bool) -> None:
        flags = self._cols.flags
        flags[self.handle] = (flags[self.handle] | bit) if on else (flags[self.handle] & ~bit)

    return property(get, put, doc=doc)


class Entry:
    """View of one resident block's columns; valid until the block is removed."""

    __slots__ = ("_cols", "handle")

    def __init__(self, columns: TierColumns, handle: int) -> None:
        self._cols = columns
        self.handle = handle

    @property
    def slot(self) -> int:
        """CPU slot id; -1 on tiers addressed by key (disk)."""
        return self.handle if self._cols.with_slots else -1

    @property
    def state(self) -> BlockState:
        return STATES[self._cols.state[self.handle]]

    @state.setter
    def state(self, state: BlockState) -> None:
        self._cols.state[self.handle] = CODES[state]

    @property
    def readers(self) -> int:
        """In-flight loads reading this block (pins)."""
        return self._cols.readers[self.handle]

    @readers.setter
    def readers(self, n: int) -> None:
        self._cols.readers[self.handle] = n

    flushing = _flag(FLUSHING, "CPU only: a copy to disk is reading this slot (pin)")
    on_disk = _flag(ON_DISK, "CPU only: a READY copy also exists on disk (clean)")
    flush_failed = _flag(FLUSH_FAILED, "CPU only: the disk refused it; drop, don't retry")
    promoted = _flag(PROMOTED, "CPU only: WRITING because a load promotes it from disk")

    @property
    def pinned(self) -> bool:
        c, h = self._cols, self.handle
        return c.readers[h] > 0 or bool(c.flags[h] & FLUSHING) or c.state[h] != READY
