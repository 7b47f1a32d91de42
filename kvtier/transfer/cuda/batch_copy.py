"""Batched DMA between the engine's pages and pinned CPU slots: the copy engines only, no SM.

Why: the staged path (:mod:`pipeline`) gathers a store's pages with a kernel, and under
saturated serving an SM copy kernel slows the model's forward far more than a DMA does
(docs/design-measurements.md). ``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers) takes a whole job
as one call of (destination, source, size) descriptors and runs them on the copy engines.

How: page ``(b, l, k, e)`` of a job (block, layer, kv part, sub-block: slot order) is one
descriptor: the engine page at ``base[l] + k * part_stride[l] + id * block_stride[l]`` (what
the kernels of :mod:`page_movers` and :mod:`direct` compute) and the slot bytes at
``slot + ((l * kv_parts + k) * per_block + e) * page_bytes`` (the slot layout). Descriptors
adjacent on both sides are merged into one (a blocks-first layer's K and V pages, a block's
neighbouring engine blocks, a block's layers where they lie block by block in one
allocation), so the copy engines get fewer, larger requests; never across two allocations.

The driver reads the descriptor arrays during the call only: one workspace per copier is
reused for every job (under the copier's lock), grown when a job needs more.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.pipeline import EnqueuedJob
from kvtier.transfer.cuda.plan import LayerAddressing, validate_job

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # sources read in stream order (after the waits)
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_NO_INDEX = (1 << 64) - 1  # failIdx when an error concerns no single copy (SIZE_MAX)


class _MemLocation(ctypes.Structure):
    """``CUmemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_P = ctypes.c_void_p


