"""GPU <-> CPU transfer handlers for CUDA KV caches (the fast path of :mod:`cpu_copy`).

Stream discipline, the part that keeps bytes right:

* A store must not read a page before the model's kernels that write it have run. The engine
  calls :meth:`on_submit` on the submitting (engine) thread, which records a CUDA event on that
  thread's current stream; the copy's kernel stream waits for that event on the GPU. A store
  whose submit was not seen falls back to an event recorded, when it runs, on the compute
  stream given at construction (the stream current when the handler was built): later than
  needed, never too early.
* A load is reported complete only once its last copy has finished: the asyncio worker polls
  the job's CUDA event (``query``, with short ``asyncio.sleep`` backoff); nothing blocks the
  event loop or the engine thread. A load waits for a submit-time event only when one exists.
* Loads run on higher-priority streams than stores, and the two directions use separate
  streams and staging rings, so both PCIe directions run at once.

Enqueueing (address tables, CUDA calls that may block when the launch queue is full, waiting
for a pinned pool chunk still being allocated) runs on the handler's own thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque

import torch

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.page_movers import make_page_mover
from kvtier.transfer.cuda.pipeline import (
    DEFAULT_RING_SLOTS,
    DEFAULT_STAGING_BYTES,
    EnqueuedJob,
    PagedCopier,
)
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome

_MIN_POLL_S = 20e-6
_MAX_POLL_S = 2e-4


async def wait_cuda_event(event: torch.cuda.Event) -> None:
    """Await a CUDA event without blocking the loop (exponential backoff, 20 us .. 200 us)."""
    delay = _MIN_POLL_S
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)


class _CudaHandler(TransferHandler):
    to_gpu: bool = False

    def __init__(
        self,
        view: GpuKvView,
        pool: CpuBlockPool,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        ring_slots: int = DEFAULT_RING_SLOTS,
        backend: str = "auto",
        max_ctas: int | None = None,
        concurrency: int = 4,
        compute_stream: torch.cuda.Stream | None = None,
    ) -> None:
        if view.device.type != "cuda":
            raise ValueError(f"{type(self).__name__} needs a CUDA KV view, got {view.device}")
        self.view = view
        self.pool = pool
        self.concurrency = concurrency
        self.compute_stream = compute_stream or torch.cuda.current_stream(view.device)
        least, greatest = torch.cuda.Stream.priority_range()
        # lower number = higher priority; loads get the highest, stores the next one
        priority = greatest if self.to_gpu else min(least, greatest + 1)
        self.copier = PagedCopier(
            view, pool, make_page_mover(view, backend, max_ctas=max_ctas), to_gpu=self.to_gpu,
            staging_bytes=staging_bytes, ring_slots=ring_slots, priority=priority,
        )
        self._submitted: dict[tuple[LoadStoreSpec, LoadStoreSpec], deque[torch.cuda.Event]] = (
            defaultdict(deque)
        )
        self._submit_lock = threading.Lock()

    # -- caller thread ------------------------------------------------------------------------

    def on_submit(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Capture the submitting thread's compute stream position for this hop."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.view.device))
        with self._submit_lock:
            self._submitted[(src, dst)].append(event)

    def _take_submit_event(self, src: LoadStoreSpec, dst: LoadStoreSpec
                           ) -> torch.cuda.Event | None:
        with self._submit_lock:
            q = self._submitted.get((src, dst))
            if not q:
                return None
            event = q.popleft()
            if not q:
                del self._submitted[(src, dst)]
            return event

    # -- event loop ----------------------------------------------------------------------------

    def _addresses(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[list[int], list[int]]:
        gpu, cpu = (dst, src) if self.to_gpu else (src, dst)
        return list(gpu.ids), list(cpu.ids)

    def _enqueue(self, ids: list[int], slots: list[int], wait: torch.cuda.Event | None
                 ) -> EnqueuedJob:
        if wait is None and not self.to_gpu:
            wait = torch.cuda.Event()
            wait.record(self.compute_stream)
        return self.copier.enqueue(ids, slots, wait)

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        wait = self._take_submit_event(src, dst)
        ids, slots = self._addresses(src, dst)
        if not slots and not ids:
            return TransferOutcome(bytes=0)
        enqueued = asyncio.ensure_future(self.run_blocking(self._enqueue, ids, slots, wait))
        try:
            job = await asyncio.shield(enqueued)
            await wait_cuda_event(job.done)
        except asyncio.CancelledError:
            # Copies already handed to the GPU keep running: report the cancellation only once
            # they stopped touching the slots and pages, which the caller may then reuse.
            job = await enqueued
            await wait_cuda_event(job.done)
            raise
        return TransferOutcome(bytes=job.nbytes)


class CudaGpuToCpuHandler(_CudaHandler):
    """Store: scattered engine pages -> pinned CPU pool slots (gather kernel + DMA)."""

    direction = (Medium.GPU, Medium.CPU)
    to_gpu = False


class CudaCpuToGpuHandler(_CudaHandler):
    """Load: pinned CPU pool slots -> scattered engine pages (DMA + scatter kernel)."""

    direction = (Medium.CPU, Medium.GPU)
    to_gpu = True
