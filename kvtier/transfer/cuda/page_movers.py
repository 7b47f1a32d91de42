"""Gather pages into a staging buffer and scatter them back: the only SM work of a transfer.

The copy engines (DMA) move large contiguous buffers at full PCIe speed but each request costs
a few microseconds, so many separate small pages crawl. A short kernel gathers the scattered
pages of a chunk into a contiguous staging buffer (HBM to HBM) so the DMA that follows is one
big request.

Grid size (``max_ctas``, default two CTAs per multiprocessor): while the model computes, a
gather only gets SMs in the gaps between compute kernels, so it must finish its chunk within
such a gap (docs/design-measurements.md).

Two implementations of one interface:

* :class:`CupyPageMover` - one kernel launch per chunk; page addresses computed in the kernel
  from per-layer bases and strides (any layer address, any stride; 16-byte accesses when
  alignment allows).
* :class:`TorchPageMover` - ``index_select`` / ``index_copy_`` per (layer, kv_part): no CuPy
  needed; the fallback and a cross-check in tests."""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.plan import LayerAddressing

_VEC_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_THREADS = 128
_UNROLL = 4

_KERNEL_SRC = r"""
typedef VEC_T vec_t;
// Copies pages [first_page, first_page + n_pages) of a job between the KV layers and a staging
// buffer. Page g of a job (slot order) is block b, layer l, kv part k, sub-block e; its address
// is layer_base[l] + k * part_stride[l] + ids[b * per_block + e] * block_stride[l], computed
// here so the host only uploads the job's engine block ids.
extern "C" __global__ void __launch_bounds__(THREADS)
kvtier_pages(const long long* __restrict__ layer_base, const long long* __restrict__ part_stride,
             const long long* __restrict__ block_stride, const long long* __restrict__ ids,
             vec_t* stage, long long first_page, long long n_pages, int num_layers,
             int kv_parts, int per_block, long long page_vecs, long long tiles_per_page,
             int to_stage)
{
    const long long per_layer = (long long)kv_parts * per_block;
    const long long per_slot = per_layer * num_layers;
    const long long n_tiles = n_pages * tiles_per_page;
    for (long long t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const long long p = t / tiles_per_page;
        const long long g = first_page + p;
        const long long b = g / per_slot;
        long long r = g - b * per_slot;
        const long long l = r / per_layer;
        r -= l * per_layer;
        const long long k = r / per_block;
        const long long e = r - k * per_block;
        const long long addr = layer_base[l] + k * part_stride[l]
                             + ids[b * per_block + e] * block_stride[l];
        vec_t* page = reinterpret_cast<vec_t*>(addr);
        vec_t* st = stage + p * page_vecs;
        const vec_t* src = to_stage ? page : st;
        vec_t* dst = to_stage ? st : page;
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

_kernel_cache: dict[tuple[str, int, int], Any] = {}
_kernel_lock = threading.Lock()


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def compile_kernel(source: str, name: str, width: int, device_index: int) -> Any:
    """``name`` from ``source`` with its VEC_T / THREADS / UNROLL filled in, compiled once per
    (kernel, access width, device) and shared by every mover (the staged and layered paths)."""
    import cupy

    key = (name, width, device_index)
    with _kernel_lock:
        kern = _kernel_cache.get(key)
        if kern is None:
            src = (
                source.replace("VEC_T", _VEC_TYPES[width])
                .replace("THREADS", str(_THREADS))
                .replace("UNROLL", str(_UNROLL))
            )
            with cupy.cuda.Device(device_index):
                kern = cupy.RawKernel(src, name)
                if hasattr(kern, "compile"):  # compile now, not inside the first transfer
                    kern.compile()
            _kernel_cache[key] = kern
        return kern


class PageMover(ABC):
    """Moves the pages ``[p0, p1)`` of a job (slot order) between the KV view and staging."""

    @abstractmethod
    def prepare(self, engine_ids: np.ndarray, per_block: int, stream: torch.cuda.Stream) -> Any:
        """Per-job state (address table...), uploaded on ``stream``; kept alive by the caller
        until the job's copies finished."""

    @abstractmethod
    def gather(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
               stream: torch.cuda.Stream) -> None: ...

    @abstractmethod
    def scatter(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
                stream: torch.cuda.Stream) -> None: ...