class _Driver:
    """libcuda's batch copy entry point, bound by name: ``cuMemcpyBatchAsync_v2`` (CUDA 13
    drivers; no ``failIdx``) if exported, else ``cuMemcpyBatchAsync`` (CUDA 12.8 ABI).

    A driver call runs in the thread's current context: callers run on a thread where torch
    has used CUDA on the copy's device (recording an event on its stream does), so the
    device's primary context is current; ``ensure_context`` makes it current if no context
    is, and refuses another device's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        try:
            self._batch = lib["cuMemcpyBatchAsync_v2"]
            self.has_fail_index = False
        except AttributeError:
            self._batch = lib["cuMemcpyBatchAsync"]  # AttributeError: none (driver < 12.8)
            self.has_fail_index = True
        tail = [_P] if self.has_fail_index else []  # size_t* failIdx, before the stream
        self._batch.argtypes = [_P, _P, _P, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, *tail, _P]
        self._batch.restype = ctypes.c_int
        self.symbol = "cuMemcpyBatchAsync" if self.has_fail_index else "cuMemcpyBatchAsync_v2"
        self._error_name = _optional(lib, "cuGetErrorName", [ctypes.c_int,
                                                              ctypes.POINTER(ctypes.c_char_p)])
        self._ctx_get = _optional(lib, "cuCtxGetCurrent", [ctypes.POINTER(_P)])
        self._ctx_device = _optional(lib, "cuCtxGetDevice", [ctypes.POINTER(ctypes.c_int)])
        self._ctx_set = _optional(lib, "cuCtxSetCurrent", [_P])
        self._device_get = _optional(lib, "cuDeviceGet", [ctypes.POINTER(ctypes.c_int),
                                                          ctypes.c_int])
        self._primary = _optional(lib, "cuDevicePrimaryCtxRetain", [ctypes.POINTER(_P),
                                                                    ctypes.c_int])
        self._attr_index = (ctypes.c_size_t * 1)(0)  # one attributes entry for every copy
        self.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self._flags_settled = False  # a call succeeded with ``flags``

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name is not None and self._error_name(code, ctypes.byref(name)) == 0 \
                and name.value:
            return f"{name.value.decode()} ({code})"
        return f"CUresult {code}"

    def _check(self, what: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {self.error_name(code)}")

    def ensure_context(self, ordinal: int) -> None:
        """Make device ``ordinal``'s primary context current if the thread has none (what
        the runtime does on a thread's first call); refuse another device's context."""
        if self._ctx_get is None or self._ctx_device is None:
            return
        ctx = _P()
        self._check("cuCtxGetCurrent", self._ctx_get(ctypes.byref(ctx)))
        if ctx.value:
            dev = ctypes.c_int(-1)
            self._check("cuCtxGetDevice", self._ctx_device(ctypes.byref(dev)))
            if dev.value != ordinal:
                raise RuntimeError(f"the thread's current CUDA context is device {dev.value}'s; "
                                   f"a batch copy for device {ordinal} needs its own")
            return
        if self._device_get is None or self._primary is None or self._ctx_set is None:
            raise RuntimeError("no CUDA context is current on this thread")
        device, primary = ctypes.c_int(), _P()
        self._check("cuDeviceGet", self._device_get(ctypes.byref(device), ordinal))
        self._check("cuDevicePrimaryCtxRetain", self._primary(ctypes.byref(primary), device))
        self._check("cuCtxSetCurrent", self._ctx_set(primary))

    def memcpy_batch(self, batch: "Descriptors", attrs: _MemcpyAttributes, stream: int) -> None:
        """Enqueue ``batch`` on ``stream`` (a ``cudaStream_t``, never the legacy NULL stream).
        The flag that asks the driver to overlap copies with compute is tried first; a driver
        that refuses it with CUDA_ERROR_INVALID_VALUE on the first use is asked without it from
        then on (a store repeated with the same bytes is harmless, should the refused call
        have enqueued part of the batch)."""
        count = len(batch.sizes)
        if count == 0:
            return
        while True:
            attrs.flags = self.flags
            args = [batch.dst.ctypes.data, batch.src.ctypes.data, batch.sizes.ctypes.data, count,
                    ctypes.byref(attrs), self._attr_index, 1]
            fail = ctypes.c_size_t(_NO_INDEX)
            if self.has_fail_index:
                args.append(ctypes.byref(fail))
            code = self._batch(*args, stream)
            if code == CUDA_SUCCESS:
                self._flags_settled = True
                return
            if code == CUDA_ERROR_INVALID_VALUE and self.flags and not self._flags_settled:
                log.info("kvtier: %s refused CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE; "
                         "batch copies go without it", self.symbol)
                self.flags = 0
                continue
            where = "" if fail.value == _NO_INDEX else f" at copy {fail.value}"
            raise RuntimeError(f"{self.symbol} of {count} copies failed{where}: "
                               f"{self.error_name(code)}")


def _optional(lib: ctypes.CDLL, name: str, argtypes: list) -> Any:
    try:
        fn = lib[name]
    except AttributeError:
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _load_driver() -> _Driver | str:
    """The binding, or why there is none (cached: the answer never changes in a process)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver library libcuda.so.1 does not load ({exc})"
    try:
        return _Driver(lib)
    except AttributeError:
        return "the CUDA driver has no cuMemcpyBatchAsync (it needs a CUDA 12.8+ driver)"


def batch_copy_available() -> bool:
    """Whether ``cuMemcpyBatchAsync`` can be called here (the driver library loads and exports
    it); never raises."""
    return isinstance(_load_driver(), _Driver)


def batch_copy_unavailable_reason() -> str | None:
    """Why batch copies cannot run here, or None when they can."""
    d = _load_driver()
    return None if isinstance(d, _Driver) else d


