"""The CPU tier's memory: a pool of fixed-size slots, pinned when CUDA is present.

Pinning a large pool (hundreds of GiB) takes minutes (vLLM #42632), so the pool is made of
chunks allocated by a background thread, lowest slots first. Start-up returns after the first
chunk; a copy into a slot whose chunk is not ready yet waits for that chunk (on the thread that
runs the copy), and the log reports allocation progress. The manager hands out the lowest
free slot ids first, so early traffic lands in the first chunks.

Page-locking a chunk (``cudaHostAlloc``, or ``cudaHostRegister`` for the shared pool) holds
up the process's other CUDA calls for as long as it touches the chunk's pages: vLLM's own
start-up work (profiling, warm-up, CUDA graph capture, which come right after the connector's
``register_kv_caches``) would wait for nearly the whole pinning. So ``fill="on_start"``
allocates only the first chunk at construction and leaves the rest until
``start_filling()``, which the vLLM worker calls once vLLM's start-up is over; anything that
needs a chunk before then (a copy, ``slot_addresses``, ``wait_ready``) starts the filling
itself, so nothing waits for a signal that never comes. The worker then waits for the filling
(up to ``tiers.cpu.pin_wait_s``) before vLLM serves: pinning while it serves holds up the
engine's CUDA calls just the same, and a fresh server's first request waited seconds for it.
Chunks are small
(``DEFAULT_CHUNK_BYTES``) because each one is a single page-locking call, the longest stretch
the filling holds the driver at a time while the engine serves. ``fill="now"`` (the default:
kvtier bench, tests) starts the filling at construction.

With ``shared=True`` the pool's memory is one ``memfd`` mapped shared, so the disk I/O
process (kvtier.tiers.disk.io.process) can map the very same bytes and move them to and from
disk without a copy and without this process's GIL; pinning then registers each chunk with
CUDA (``cudaHostRegister``) instead of allocating pinned memory. Each chunk is its own
allocation or registration, so a copy never spans two chunks (``group_by_chunk``, and the
CUDA copy paths' runs of neighbouring slots, split at chunk boundaries).

This module owns bytes only. Which slot holds which block is the manager's business; the
slot lifecycle (free -> writing -> ready -> loading) lives there too.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from typing import Sequence

import numpy as np
import torch

from kvtier.tiers.layout import BlockGeometry

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 20  # one page-locking call each (module docstring)
FILL_MODES = ("now", "on_start")


class CpuBlockPool:
    def __init__(
        self,
        geometry: BlockGeometry,
        num_slots: int,
        *,
        pin: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        background: bool = True,
        shared: bool = False,
        fill: str = "now",
        pool_fd: int | None = None,
    ) -> None:
        """``background``: chunks after the first are allocated by a thread (False: all of
        them here). ``fill``: when that thread starts: ``"now"``, or ``"on_start"`` at
        ``start_filling()`` or the first need of a chunk not allocated yet (module docstring).
        ``pool_fd``: the memory to map instead of a new ``memfd`` (shared; this pool owns the
        descriptor from now on): the host tier's pool, which its service created."""
        if num_slots <= 0:
            raise ValueError(f"CPU pool needs at least one slot, got {num_slots}")
        if fill not in FILL_MODES:
            raise ValueError(f"CPU pool fill must be one of {FILL_MODES}, got {fill!r}")
        if fill == "on_start" and not background:
            raise ValueError("CPU pool fill='on_start' needs background=True (background=False "
                             "allocates every chunk in the constructor)")
        self.geometry = geometry
        self.num_slots = num_slots
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.slots_per_chunk = max(1, chunk_bytes // geometry.block_bytes)
        self.shared_fd: int | None = None  # the memfd another process maps (shared=True)
        self._map: mmap.mmap | None = None
        if pool_fd is not None:
            size = os.fstat(pool_fd).st_size
            if size < self.capacity_bytes:
                os.close(pool_fd)
                raise ValueError(f"the CPU pool's memory holds {size} bytes, {num_slots} slots "
                                 f"need {self.capacity_bytes}")
            shared, self.shared_fd = True, pool_fd
        elif shared:
            self.shared_fd = os.memfd_create("kvtier-cpu-pool", os.MFD_CLOEXEC)
            os.ftruncate(self.shared_fd, self.capacity_bytes)  # pages come on first touch
        if shared:
            self._map = mmap.mmap(self.shared_fd, self.capacity_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            # a registration outlives its mapping unless undone: a later pool mapped at the
            # same address would then fail with cudaErrorHostMemoryAlreadyRegistered
            self._registered: list[int] = []
            weakref.finalize(self, _unregister_pinned, self._registered)
            # the memfd holds the memory for as long as it is open, mapped or not: a process
            # that builds pools one after another would otherwise keep every one of them
            weakref.finalize(self, _close_fd, self.shared_fd)
        n_chunks = -(-num_slots // self.slots_per_chunk)
        self._chunks: list[torch.Tensor | None] = [None] * n_chunks
        self._bases = np.zeros(n_chunks, dtype=np.int64)  # chunk addresses (slot_addresses)
        self._ready = [threading.Event() for _ in range(n_chunks)]
        self._error: BaseException | None = None
        self.allocated_bytes = 0
        self._thread: threading.Thread | None = None
        self._fill_lock = threading.Lock()
        if background and n_chunks > 1:
            self._allocate_chunk(0)
            if fill == "now":
                self.start_filling()
        else:
            for i in range(n_chunks):
                self._allocate_chunk(i)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.geometry.block_bytes

    def _chunk_slots(self, index: int) -> int:
        return min(self.slots_per_chunk, self.num_slots - index * self.slots_per_chunk)

    def _allocate_chunk(self, index: int) -> None:
        n = self._chunk_slots(index)
        bb = self.geometry.block_bytes
        if self._map is None:
            t = torch.empty((n, bb), dtype=torch.uint8, pin_memory=self.pin)
        else:
            t = torch.frombuffer(self._map, dtype=torch.uint8, count=n * bb,
                                 offset=index * self.slots_per_chunk * bb).view(n, bb)
            if self.pin:
                _register_pinned(t)
                self._registered.append(t.data_ptr())
        self._chunks[index] = t
        self.allocated_bytes += t.numel()
        self._ready[index].set()

    @property
    def filling(self) -> bool:
        """Whether the chunks after the first are allocated or being allocated."""
        return self._thread is not None or self._ready[-1].is_set()

    def start_filling(self, why: str = "") -> bool:
        """Start allocating the chunks after the first in the background; True if this call
        started it (later calls, and a pool already complete, do nothing). Thread-safe."""
        with self._fill_lock:
            if self.filling:
                return False
            if why:
                log.info("kvtier CPU pool: allocating %.1f GiB%s in the background (%s)",
                         (self.capacity_bytes - self.allocated_bytes) / 2**30,
                         ", pinned" if self.pin else "", why)
            self._thread = threading.Thread(
                target=self._allocate_rest, name="kvtier-cpu-pool-alloc", daemon=True
            )
            self._thread.start()
            return True

    def _allocate_rest(self) -> None:
        start = time.monotonic()
        total = len(self._chunks)
        try:
            for i in range(1, total):
                self._allocate_chunk(i)
                if i % 16 == 0 or i == total - 1:
                    log.info(
                        "kvtier CPU pool: %d/%d chunks (%.1f GiB%s) after %.1fs",
                        i + 1, total, self.allocated_bytes / 2**30,
                        ", pinned" if self.pin else "", time.monotonic() - start,
                    )
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            self._error = exc
            log.error("kvtier CPU pool allocation failed: %s", exc)
            for ev in self._ready:
                ev.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every chunk is allocated (tests and benchmarks); starts the filling if
        it has not started."""
        self.start_filling("wait_ready")
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in self._ready:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ev.wait(left):
                return False
        if self._error:
            raise RuntimeError("CPU pool allocation failed") from self._error
        return True

    def _chunk(self, index: int) -> torch.Tensor:
        ready = self._ready[index]
        if not ready.is_set():
            self.start_filling("a copy needs a chunk not allocated yet")  # no signal to wait for
            ready.wait()
        chunk = self._chunks[index]
        if chunk is None:
            raise RuntimeError("CPU pool allocation failed") from self._error
        return chunk

    def slot(self, slot: int) -> torch.Tensor:
        """Flat uint8 bytes of one slot (a view, no copy)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        c, i = divmod(slot, self.slots_per_chunk)
        return self._chunk(c)[i]

    def slot_addresses(self, slots: Sequence[int]) -> np.ndarray:
        """Host address of each slot (int64, in order), for kernels that read pinned slots
        through their UVA addresses. Vectorised and without tensor views: it runs on vLLM's
        engine thread before a load's launch (``pool.slot(s).data_ptr()`` per slot, or a
        tensor per run, cost more host time than a one-block load's copy). Waits for a chunk still being
        allocated."""
        s = np.asarray(slots, dtype=np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots):
            bad = s[(s < 0) | (s >= self.num_slots)]
            raise IndexError(f"slots {bad[:8].tolist()} out of range [0, {self.num_slots})")
        chunk = s // self.slots_per_chunk
        base = self._bases[chunk]
        if s.size and not base.all():  # first use of a chunk: look its address up once
            for c in np.unique(chunk[base == 0]).tolist():
                self._bases[c] = self._chunk(c).data_ptr()
            base = self._bases[chunk]
        return base + (s - chunk * self.slots_per_chunk) * self.geometry.block_bytes

    def slot_view(self, slot: int) -> torch.Tensor:
        """One slot as ``[layer, kv_part, engine_block, page_bytes]``."""
        return self.slot(slot).view(self.geometry.slot_shape)

    def group_by_chunk(self, slots: list[int]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """Split slot ids by chunk: ``(chunk tensor, positions in ``slots``, rows in chunk)``."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for pos, s in enumerate(slots):
            if not 0 <= s < self.num_slots:
                raise IndexError(f"slot {s} out of range [0, {self.num_slots})")
            c, i = divmod(s, self.slots_per_chunk)
            g = groups.setdefault(c, ([], []))
            g[0].append(pos)
            g[1].append(i)
        return [(self._chunk(c), pos, rows) for c, (pos, rows) in sorted(groups.items())]


def _register_pinned(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory for CUDA DMA, mapped for kernels (UVA reads of host slots)."""
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), flags)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel()} bytes of the shared CPU pool "
                           f"failed (CUDA error {code})")


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unregister_pinned(pointers: list[int]) -> None:
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    pointers.clear()