class CupyPageMover(PageMover):
    """One kernel launch per chunk. The layers' base addresses and strides live on the GPU for
    the handler's lifetime; a job uploads only its engine block ids (8 bytes per id), so the
    first copy starts almost at once even for jobs of hundreds of thousands of pages."""

    def __init__(self, view: GpuKvView, *, max_ctas: int | None = None) -> None:
        import cupy

        self._cupy = cupy
        self.addressing = LayerAddressing.of(view)
        self.page_bytes = view.page_bytes
        self.width = self.addressing.vector_width()
        self.device_index = view.device.index if view.device.index is not None else 0
        self.max_ctas = max(1, int(max_ctas or default_max_ctas(view.device)))
        self._kernel = compile_kernel(_KERNEL_SRC, "kvtier_pages", self.width, self.device_index)
        self._cp_streams: dict[int, Any] = {}
        a = self.addressing
        self._layers = torch.from_numpy(
            np.stack([a.base, a.part_stride, a.block_stride]).astype(np.int64)
        ).to(view.device)  # [3, num_layers], uploaded once

    def _cp_stream(self, stream: torch.cuda.Stream) -> Any:
        handle = stream.cuda_stream
        s = self._cp_streams.get(handle)
        if s is None:
            with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._cupy.cuda.ExternalStream(handle, self.device_index)
            self._cp_streams[handle] = s
        return s

    def prepare(self, engine_ids: np.ndarray, per_block: int, stream: torch.cuda.Stream) -> Any:
        with torch.cuda.stream(stream):
            ids = _upload(engine_ids, torch.device("cuda", self.device_index))
        return (ids, per_block)

    def _launch(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
                stream: torch.cuda.Stream, to_stage: int) -> None:
        n_pages = p1 - p0
        if n_pages <= 0:
            return
        if stage.numel() < n_pages * self.page_bytes:
            raise ValueError("staging buffer smaller than the chunk")
        ids, per_block = job
        a = self.addressing
        page_vecs = self.page_bytes // self.width
        tiles_per_page = -(-page_vecs // (_THREADS * _UNROLL))
        grid = min(self.max_ctas, n_pages * tiles_per_page)
        layers = self._layers.data_ptr()
        row = 8 * a.num_layers
        # RawKernel launches on CuPy's current stream (thread-local): make it ours
        with self._cupy.cuda.Device(self.device_index), self._cp_stream(stream):
            self._kernel(
                (grid,), (_THREADS,),
                (np.uint64(layers), np.uint64(layers + row), np.uint64(layers + 2 * row),
                 np.uint64(ids.data_ptr()), np.uint64(stage.data_ptr()), np.int64(p0),
                 np.int64(n_pages), np.int32(a.num_layers), np.int32(a.kv_parts),
                 np.int32(per_block), np.int64(page_vecs), np.int64(tiles_per_page),
                 np.int32(to_stage)),
            )

    def gather(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
               stream: torch.cuda.Stream) -> None:
        self._launch(job, p0, p1, stage, stream, 1)

    def scatter(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
                stream: torch.cuda.Stream) -> None:
        self._launch(job, p0, p1, stage, stream, 0)


class TorchPageMover(PageMover):
    def __init__(self, view: GpuKvView) -> None:
        self.view = view
        self.page_bytes = view.page_bytes
        # [kv_part, num_blocks, page] views per layer, as 2-D [num_blocks, page] per part
        self._pages = [[layer.pages[k] for k in range(view.kv_parts)] for layer in view.layers]

    def prepare(self, engine_ids: np.ndarray, per_block: int, stream: torch.cuda.Stream) -> Any:
        L, K, E = self.view.num_layers, self.view.kv_parts, per_block
        ids = np.asarray(engine_ids, dtype=np.int64).reshape(-1, E)
        nb = ids.shape[0]
        b = np.arange(nb, dtype=np.int64)[:, None]
        e = np.arange(E, dtype=np.int64)[None, :]
        groups = []
        with torch.cuda.stream(stream):
            dev_ids = _upload(ids.reshape(-1), self.view.device)
            for layer in range(L):
                for k in range(K):
                    pos_np = (((b * L + layer) * K + k) * E + e).reshape(-1)  # ascending
                    groups.append((layer, k, pos_np, _upload(pos_np, self.view.device), dev_ids))
        return groups

    def _ranges(self, job: Any, p0: int, p1: int):
        for layer, k, pos_np, dev_pos, dev_ids in job:
            lo = int(np.searchsorted(pos_np, p0))
            hi = int(np.searchsorted(pos_np, p1))
            if hi > lo:
                yield self._pages[layer][k], dev_pos[lo:hi] - p0, dev_ids[lo:hi]

    def gather(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
               stream: torch.cuda.Stream) -> None:
        staged = stage[: (p1 - p0) * self.page_bytes].view(p1 - p0, self.page_bytes)
        with torch.cuda.stream(stream):
            for pages, where, ids in self._ranges(job, p0, p1):
                staged.index_copy_(0, where, pages.index_select(0, ids))

    def scatter(self, job: Any, p0: int, p1: int, stage: torch.Tensor,
                stream: torch.cuda.Stream) -> None:
        staged = stage[: (p1 - p0) * self.page_bytes].view(p1 - p0, self.page_bytes)
        with torch.cuda.stream(stream):
            for pages, where, ids in self._ranges(job, p0, p1):
                pages.index_copy_(0, ids, staged.index_select(0, where))


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Pinned, non-blocking upload on the current stream (never stalls the transfer thread)."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    return host.pin_memory().to(device, non_blocking=True)


def default_max_ctas(device: torch.device) -> int:
    """Two CTAs per multiprocessor (see the module docstring)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def make_page_mover(view: GpuKvView, backend: str = "auto", *,
                    max_ctas: int | None = None) -> PageMover:
    """``backend``: ``"cupy"``, ``"torch"`` or ``"auto"`` (CuPy when importable)."""
    if backend not in ("auto", "cupy", "torch"):
        raise ValueError(f"unknown page mover backend {backend!r}; use auto, cupy or torch")
    if backend == "cupy" or (backend == "auto" and cupy_available()):
        return CupyPageMover(view, max_ctas=max_ctas)
    return TorchPageMover(view)