class Descriptors(NamedTuple):
    """One batch: ``dst[i] <- src[i]``, ``sizes[i]`` bytes (uint64 views of a workspace, valid
    until its next ``build``)."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray


def layer_allocations(view: GpuKvView) -> list[int]:
    """Which layers share one allocation (equal numbers: the same tensor storage, as vLLM's
    one-allocation KV caches are); layers elsewhere get their own."""
    return [layer.pages.untyped_storage().data_ptr() for layer in view.layers]


class DescriptorWorkspace:
    """Builds a job's descriptors into host arrays reused from job to job (grown, never
    shrunk). Not thread-safe: its copier builds and calls under one lock.

    A descriptor never spans two allocations, even where they happen to lie back to back in
    address space: two pool chunks (each its own pinned allocation or registration, see
    :mod:`kvtier.tiers.cpu_pool`) or two layers that are not one allocation
    (``allocations``: one number per layer, equal for a shared allocation; None: every layer
    its own)."""

    def __init__(self, addressing: LayerAddressing, pool: CpuBlockPool,
                 allocations: Sequence[int] | None = None) -> None:
        a = addressing
        self.addressing, self.pool = a, pool
        self.page_bytes = a.page_bytes
        self.per_block = per_block = pool.geometry.engine_blocks_per_block
        parts = np.arange(a.kv_parts, dtype=np.int64)
        # engine address of page (l, k) of engine block 0: [layers, kv_parts]
        self._part_base = a.base[:, None] + parts[None, :] * a.part_stride[:, None]
        self._block_stride = a.block_stride[None, :, None, None]
        self.pages_per_block = a.num_layers * a.kv_parts * per_block
        # offset of page (l, k, e) in its slot, in slot order (the slot layout)
        self._slot_offsets = np.arange(self.pages_per_block, dtype=np.int64) * a.page_bytes
        # pages of a block where the engine side enters another allocation: a layer's first
        # page after a layer elsewhere (index 0: after the previous block's last layer)
        alloc = np.arange(a.num_layers) if allocations is None else np.asarray(allocations)
        if alloc.shape != (a.num_layers,):
            raise ValueError(f"{alloc.shape[0]} allocation ids for {a.num_layers} layers")
        self._crossing = np.zeros(self.pages_per_block, dtype=bool)
        self._crossing[::a.kv_parts * per_block] = alloc != np.roll(alloc, 1)
        self.capacity = 0
        self._grow(self.pages_per_block)

    def _grow(self, pages: int) -> None:
        cap = max(pages, 2 * self.capacity)
        self._engine = np.empty(cap, dtype=np.int64)  # every page's engine address
        self._host = np.empty(cap, dtype=np.int64)  # every page's slot address
        self._step = np.empty(cap, dtype=np.int64)  # address differences of neighbours
        self._split = np.empty(cap, dtype=bool)  # a descriptor starts at this page
        self._other = np.empty(cap, dtype=bool)
        self._dst = np.empty(cap, dtype=np.int64)
        self._src = np.empty(cap, dtype=np.int64)
        self._sizes = np.empty(cap, dtype=np.int64)
        self.capacity = cap

    def job(self, engine_ids: Sequence[int], slots: Sequence[int], *,
            to_gpu: bool) -> Descriptors:
        """The coalesced descriptors of one job (engine block ids, CPU slots), checked first:
        a bad id would send the copy engines to a wrong address. ``to_gpu``: a load (slots ->
        pages); else a store. Waits for a pool chunk still being allocated."""
        validate_job(self.addressing, self.pool, engine_ids, slots, to_gpu=to_gpu)
        s = np.asarray(slots, dtype=np.int64)
        return self.build(np.asarray(engine_ids, dtype=np.int64), self.pool.slot_addresses(s),
                          s // self.pool.slots_per_chunk, to_gpu=to_gpu)

    def build(self, engine_ids: np.ndarray, slot_addresses: np.ndarray,
              slot_chunks: np.ndarray, *, to_gpu: bool) -> Descriptors:
        """The coalesced descriptors of a job ``job`` has checked: ``engine_ids`` holds
        ``per_block`` ids per slot; ``slot_addresses`` and ``slot_chunks``: each slot's host
        address (``CpuBlockPool.slot_addresses``: right for a chunked pool) and pool chunk."""
        ids = np.asarray(engine_ids, dtype=np.int64).reshape(-1, self.per_block)
        slots = np.asarray(slot_addresses, dtype=np.int64)
        blocks = slots.shape[0]
        if ids.shape[0] != blocks or len(slot_chunks) != blocks:
            raise ValueError(f"{ids.shape[0]} blocks of engine ids and {len(slot_chunks)} "
                             f"chunk numbers for {blocks} slots")
        n = blocks * self.pages_per_block
        if n == 0:
            empty = self._dst[:0].view(np.uint64)
            return Descriptors(empty, empty, empty)
        if n > self.capacity:
            self._grow(n)
        layers, parts = self._part_base.shape
        engine = self._engine[:n]
        grid = engine.reshape(blocks, layers, parts, self.per_block)
        np.multiply(ids[:, None, None, :], self._block_stride, out=grid)
        grid += self._part_base[None, :, :, None]
        host = self._host[:n]
        np.add(slots[:, None], self._slot_offsets[None, :],
               out=host.reshape(blocks, self.pages_per_block))
        src, dst = (host, engine) if to_gpu else (engine, host)
        split = self._split[:n]
        self._adjacent(dst, src, n)
        # allocation boundaries: the engine's layers, and the pool's chunks between slots
        by_block = split.reshape(blocks, self.pages_per_block)
        np.logical_or(by_block, self._crossing, out=by_block)
        chunks = np.asarray(slot_chunks)
        np.logical_or(by_block[1:, 0], chunks[1:] != chunks[:-1], out=by_block[1:, 0])
        split[0] = True
        return self._merge(dst, src, n)

    def _adjacent(self, dst: np.ndarray, src: np.ndarray, n: int) -> None:
        """``split[i]``: page i does not follow page i - 1 on both sides."""
        page = self.page_bytes
        split, other, step = self._split[:n], self._other[:n - 1], self._step[:n - 1]
        np.subtract(src[1:], src[:-1], out=step)
        np.not_equal(step, page, out=split[1:])
        np.subtract(dst[1:], dst[:-1], out=step)
        np.not_equal(step, page, out=other)
        np.logical_or(split[1:], other, out=split[1:])

    def _merge(self, dst: np.ndarray, src: np.ndarray, n: int) -> Descriptors:
        """One descriptor per run of pages between splits."""
        starts = np.flatnonzero(self._split[:n])
        m = starts.shape[0]
        out_dst, out_src, sizes = self._dst[:m], self._src[:m], self._sizes[:m]
        np.take(dst, starts, out=out_dst, mode="clip")  # "clip": no buffered copy (in range)
        np.take(src, starts, out=out_src, mode="clip")
        np.subtract(starts[1:], starts[:-1], out=sizes[:-1])
        sizes[-1] = n - starts[-1]
        sizes *= self.page_bytes
        return Descriptors(out_dst.view(np.uint64), out_src.view(np.uint64),
                           sizes.view(np.uint64))


class BatchCopier:
    """Enqueues jobs of one direction, each as one batch call on its own stream; ``to_gpu``
    False = store (GPU -> CPU). Same ``enqueue`` as :class:`pipeline.PagedCopier`."""

    def __init__(self, view: GpuKvView, pool: CpuBlockPool, *, to_gpu: bool,
                 priority: int = 0) -> None:
        if view.device.type != "cuda":
            raise ValueError(f"batch copies need KV tensors on CUDA, got {view.device}")
        if not pool.pin:
            raise ValueError("batch copies need a pinned CPU pool (DMA to pageable memory "
                             "is staged by the driver and synchronous)")
        driver = _load_driver()
        if not isinstance(driver, _Driver):
            raise RuntimeError(driver)
        self.driver = driver
        self.view, self.pool, self.to_gpu = view, pool, to_gpu
        self.device = view.device
        self.ordinal = view.device.index if view.device.index is not None \
            else torch.cuda.current_device()
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device, priority=priority)
        self.workspace = DescriptorWorkspace(LayerAddressing.of(view), pool,
                                             layer_allocations(view))
        gpu = _MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal)
        host = _MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
        self._attrs = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                        host if to_gpu else gpu, gpu if to_gpu else host, 0)
        self._lock = threading.Lock()

    def enqueue(self, engine_ids: Sequence[int], slots: Sequence[int],
                waits: Sequence[torch.cuda.Event] = ()) -> EnqueuedJob:
        """Enqueue one job; every event in ``waits`` fires before any KV page is touched."""
        with self._lock, torch.cuda.device(self.device):
            batch = self.workspace.job(engine_ids, slots, to_gpu=self.to_gpu)
            for wait in waits:
                self.stream.wait_event(wait)
            started = torch.cuda.Event(enable_timing=True)  # after the waits: copy time
            started.record(self.stream)
            self.driver.ensure_context(self.ordinal)
            self.driver.memcpy_batch(batch, self._attrs, self.stream.cuda_stream)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return EnqueuedJob(done=done, nbytes=len(slots) * self.pool.geometry.block_bytes,
                           started=started)
