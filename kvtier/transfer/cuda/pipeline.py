"""One direction of the CUDA copy path: staging ring, two streams, chunked pipeline.

A job is cut into chunks of at most one staging buffer. For a store (GPU -> CPU) each chunk is
gathered by a kernel on the *kernel stream*, then DMA'd to the pinned slots on the *DMA stream*;
a load (CPU -> GPU) runs the other way round (DMA into staging, scatter kernel). With a ring of
several staging buffers, chunk i's DMA overlaps chunk i+1's kernel; CUDA events between the two
streams carry every dependency, so the whole job is enqueued without waiting on the host and
the copy engines stay busy back to back.

Enqueueing of one direction is serialised by a lock, so the ring's events are always recorded
and waited in job order even when several transfer threads submit. Nothing here blocks on the GPU; the caller
learns completion by querying the returned event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.page_movers import PageMover
from kvtier.transfer.cuda.plan import Segment, host_runs, segments_for_range, validate_job

DEFAULT_STAGING_BYTES = 32 << 20
DEFAULT_RING_SLOTS = 4


class StagingRing:
    """``slots`` device buffers, each with a *filled* and a *freed* event."""

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        if slots < 2:
            raise ValueError("a staging ring needs at least 2 buffers to overlap copies")
        self.slot_bytes = slot_bytes
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device)
                        for _ in range(slots)]
        self.filled = [torch.cuda.Event() for _ in range(slots)]
        self.freed = [torch.cuda.Event() for _ in range(slots)]
        self._next = 0

    def take(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        return i


DmaFn = Callable[[Segment, torch.Tensor, torch.cuda.Stream, bool], None]


def _dma_function() -> DmaFn:
    """One DMA request between a staging buffer and pinned host memory, enqueued on a stream:
    cudaMemcpyAsync through CuPy's runtime binding (~2 us a call), else torch ``copy_``."""
    try:
        import cupy

        memcpy = cupy.cuda.runtime.memcpyAsync
        kind = cupy.cuda.runtime.memcpyDefault

        def dma(seg: Segment, stage: torch.Tensor, stream: torch.cuda.Stream,
                to_host: bool) -> None:
            dev = stage.data_ptr() + seg.stage_offset
            host = seg.host_ptr()
            if to_host:
                memcpy(host, dev, seg.nbytes, kind, stream.cuda_stream)
            else:
                memcpy(dev, host, seg.nbytes, kind, stream.cuda_stream)

    except Exception:  # noqa: BLE001 - CuPy missing or broken: torch path

        def dma(seg: Segment, stage: torch.Tensor, stream: torch.cuda.Stream,
                to_host: bool) -> None:
            host = seg.chunk[seg.chunk_offset: seg.chunk_offset + seg.nbytes]
            dev = stage[seg.stage_offset: seg.stage_offset + seg.nbytes]
            with torch.cuda.stream(stream):
                if to_host:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)

    return dma


@dataclass
class EnqueuedJob:
    """What a caller polls, and what must stay alive until ``done`` has fired."""

    done: torch.cuda.Event
    nbytes: int
    started: torch.cuda.Event  # timing pair with ``done``: the copy's device time
    keepalive: list[Any] = field(default_factory=list)
    gate: torch.cuda.Event | None = None  # the waits met (a load's pages may be written)
    head: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # its prefetched DMAs

    def seconds(self) -> float:
        """The copy's device time: from when it began *and* its waits were met (a load
        queued behind a long forward would otherwise teach the cost model a bandwidth of a
        few GB/s, and cost-aware loading would then skip CPU hits as slower than
        recomputing them) to ``done``. A prefetched head ran before the gate: its own DMA
        time is added to what followed the gate."""
        ms = self.started.elapsed_time(self.done)
        if self.gate is not None:
            after = self.gate.elapsed_time(self.done)
            if self.head is not None:
                after += self.head[0].elapsed_time(self.head[1])
            ms = min(ms, after)
        return ms / 1e3


