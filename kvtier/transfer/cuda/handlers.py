"""GPU <-> CPU transfer handlers for CUDA KV caches (the fast path of :mod:`cpu_copy`).

Both directions are :class:`ImmediateHandler`s: a hop is enqueued on the thread that submits
it (vLLM's engine thread), with no thread hop and no GIL hand-over on the way, and ordered on
the GPU, never by host syncs:

* ``start`` records a CUDA event on the caller's current stream (and, if different, on the
  compute stream given at construction) and the copy's streams wait for it. A store therefore
  never reads a page before the kernels enqueued before it wrote it (vLLM #45704), and a load
  never overwrites a page that earlier work still reads. The event belongs to the job.
* ``fence`` makes the caller's current stream wait for the job's last copy: a forward enqueued
  afterwards reads loaded pages (or overwrites stored ones) only once the copy is done, while
  the host goes on at once.
* ``fence_layer`` (loads copied layer by layer, :mod:`direct`): the same, for one layer's
  pages only, so a forward's layer waits for its own KV and not for the whole load.
* ``poll`` queries the job's completion event (never blocks); ``finish`` synchronises on it.
  Timing events give the copy's device time, which feeds the cost model.

One rule picks a load's path (figures: docs/design-measurements.md). With a pinned pool and
CuPy, a load of ``layered_min_bytes`` or more goes layer by layer straight from the pinned
slots; a smaller one goes whole (a layered enqueue costs the host a fixed amount per layer,
and a short copy gains the forward nothing), in one kernel launch with its arguments in
reusable pinned memory (:mod:`one_launch`). A load whose reader waits for all of it
(``LoadStoreSpec.whole``) also goes in one launch up to ``whole_max_bytes``: layer events buy
that forward nothing. Above it the layered copy wins: its DMAs start at the lookup
(:mod:`prefetch`), while the one launch must wait for the compute stream's earlier work. The
staging ring is the fallback: without a pinned pool or CuPy, or when no argument buffer is free.

Loads run on higher-priority streams than stores, and the two directions use separate
streams and staging rings, so both PCIe directions run at once. A slot whose pinned pool
chunk is still being allocated (right after start-up) makes the enqueue wait for that chunk.

A store's path is ``store_copy`` (``tiers.cpu.store_copy``): ``"kernel"`` gathers pages
through the staging ring as above; ``"dma"`` enqueues the whole job as one
``cuMemcpyBatchAsync`` on the copy engines, no SM work, on a stream at the compute stream's
(lowest) priority (:mod:`batch_copy`). It needs a pinned pool and a CUDA 12.8+ driver, and
falls back to the kernel otherwise (logged once). A serving A/B on a GPU decides the default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.config.schema import STORE_COPIES
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.batch_copy import (
    BatchCopier,
    batch_copy_available,
    batch_copy_unavailable_reason,
)
from kvtier.transfer.cuda.direct import DirectLayerLoader, LayeredJob, Prefetch
from kvtier.transfer.cuda.one_launch import PinnedArgRing
from kvtier.transfer.cuda.page_movers import cupy_available, make_page_mover
from kvtier.transfer.cuda.pipeline import (
    DEFAULT_RING_SLOTS,
    DEFAULT_STAGING_BYTES,
    EnqueuedJob,
    PagedCopier,
)
from kvtier.transfer.handlers import ImmediateHandler
from kvtier.transfer.jobs import TransferOutcome

log = logging.getLogger(__name__)


LAYERED_MIN_BYTES = 64 << 20  # smaller loads go whole (one launch, else staged)
WHOLE_ONE_LAUNCH_MAX_BYTES = 256 << 20  # whole loads (LoadStoreSpec.whole) up to it too
_told: set[str] = set()  # why store_copy="dma" fell back, logged once per reason


def dma_store_blocker(pool: CpuBlockPool) -> str | None:
    """Why stores cannot go as batched DMA (:mod:`batch_copy`) with ``pool``, or None."""
    if not pool.pin:
        return "the CPU pool is not pinned (tiers.cpu.pin)"
    if not batch_copy_available():
        return batch_copy_unavailable_reason()
    return None


@dataclass
class _Pending:
    job: EnqueuedJob | LayeredJob | None  # None: an empty hop


class _CudaHandler(ImmediateHandler):
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
        compute_stream: torch.cuda.Stream | None = None,
        layered_min_bytes: int = LAYERED_MIN_BYTES,
        whole_max_bytes: int = WHOLE_ONE_LAUNCH_MAX_BYTES,
        store_copy: str = "kernel",
    ) -> None:
        """``layered_min_bytes`` / ``whole_max_bytes``: the bounds of the load rule (module
        docstring); the defaults are the measured ones, tests narrow them to small caches.
        ``store_copy``: a store's path, ``"kernel"`` or ``"dma"`` (module docstring; a load
        handler ignores it)."""
        if view.device.type != "cuda":
            raise ValueError(f"{type(self).__name__} needs a CUDA KV view, got {view.device}")
        if store_copy not in STORE_COPIES:
            raise ValueError(f"store_copy must be one of {', '.join(STORE_COPIES)}, "
                             f"got {store_copy!r}")
        self.view = view
        self.pool = pool
        self.compute_stream = compute_stream or torch.cuda.current_stream(view.device)
        least, greatest = torch.cuda.Stream.priority_range()
        self.copier: PagedCopier | BatchCopier
        if not self.to_gpu and store_copy == "dma" and self._dma_stores(pool):
            # the copy engines only, queued like the compute stream's own work
            self.copier = BatchCopier(view, pool, to_gpu=False, priority=least)
        else:
            # lower number = higher priority; loads get the highest, stores the next one
            priority = greatest if self.to_gpu else min(least, greatest + 1)
            self.copier = PagedCopier(
                view, pool, make_page_mover(view, backend, max_ctas=max_ctas),
                to_gpu=self.to_gpu, staging_bytes=staging_bytes, ring_slots=ring_slots,
                priority=priority,
            )
        self.direct: DirectLayerLoader | None = None
        if self.to_gpu and pool.pin and backend != "torch" and cupy_available():
            try:
                self.direct = self._layered(max_ctas)
            except Exception as exc:  # noqa: BLE001 - the staged path is always there
                log.warning("kvtier: layer-by-layer loads unavailable (%s); loads are staged", exc)
        self.layered_min_bytes = layered_min_bytes
        # loads the layered path does not take, in one launch (one_launch.py), else staged
        self._args = PinnedArgRing() if self.direct is not None else None
        # whole loads (LoadStoreSpec.whole) up to it: one launch
        self.whole_max_bytes = float(whole_max_bytes) if self._args is not None else 0.0
        self._prefetch: Prefetch | None = None
        self.prefetches = {"used": 0, "dropped": 0}  # what became of prefetch hints
        if self.direct is not None and self.direct.can_prefetch:
            self.prefetch_min_bytes = max(1, self.layered_min_bytes)

    @staticmethod
    def _dma_stores(pool: CpuBlockPool) -> bool:
        why = dma_store_blocker(pool)
        if why is not None and why not in _told:
            _told.add(why)
            log.warning("kvtier: store_copy=dma unavailable (%s); stores use the copy kernel",
                        why)
        return why is None

    def prefetch(self, src: LoadStoreSpec, whole: bool = False) -> bool:
        """A load's first pieces into the staging ring now (:mod:`prefetch`), if it will be
        copied layer by layer (a whole load in one launch would only drop them)."""
        self.drop_prefetch()
        if self.prefetch_min_bytes is None or src.medium != Medium.CPU:
            return False
        slots = list(src.ids)
        if not self._layered_copy(len(slots), whole):
            return False
        self._prefetch = self.direct.prefetch(slots)
        return self._prefetch is not None

    def drop_prefetch(self) -> None:
        p, self._prefetch = self._prefetch, None
        if p is not None:
            self.direct.drop(p)
            self.prefetches["dropped"] += 1

    def _layered(self, max_ctas: int | None) -> DirectLayerLoader:
        """Layer-by-layer loads on the copier's own streams and staging ring (a handler uses
        one of the two for all its loads, so they never share a buffer at once)."""
        c = self.copier
        return DirectLayerLoader(self.view, self.pool, c.ring, c.kernel_stream, c.dma_stream,
                                 max_ctas=max_ctas)

    def _layered_copy(self, blocks: int, whole: bool) -> bool:
        """Whether a load of ``blocks`` goes layer by layer (``direct``)."""
        nbytes = blocks * self.pool.geometry.block_bytes
        return (self.direct is not None and nbytes >= self.layered_min_bytes
                and not (whole and nbytes <= self.whole_max_bytes))

    def _addresses(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[list[int], list[int]]:
        gpu, cpu = (dst, src) if self.to_gpu else (src, dst)
        return list(gpu.ids), list(cpu.ids)

    def start(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> _Pending:
        self.check_media(src, dst)
        ids, slots = self._addresses(src, dst)
        if not slots and not ids:
            return _Pending(None)
        layered = self._layered_copy(len(slots), dst.whole if self.to_gpu else False)
        current = torch.cuda.current_stream(self.view.device)
        waits = [torch.cuda.Event()]
        waits[0].record(current)
        if self.compute_stream != current:
            waits.append(torch.cuda.Event())
            waits[1].record(self.compute_stream)
        if not layered and self._args is not None:
            job = self.direct.enqueue_whole(ids, slots, waits, self._args)
            if job is not None:  # another load came: the prefetch's guess was wrong
                self.drop_prefetch()
                return _Pending(job)
        if layered:
            p, self._prefetch = self._prefetch, None  # the job uses it or drops it
            try:
                job = self.direct.enqueue(ids, slots, waits, prefetch=p)
            except Exception:
                if p is not None and not p.settled:
                    self.direct.drop(p)
                raise
            if p is not None:
                self.prefetches["used" if job.head is not None else "dropped"] += 1
            return _Pending(job)
        self.drop_prefetch()  # a staged job takes ring buffers the prefetch holds
        return _Pending(self.copier.enqueue(ids, slots, waits))

    def poll(self, pending: _Pending) -> TransferOutcome | None:
        job = pending.job
        if job is None:
            return TransferOutcome(bytes=0, seconds=0.0)
        if not job.done.query():
            return None
        return TransferOutcome(bytes=job.nbytes, seconds=job.seconds())

    def fence(self, pending: _Pending) -> None:
        if pending.job is not None:
            torch.cuda.current_stream(self.view.device).wait_event(pending.job.done)

    def fence_layer(self, pending: _Pending, layer: int) -> None:
        job = pending.job
        if isinstance(job, LayeredJob) and 0 <= layer < len(job.layer_done):
            torch.cuda.current_stream(self.view.device).wait_event(job.layer_done[layer])
        else:
            self.fence(pending)

    def finish(self, pending: _Pending) -> TransferOutcome:
        if pending.job is not None:
            pending.job.done.synchronize()
        out = self.poll(pending)
        assert out is not None
        return out


class CudaGpuToCpuHandler(_CudaHandler):
    """Store: scattered engine pages -> pinned CPU pool slots (gather kernel + DMA, or batched
    DMA alone with ``store_copy="dma"``)."""

    direction = (Medium.GPU, Medium.CPU)
    to_gpu = False


class CudaCpuToGpuHandler(_CudaHandler):
    """Load: pinned CPU pool slots -> scattered engine pages (DMA + scatter kernel)."""

    direction = (Medium.CPU, Medium.GPU)
    to_gpu = True
