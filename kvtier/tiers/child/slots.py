"""The worker's CPU pool as an I/O child maps it: the memfd the worker passed, one slot per block."""

from __future__ import annotations

import mmap


class MappedSlots:
    """The worker's CPU pool, mapped from its memfd: slot ``i`` is bytes [i*B, (i+1)*B)."""

    def __init__(self, fd: int, num_slots: int, block_bytes: int, populate: bool = False) -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        # populate: the page tables are filled once at start-up (seconds for a large pool),
        # not by a fault per 4 KiB page the first time each slot is touched; for a child whose
        # start nobody waits for, on a path where a fresh hit lands in fresh slots
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._map = mmap.mmap(fd, num_slots * block_bytes, flags,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)

    def buffer(self, slot: int) -> memoryview:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"CPU slot {slot} out of range [0, {self.num_slots})")
        return self._view[slot * self.block_bytes:(slot + 1) * self.block_bytes]
