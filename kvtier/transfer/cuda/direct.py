"""Layer-by-layer loads straight from pinned CPU slots into the engine's pages.

Why: a CPU hit of a long prompt costs the copy plus the forward of the few tokens left to
compute. The staged path (:mod:`pipeline`) moves a job in slot order (every layer of a block
together), so no layer is complete before the whole job is. Here a job is copied *layer by
layer*, one kernel launch per layer, each followed by an event: layer ``l``'s attention waits
(on the GPU, through ``wait_for_layer_load``) only for layer ``l``'s pages, so the forward's
first layers run while later layers are still on the wire.

How: a layer's bytes of a slot are one contiguous run (the slot layout of
:mod:`kvtier.tiers.layout`), so a layer of a run of neighbouring slots is one *strided* copy
(row = that run, pitch = the slot size): one cudaMemcpy2DAsync per (layer, chunk, run of
slots) into a staging buffer, then a kernel scatters the chunk into the engine's pages. That
keeps the copy engines' full rate, where one DMA request per (slot, layer) piece would be
thousands of small requests. Without CuPy's 2-D copy, the kernel reads the pinned slots
through their unified (UVA) addresses instead (no staging; somewhat slower than the DMA)."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.page_movers import _THREADS, _UNROLL, compile_kernel, default_max_ctas
from kvtier.transfer.cuda.one_launch import PinnedArgRing
from kvtier.transfer.cuda.pipeline import EnqueuedJob
from kvtier.transfer.cuda.plan import LayerAddressing, host_runs, validate_job

_KERNEL_SRC = r"""
typedef VEC_T vec_t;
// Copies, for layers [first_layer, first_layer + n_layers) of a job's n_blocks blocks, every
// page between its pinned CPU slot (read or written through its UVA address) and the engine.
extern "C" __global__ void __launch_bounds__(THREADS)
kvtier_pages_direct(const long long* __restrict__ layer_base,
                    const long long* __restrict__ part_stride,
                    const long long* __restrict__ block_stride,
                    const long long* __restrict__ ids, const long long* __restrict__ slot_ptr,
                    long long stage, int first_layer, int n_layers, long long n_blocks,
                    int kv_parts, int per_block, long long page_bytes, long long page_vecs,
                    long long tiles_per_page, int to_host)
{
    const long long per_layer = (long long)kv_parts * per_block;  // pages of one block, layer
    const long long layer_pages = n_blocks * per_layer;
    const long long n_tiles = layer_pages * n_layers * tiles_per_page;
    for (long long t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const long long p = t / tiles_per_page;
        const long long lr = p / layer_pages;
        long long r = p - lr * layer_pages;
        const long long b = r / per_layer;
        r -= b * per_layer;
        const long long k = r / per_block;
        const long long e = r - k * per_block;
        const long long l = first_layer + lr;
        vec_t* dev = reinterpret_cast<vec_t*>(layer_base[l] + k * part_stride[l]
                                              + ids[b * per_block + e] * block_stride[l]);
        // stage != 0: one layer of n_blocks blocks packed in a staging buffer (layer-local
        // page order); else the slots themselves, read through their UVA addresses
        vec_t* host = reinterpret_cast<vec_t*>(stage
            ? stage + ((b * kv_parts + k) * per_block + e) * page_bytes
            : slot_ptr[b] + ((l * kv_parts + k) * per_block + e) * page_bytes);
        const vec_t* src = to_host ? dev : host;
        vec_t* dst = to_host ? host : dev;
        const long long first = (t - p * tiles_per_page) * (long long)(THREADS * UNROLL);
        vec_t buf[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long v = first + threadIdx.x + u * THREADS;
            if (v < page_vecs) buf[u] = src[v];
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long v = first + threadIdx.x + u * THREADS;
            if (v < page_vecs) dst[v] = buf[u];
        }
    }
}
"""


@dataclass
class Prefetch:
    """A load's first pieces copied into the staging ring before its engine blocks are known.

    Why: a CPU hit's copy can start only once the scheduler has allocated the request's engine
    blocks and planned the load (``update_state_after_alloc``), milliseconds after the lookup for
    a long prompt (docs/design-measurements.md). The host -> staging half of a layered load
    (this module) needs only the CPU slots, which the lookup already knows. So the scheduler
    names the slots at the lookup and the first pieces (as many as the ring has buffers) are on
    the wire while vLLM allocates; the load, once planned, scatters them and copies the rest.

    Safety: the prefetch only *reads* pinned slots into staging buffers that nothing else uses
    until it is consumed or dropped. The load consumes it only if its slots are exactly the
    prefetched ones, in the same scheduler pass (the scheduler drops an unconsumed prefetch before
    anything else can reassign a slot: READY slots are never rewritten before eviction, and nothing
    evicts between a lookup and its own plan). Anything else given to the handler first drops it,
    so the ring's buffers are always taken and freed in order.

    ``runs``: the slots' runs of neighbours, as the load needs them; ``pieces``: ((layer,
    first block, end block), ring buffer index) in copy order;
    ``started`` / ``done``: timing events around the prefetched DMAs (the DMA stream);
    ``settled``: a load consumed it or its buffers were given back (exactly one of the two).
    """

    slots: tuple[int, ...]
    runs: list[tuple[int, int, int]]  # the slots' runs (DirectLayerLoader._runs): reused
    pieces: tuple[tuple[tuple[int, int, int], int], ...]
    started: torch.cuda.Event
    done: torch.cuda.Event
    settled: bool = False

    def matches(self, slots: Sequence[int]) -> bool:
        return len(slots) == len(self.slots) and tuple(slots) == self.slots


@dataclass
class LayeredJob(EnqueuedJob):
    """A load enqueued layer by layer: ``layer_done[l]`` fires once layer ``l`` is in place,
    ``done`` once all are. Everything in ``keepalive`` lives until ``done`` fired."""

    layer_done: list[torch.cuda.Event] = field(default_factory=list)
    uva: bool = False  # read through UVA addresses (no copy2d, or slots scattered)


MIN_AVG_RUN = 16  # blocks per run of neighbouring slots below which a job reads through UVA


def scattered(runs: int, blocks: int) -> bool:
    """Whether a job's slots are too scattered for one strided DMA per (layer, run): each DMA
    request costs the host longer to enqueue than a block's layer takes to cross PCIe
    (docs/design-measurements.md), while the kernel reading the slots through their UVA
    addresses is one launch per layer whatever the runs, a little slower than the DMA on long
    runs."""
    return runs > max(4, blocks // MIN_AVG_RUN)


def _memcpy2d() -> Any:
    """CuPy's cudaMemcpy2DAsync binding, or None (then the kernel reads the slots itself)."""
    try:
        import cupy

        return cupy.cuda.runtime.memcpy2DAsync, cupy.cuda.runtime.memcpyDefault
    except Exception:  # noqa: BLE001 - old CuPy: UVA reads
        return None


