"""GPU <-> CPU block copies with plain torch indexing (the portable path).

A GPU spec lists ``engine_blocks_per_block`` (k) engine block ids per kvtier block, in order:
GPU ids ``[i*k:(i+1)*k]`` belong to CPU slot ``i``. A slot holds the block in the slot layout
``[layer][kv_part][engine_block_in_block][page_bytes]``, so per layer and pool chunk one
batched gather and one batched scatter move every block of a job (``pages[:, ids]`` is
``[kv_part, n, k, page]``: the slot order with the first two axes swapped).

Bytes are moved as the widest integer word that divides the page: torch's index kernels copy
element by element, so uint8 is far slower than int64 (docs/design-measurements.md).

The copies also run on CUDA tensors (one host staging copy per layer): correct but not fast;
the fast CUDA path lives elsewhere. Copies run on the handler's thread, never on the event loop."""

from __future__ import annotations

from typing import Iterator

import torch

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome


class _GpuCpuHandler(TransferHandler):
    """Shared validation and indexing for both directions."""

    def __init__(self, view: GpuKvView, pool: CpuBlockPool, *, concurrency: int = 1) -> None:
        g = pool.geometry
        if (g.num_layers, g.kv_parts, g.page_bytes) != (view.num_layers, view.kv_parts, view.page_bytes):
            raise ValueError(
                f"CPU pool geometry ({g.describe()}) does not match the engine KV view "
                f"({view.num_layers} layers x {view.kv_parts} kv x {view.page_bytes} B pages)"
            )
        self.view = view
        self.pool = pool
        self.k = g.engine_blocks_per_block
        self.concurrency = concurrency
        self.word = _word_dtype(view)
        self.words_per_page = g.page_bytes // self.word.itemsize
        self.pages = [layer.pages.view(self.word) for layer in view.layers]  # [kv_part, blocks, words]

    def _plan(
        self, gpu: LoadStoreSpec, cpu: LoadStoreSpec, *, unique_gpu: bool
    ) -> tuple[torch.Tensor, list[int]]:
        """Validate the addresses; returns GPU ids as ``[n, k]`` and the slot list."""
        slots = list(cpu.ids)
        n = len(slots)
        if len(gpu.ids) != self.k * n:
            raise ValueError(
                f"{self.name}: {len(gpu.ids)} engine block ids for {n} CPU slots; expected "
                f"{self.k} per slot ({self.k * n})"
            )
        bad = [i for i in gpu.ids if not 0 <= i < self.view.num_blocks]
        if bad:
            raise ValueError(
                f"{self.name}: engine block ids {bad[:8]} out of range [0, {self.view.num_blocks})"
            )
        bad = [s for s in slots if not 0 <= s < self.pool.num_slots]
        if bad:
            raise ValueError(f"{self.name}: CPU slots {bad[:8]} out of range [0, {self.pool.num_slots})")
        # A destination written twice in one job would end up holding whichever copy ran last.
        if unique_gpu and len(set(gpu.ids)) != len(gpu.ids):
            raise ValueError(f"{self.name}: duplicate destination engine block ids")
        if not unique_gpu and len(set(slots)) != n:
            raise ValueError(f"{self.name}: duplicate destination CPU slots")
        ids = torch.tensor(gpu.ids, dtype=torch.long).view(n, self.k)
        return ids, slots

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        to_gpu = self.direction[1] is Medium.GPU
        ids, slots = self._plan(*((dst, src) if to_gpu else (src, dst)), unique_gpu=to_gpu)
        if slots:
            await self.run_blocking(self._copy, ids, slots)
        return TransferOutcome(bytes=len(slots) * self.pool.geometry.block_bytes)

    def _chunks(self, ids: torch.Tensor, slots: list[int]) -> Iterator[tuple]:
        """Per pool chunk of ``slots``: the chunk as words ``[rows, layer, kv_part, k, page]``,
        its row count, the rows' engine block ids (on the KV device) and the row indices."""
        g = self.pool.geometry
        for chunk, pos, rows in self.pool.group_by_chunk(slots):
            chunk5 = chunk.view(self.word).view(
                chunk.shape[0], g.num_layers, g.kv_parts, self.k, self.words_per_page)
            gpu_idx = ids[torch.tensor(pos, dtype=torch.long)].reshape(-1).to(self.view.device)
            yield chunk5, len(rows), gpu_idx, torch.tensor(rows, dtype=torch.long)

    def _sync(self) -> None:
        if self.view.device.type == "cuda":
            torch.cuda.current_stream(self.view.device).synchronize()


class GpuToCpuHandler(_GpuCpuHandler):
    """Store: engine pages -> CPU pool slots."""

    direction = (Medium.GPU, Medium.CPU)

    def _copy(self, ids: torch.Tensor, slots: list[int]) -> None:
        k, words = self.k, self.words_per_page
        for chunk5, m, gpu_idx, rows_t in self._chunks(ids, slots):
            for layer_no, pages in enumerate(self.pages):
                for part in range(pages.shape[0]):
                    # per part, dim 0: fast for strided (blocks_first) pages too
                    got = pages[part].index_select(0, gpu_idx)  # [m*k, words], contiguous
                    if got.device != chunk5.device:
                        got = got.to(chunk5.device)
                    chunk5[:, layer_no, part].index_copy_(0, rows_t, got.view(m, k, words))


class CpuToGpuHandler(_GpuCpuHandler):
    """Load: CPU pool slots -> engine pages."""

    direction = (Medium.CPU, Medium.GPU)

    def _copy(self, ids: torch.Tensor, slots: list[int]) -> None:
        k, words, parts = self.k, self.words_per_page, self.view.kv_parts
        for chunk5, m, gpu_idx, rows_t in self._chunks(ids, slots):
            staged = torch.empty((parts, m * k, words), dtype=self.word)
            for layer_no, pages in enumerate(self.pages):
                for part in range(parts):
                    torch.index_select(
                        chunk5[:, layer_no, part], 0, rows_t, out=staged[part].view(m, k, words)
                    )
                on_device = staged.to(pages.device)
                for part in range(parts):
                    pages[part].index_copy_(0, gpu_idx, on_device[part])
        self._sync()


def _word_dtype(view: GpuKvView) -> torch.dtype:
    """Widest integer type every layer's pages can be reinterpreted as (page size, strides and
    offsets all divisible by it); uint8 always works."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if view.page_bytes % dtype.itemsize:
            continue
        try:
            for layer in view.layers:
                layer.pages.view(dtype)
        except RuntimeError:
            continue
        return dtype
    return torch.uint8