class PagedCopier:
    """Enqueues jobs of one direction; ``to_gpu`` False = store (GPU -> CPU), True = load."""

    def __init__(
        self,
        view: GpuKvView,
        pool: CpuBlockPool,
        mover: PageMover,
        *,
        to_gpu: bool,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        ring_slots: int = DEFAULT_RING_SLOTS,
        priority: int = 0,
    ) -> None:
        if view.device.type != "cuda":
            raise ValueError(f"the CUDA transfer path needs KV tensors on CUDA, got {view.device}")
        self.view = view
        self.pool = pool
        self.mover = mover
        self.to_gpu = to_gpu
        self.device = view.device
        page = view.page_bytes
        self.pages_per_chunk = max(1, staging_bytes // page)
        with torch.cuda.device(self.device):
            self.ring = StagingRing(self.device, self.pages_per_chunk * page, ring_slots)
            self.kernel_stream = torch.cuda.Stream(self.device, priority=priority)
            self.dma_stream = torch.cuda.Stream(self.device, priority=priority)
        self._dma = _dma_function()
        self._lock = threading.Lock()

    def enqueue(self, engine_ids: Sequence[int], slots: Sequence[int],
                waits: Sequence[torch.cuda.Event] = ()) -> EnqueuedJob:
        """Enqueue one job; every event in ``waits`` fires before any KV page is touched."""
        per = validate_job(self.view, self.pool, engine_ids, slots, to_gpu=self.to_gpu)
        page = self.view.page_bytes
        total_pages = len(slots) * self.pool.geometry.block_bytes // page
        nbytes = total_pages * page
        with self._lock, torch.cuda.device(self.device):
            for wait in waits:  # the kernel stream is the only one touching KV pages
                self.kernel_stream.wait_event(wait)
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.dma_stream if self.to_gpu else self.kernel_stream)
            gate = None  # a store starts on the kernel stream after its waits already
            if self.to_gpu:  # a load's DMA runs ahead: its pages wait on the kernel stream
                gate = torch.cuda.Event(enable_timing=True)
                gate.record(self.kernel_stream)
            job = self.mover.prepare(np.asarray(engine_ids, dtype=np.int64), per,
                                     self.kernel_stream)
            runs = host_runs(self.pool, slots)
            run_index = 0
            for p0 in range(0, total_pages, self.pages_per_chunk):
                p1 = min(total_pages, p0 + self.pages_per_chunk)
                i = self.ring.take()
                segs, run_index = segments_for_range(runs, p0 * page, p1 * page, run_index)
                if self.to_gpu:
                    self._load_chunk(job, i, p0, p1, segs)
                else:
                    self._store_chunk(job, i, p0, p1, segs)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.kernel_stream if self.to_gpu else self.dma_stream)
        return EnqueuedJob(done=done, nbytes=nbytes, started=started, keepalive=[job, runs],
                           gate=gate)

    def _store_chunk(self, job: Any, i: int, p0: int, p1: int, segs: list[Segment]) -> None:
        buf = self.ring.buffers[i]
        self.kernel_stream.wait_event(self.ring.freed[i])
        self.mover.gather(job, p0, p1, buf, self.kernel_stream)
        self.ring.filled[i].record(self.kernel_stream)
        self.dma_stream.wait_event(self.ring.filled[i])
        for s in segs:
            self._dma(s, buf, self.dma_stream, True)
        self.ring.freed[i].record(self.dma_stream)

    def _load_chunk(self, job: Any, i: int, p0: int, p1: int, segs: list[Segment]) -> None:
        buf = self.ring.buffers[i]
        self.dma_stream.wait_event(self.ring.freed[i])
        for s in segs:
            self._dma(s, buf, self.dma_stream, False)
        self.ring.filled[i].record(self.dma_stream)
        self.kernel_stream.wait_event(self.ring.filled[i])
        self.mover.scatter(job, p0, p1, buf, self.kernel_stream)
        self.ring.freed[i].record(self.kernel_stream)