class DirectLayerLoader:
    """CPU slots -> engine pages, layer by layer, on the copier's streams and staging ring.

    With CuPy's 2-D copy (the default) each (layer, chunk of blocks) is one strided DMA per
    run of neighbouring slots (row = the layer's bytes of one slot, pitch = the slot size)
    into a staging buffer, then one kernel scatters it into the pages: the copy engines keep
    their full PCIe rate (UVA reads by the SMs are a little slower) and the DMA of
    chunk i + 1 overlaps the scatter of chunk i. Without it the kernel reads the pinned slots
    through their UVA addresses, no staging.
    """

    def __init__(self, view: GpuKvView, pool: CpuBlockPool, ring: Any,
                 kernel_stream: torch.cuda.Stream, dma_stream: torch.cuda.Stream, *,
                 max_ctas: int | None = None, uva: bool = False) -> None:
        import cupy

        if view.device.type != "cuda":
            raise ValueError(f"direct loads need a CUDA KV view, got {view.device}")
        if not pool.pin:
            raise ValueError("layer-by-layer loads need a pinned CPU pool")
        self._cupy = cupy
        self.view, self.pool, self.ring = view, pool, ring
        self.stream, self.dma_stream = kernel_stream, dma_stream
        self.device_index = view.device.index if view.device.index is not None else 0
        self.addressing = LayerAddressing.of(view)
        self.width = self.addressing.vector_width()
        self.max_ctas = max(1, int(max_ctas or default_max_ctas(view.device)))
        self._kernel = compile_kernel(_KERNEL_SRC, "kvtier_pages_direct", self.width,
                                      self.device_index)
        layer_bytes = (self.addressing.kv_parts * pool.geometry.engine_blocks_per_block
                       * self.addressing.page_bytes)
        # a staging buffer must hold one block's layer at least; else read the slots directly
        self._copy2d = None if uva or ring.slot_bytes < layer_bytes else _memcpy2d()
        a = self.addressing
        with torch.cuda.device(view.device):
            self._layers = torch.from_numpy(
                np.stack([a.base, a.part_stride, a.block_stride]).astype(np.int64)
            ).to(view.device)
        with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            self._cp_stream = cupy.cuda.ExternalStream(kernel_stream.cuda_stream,
                                                       self.device_index)
        self._lock = threading.Lock()

    def launch(self, ids_ptr: int, ptrs_ptr: int, stage: int, layer: int, n_blocks: int,
               per: int, n_layers: int = 1) -> None:
        """Layers ``layer .. layer + n_layers`` of ``n_blocks`` blocks, on the current CuPy
        stream. ``ids_ptr`` / ``ptrs_ptr``: device-readable addresses (device memory, or
        pinned host memory read through UVA)."""
        a = self.addressing
        page_vecs = a.page_bytes // self.width
        tiles_per_page = -(-page_vecs // (_THREADS * _UNROLL))
        grid = max(1, min(self.max_ctas,
                          n_layers * n_blocks * a.kv_parts * per * tiles_per_page))
        layers = self._layers.data_ptr()
        row = 8 * a.num_layers
        self._kernel(
            (grid,), (_THREADS,),
            (np.uint64(layers), np.uint64(layers + row), np.uint64(layers + 2 * row),
             np.uint64(ids_ptr), np.uint64(ptrs_ptr), np.int64(stage), np.int32(layer),
             np.int32(n_layers), np.int64(n_blocks), np.int32(a.kv_parts), np.int32(per),
             np.int64(a.page_bytes), np.int64(page_vecs), np.int64(tiles_per_page), np.int32(0)),
        )

    @property
    def can_prefetch(self) -> bool:
        """Whether ``prefetch`` can start anything (the 2-D staged copy is there)."""
        return self._copy2d is not None

    def _runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """(first block, blocks, host address) of each run of neighbouring slots."""
        block_bytes = self.pool.geometry.block_bytes
        return [(r.job_offset // block_bytes, r.nbytes // block_bytes,
                 r.chunk.data_ptr() + r.chunk_offset) for r in host_runs(self.pool, slots)]

    def _chunks(self, n: int, per: int) -> list[tuple[int, int, int]]:
        """A staged job's pieces in copy order: (layer, first block, end block), each at most
        one staging buffer."""
        layer_bytes = self.addressing.kv_parts * per * self.addressing.page_bytes
        step = max(1, self.ring.slot_bytes // layer_bytes)
        return [(layer, c0, min(n, c0 + step)) for layer in range(self.addressing.num_layers)
                for c0 in range(0, n, step)]

    def prefetch(self, slots: Sequence[int]) -> Prefetch | None:
        """Start the DMA of a likely load's first pieces into the staging ring, before its
        engine blocks are known (:class:`kvtier.transfer.cuda.direct.Prefetch`); None when this job
        would not be staged (no 2-D copy, or slots too scattered)."""
        if self._copy2d is None or not slots:
            return None
        per = self.pool.geometry.engine_blocks_per_block
        runs = self._runs(slots)
        if scattered(len(runs), len(slots)):
            return None
        chunks = self._chunks(len(slots), per)[:len(self.ring.buffers)]
        with self._lock, torch.cuda.device(self.view.device), \
                self._cupy.cuda.Device(self.device_index):
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.dma_stream)
            taken = [self._dma_chunk(runs, chunk, per) for chunk in chunks]
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.dma_stream)
        return Prefetch(tuple(slots), runs, tuple(zip(chunks, taken)), started, done)

    def drop(self, p: Prefetch) -> None:
        """An unused prefetch gives its staging buffers back (free once its DMAs are done)."""
        if p.settled:
            return
        p.settled = True
        with self._lock, torch.cuda.device(self.view.device):
            for _, i in p.pieces:
                self.ring.freed[i].record(self.dma_stream)

    def enqueue(self, engine_ids: Sequence[int], slots: Sequence[int],
                waits: Sequence[torch.cuda.Event] = (),
                prefetch: Prefetch | None = None) -> LayeredJob:
        """``prefetch``: this job's first pieces, already on their way into the staging ring;
        used when the job's slots are exactly the prefetched ones, else given back first."""
        per = validate_job(self.view, self.pool, engine_ids, slots, to_gpu=True)
        n = len(slots)
        if prefetch is not None and not prefetch.matches(slots):
            self.drop(prefetch)
            prefetch = None
        # a prefetch was staged (never UVA) from these very slots' runs
        runs = (prefetch.runs if prefetch is not None
                else self._runs(slots) if self._copy2d is not None else [])
        uva = self._copy2d is None or scattered(len(runs), n)
        if prefetch is not None and uva:  # cannot happen unless the 2-D copy went away
            self.drop(prefetch)
            prefetch = None
        host_ids = torch.from_numpy(np.asarray(engine_ids, dtype=np.int64)).pin_memory()
        keep: list[Any] = [host_ids]
        ptrs_ptr = 0
        block_bytes = self.pool.geometry.block_bytes
        if uva:
            host_ptrs = torch.from_numpy(self.pool.slot_addresses(slots)).pin_memory()
            keep.append(host_ptrs)
        layer_done: list[torch.cuda.Event] = []
        with self._lock, torch.cuda.device(self.view.device):
            for wait in waits:  # only the kernel stream touches the engine's pages
                self.stream.wait_event(wait)
            if prefetch is not None:  # the copy began with the prefetched DMAs
                started = prefetch.started
            else:
                started = torch.cuda.Event(enable_timing=True)
                started.record(self.stream if uva else self.dma_stream)
            gate = torch.cuda.Event(enable_timing=True)  # the waits met (EnqueuedJob.seconds)
            gate.record(self.stream)
            with torch.cuda.stream(self.stream):
                ids = host_ids.to(self.view.device, non_blocking=True)
                keep.append(ids)
                if uva:
                    ptrs = host_ptrs.to(self.view.device, non_blocking=True)
                    keep.append(ptrs)
                    ptrs_ptr = ptrs.data_ptr()
            with self._cupy.cuda.Device(self.device_index), self._cp_stream:
                if uva:
                    for layer in range(self.addressing.num_layers):
                        self.launch(ids.data_ptr(), ptrs_ptr, 0, layer, n, per)
                        layer_done.append(self._record())
                else:
                    ready = {}
                    if prefetch is not None:
                        ready, prefetch.settled = dict(prefetch.pieces), True
                    chunks = self._chunks(n, per)
                    for k, chunk in enumerate(chunks):
                        i = ready.pop(chunk) if chunk in ready else self._dma_chunk(runs, chunk,
                                                                                     per)
                        self._scatter_chunk(ids.data_ptr(), chunk, i, per)
                        if k + 1 == len(chunks) or chunks[k + 1][0] != chunk[0]:
                            layer_done.append(self._record())  # the layer is in place
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return LayeredJob(done=done, nbytes=n * block_bytes, started=started,
                          layer_done=layer_done, keepalive=keep, uva=uva, gate=gate,
                          head=(prefetch.started, prefetch.done) if prefetch else None)

    def enqueue_whole(self, engine_ids: Sequence[int], slots: Sequence[int],
                      waits: Sequence[torch.cuda.Event], args: PinnedArgRing) -> EnqueuedJob | None:
        """A small load as one launch over all layers, its arguments in a pinned buffer of
        ``args`` (:mod:`one_launch`); None when no buffer is free or the job does not fit."""
        per = validate_job(self.view, self.pool, engine_ids, slots, to_gpu=True)
        n = len(slots)
        addresses = self.pool.slot_addresses(slots)  # may wait for a chunk: outside the lock
        with self._lock, torch.cuda.device(self.view.device):  # the ring is taken in order too
            taken = args.take(n * per + n)
            if taken is None:
                return None
            i, words, address = taken
            try:
                words[:n * per] = np.asarray(engine_ids, dtype=np.int64)
                words[n * per:n * per + n] = addresses
                for wait in waits:  # only the kernel stream touches the engine's pages
                    self.stream.wait_event(wait)
                started = torch.cuda.Event(enable_timing=True)  # after the waits: copy time
                started.record(self.stream)
                with self._cupy.cuda.Device(self.device_index), self._cp_stream:
                    self.launch(address, address + 8 * n * per, 0, 0, n, per,
                                n_layers=self.addressing.num_layers)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.stream)
            except BaseException:
                args.give_back(i)
                raise
            args.hold(i, done)
        return EnqueuedJob(done=done, nbytes=n * self.pool.geometry.block_bytes,
                           started=started)

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def _dma_chunk(self, runs: list[tuple[int, int, int]], chunk: tuple[int, int, int],
                   per: int) -> int:
        """Strided DMAs of one piece (a layer of blocks ``c0 .. c1``) into the next staging
        buffer, on the DMA stream; returns the buffer's ring index."""
        memcpy2d, kind = self._copy2d
        layer, c0, c1 = chunk
        ring = self.ring
        layer_bytes = self.addressing.kv_parts * per * self.addressing.page_bytes
        block_bytes = self.pool.geometry.block_bytes
        i = ring.take()
        stage = ring.buffers[i].data_ptr()
        self.dma_stream.wait_event(ring.freed[i])
        for first, count, host in runs:
            lo, hi = max(first, c0), min(first + count, c1)
            if lo < hi:
                memcpy2d(stage + (lo - c0) * layer_bytes, layer_bytes,
                         host + (lo - first) * block_bytes + layer * layer_bytes,
                         block_bytes, layer_bytes, hi - lo, kind,
                         self.dma_stream.cuda_stream)
        ring.filled[i].record(self.dma_stream)
        return i

    def _scatter_chunk(self, ids_ptr: int, chunk: tuple[int, int, int], i: int,
                       per: int) -> None:
        """Scatter staging buffer ``i`` (one piece) into the engine's pages, then free it."""
        layer, c0, c1 = chunk
        ring = self.ring
        self.stream.wait_event(ring.filled[i])
        self.launch(ids_ptr + 8 * c0 * per, 0, ring.buffers[i].data_ptr(), layer, c1 - c0, per)
        ring.freed[i].record(self.stream)
