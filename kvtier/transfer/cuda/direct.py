"""Layer-by-layer loads straight from pinned CPU slots into the engine's pages.

Why: a CPU hit of a long prompt costs the copy (1 GiB for 8k tokens of a Llama-8B shape, ~20 ms
over PCIe) plus the forward of the few tokens left to compute. The staged path
(:mod:`pipeline`) moves a job in slot order (block by block, every layer of a block together),
so no layer is complete before the whole job is, and the forward has to wait for all of it.
Here a job is copied *layer by layer*, one kernel launch per layer, each followed by an event:
layer ``l``'s attention waits (on the GPU, through ``wait_for_layer_load``) only for layer
``l``'s pages, so the forward's first layers run while later layers are still on the wire and
a hit costs about the copy alone.

The kernel reads the pinned pool slots through their unified (UVA) addresses: pinned memory
allocated by CUDA is addressable from the device at its host address, so there is no staging
buffer and no DMA request per (slot, layer) piece, which would be tens of thousands of small
requests for one 8k hit. Page ``(l, k, e)`` of a slot sits at
``slot + ((l * kv_parts + k) * per_block + e) * page_bytes`` (the slot layout of
:mod:`kvtier.tiers.layout`); its engine page at the same address the staged kernel uses.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.page_movers import _VEC_TYPES, default_max_ctas
from kvtier.transfer.cuda.plan import LayerAddressing, host_runs, validate_job

_THREADS = 128
_UNROLL = 4

_KERNEL_SRC = r"""
typedef VEC_T vec_t;
// Copies, for layers [first_layer, first_layer + n_layers) of a job's n_blocks blocks, every
// page between its pinned CPU slot (read or written through its UVA address) and the engine.
extern "C" __global__ void __launch_bounds__(THREADS)
kvtier_pages_direct(const long long* __restrict__ layer_base,
                    const long long* __restrict__ part_stride,
                    const long long* __restrict__ block_stride,
                    const long long* __restrict__ ids, const long long* __restrict__ slot_ptr,
                    int first_layer, int n_layers, long long n_blocks, int kv_parts,
                    int per_block, long long page_bytes, long long page_vecs,
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
        vec_t* host = reinterpret_cast<vec_t*>(slot_ptr[b]
                                               + ((l * kv_parts + k) * per_block + e) * page_bytes);
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

_kernels: dict[tuple[int, int], Any] = {}
_kernels_lock = threading.Lock()


def _kernel(width: int, device_index: int) -> Any:
    import cupy

    with _kernels_lock:
        kern = _kernels.get((width, device_index))
        if kern is None:
            src = (_KERNEL_SRC.replace("VEC_T", _VEC_TYPES[width])
                   .replace("THREADS", str(_THREADS)).replace("UNROLL", str(_UNROLL)))
            with cupy.cuda.Device(device_index):
                kern = cupy.RawKernel(src, "kvtier_pages_direct")
                if hasattr(kern, "compile"):
                    kern.compile()
            _kernels[(width, device_index)] = kern
        return kern


def slot_pointers(pool: CpuBlockPool, slots: Sequence[int]) -> np.ndarray:
    """Host address of every slot of a job (int64, in job order), from its contiguous runs."""
    block_bytes = pool.geometry.block_bytes
    out = np.empty(len(slots), dtype=np.int64)
    for run in host_runs(pool, slots):
        first = run.job_offset // block_bytes
        n = run.nbytes // block_bytes
        base = run.chunk.data_ptr() + run.chunk_offset
        out[first:first + n] = base + np.arange(n, dtype=np.int64) * block_bytes
    return out


@dataclass
class LayeredJob:
    """A load enqueued layer by layer: ``layer_done[l]`` fires once layer ``l`` is in place,
    ``done`` once all are. Everything in ``keepalive`` lives until ``done`` fired."""

    done: torch.cuda.Event
    nbytes: int
    started: torch.cuda.Event
    layer_done: list[torch.cuda.Event]
    keepalive: list[Any] = field(default_factory=list)


class DirectLayerLoader:
    """CPU slots -> engine pages, one kernel per layer on its own high-priority stream."""

    def __init__(self, view: GpuKvView, pool: CpuBlockPool, *, priority: int = 0,
                 max_ctas: int | None = None) -> None:
        import cupy

        if view.device.type != "cuda":
            raise ValueError(f"direct loads need a CUDA KV view, got {view.device}")
        if not pool.pin:
            raise ValueError("direct loads need a pinned CPU pool (UVA addresses)")
        self._cupy = cupy
        self.view, self.pool = view, pool
        self.device_index = view.device.index if view.device.index is not None else 0
        self.addressing = LayerAddressing.of(view)
        self.width = self.addressing.vector_width()
        self.max_ctas = max(1, int(max_ctas or default_max_ctas(view.device)))
        self._kernel = _kernel(self.width, self.device_index)
        a = self.addressing
        with torch.cuda.device(view.device):
            self.stream = torch.cuda.Stream(view.device, priority=priority)
            self._layers = torch.from_numpy(
                np.stack([a.base, a.part_stride, a.block_stride]).astype(np.int64)
            ).to(view.device)
        with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            self._cp_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, self.device_index)
        self._lock = threading.Lock()

    def enqueue(self, engine_ids: Sequence[int], slots: Sequence[int],
                waits: Sequence[torch.cuda.Event] = ()) -> LayeredJob:
        per = validate_job(self.view, self.pool, engine_ids, slots, to_gpu=True)
        a = self.addressing
        page = a.page_bytes
        page_vecs = page // self.width
        tiles_per_page = -(-page_vecs // (_THREADS * _UNROLL))
        n_blocks = len(slots)
        layer_tiles = n_blocks * a.kv_parts * per * tiles_per_page
        grid = max(1, min(self.max_ctas, layer_tiles))
        host_ids = torch.from_numpy(np.asarray(engine_ids, dtype=np.int64)).pin_memory()
        host_ptrs = torch.from_numpy(slot_pointers(self.pool, slots)).pin_memory()
        layers = self._layers.data_ptr()
        row = 8 * a.num_layers
        with self._lock, torch.cuda.device(self.view.device):
            for wait in waits:
                self.stream.wait_event(wait)
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
            with torch.cuda.stream(self.stream):
                ids = host_ids.to(self.view.device, non_blocking=True)
                ptrs = host_ptrs.to(self.view.device, non_blocking=True)
            layer_done = []
            with self._cupy.cuda.Device(self.device_index), self._cp_stream:
                for layer in range(a.num_layers):
                    self._kernel(
                        (grid,), (_THREADS,),
                        (np.uint64(layers), np.uint64(layers + row), np.uint64(layers + 2 * row),
                         np.uint64(ids.data_ptr()), np.uint64(ptrs.data_ptr()), np.int32(layer),
                         np.int32(1), np.int64(n_blocks), np.int32(a.kv_parts), np.int32(per),
                         np.int64(page), np.int64(page_vecs), np.int64(tiles_per_page),
                         np.int32(0)),
                    )
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    layer_done.append(ev)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        nbytes = n_blocks * self.pool.geometry.block_bytes
        return LayeredJob(done=done, nbytes=nbytes, started=started, layer_done=layer_done,
                          keepalive=[ids, ptrs, host_ids, host_ptrs])
