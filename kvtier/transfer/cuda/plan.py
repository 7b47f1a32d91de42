"""Turn one job (engine block ids <-> CPU slots) into byte addresses, before any copy runs.

The CUDA path moves a job as one *stream of pages* in slot order::

    for block in job: for layer: for kv_part: for engine_block_in_block: page_bytes

which is exactly the concatenation of the job's CPU slots (the slot layout of
:mod:`kvtier.tiers.layout`). So the GPU side needs one source/destination address per page
(a *page table*: layers live at unrelated addresses and may be strided), and the CPU side needs
the job's byte stream cut into runs of contiguous host memory (consecutive slots in one pool
chunk form one run, so DMA requests stay large when the manager hands out neighbouring slots).

Everything here is integer arithmetic on numpy arrays: it runs (and is tested) without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView


@dataclass(frozen=True)
class LayerAddressing:
    """Base address and byte strides of every layer's ``[kv_part, block, page]`` view."""

    base: np.ndarray  # int64 [layers]
    part_stride: np.ndarray  # int64 [layers], bytes between K and V pages of one block
    block_stride: np.ndarray  # int64 [layers], bytes between engine blocks
    kv_parts: int
    num_blocks: int
    page_bytes: int

    @classmethod
    def of(cls, view: GpuKvView) -> "LayerAddressing":
        base, part, block = [], [], []
        for layer in view.layers:
            pages = layer.pages  # uint8, so strides are in bytes
            base.append(pages.data_ptr())
            part.append(pages.stride(0))
            block.append(pages.stride(1))
        return cls(
            base=np.asarray(base, dtype=np.int64),
            part_stride=np.asarray(part, dtype=np.int64),
            block_stride=np.asarray(block, dtype=np.int64),
            kv_parts=view.kv_parts,
            num_blocks=view.num_blocks,
            page_bytes=view.page_bytes,
        )

    @property
    def num_layers(self) -> int:
        return int(self.base.shape[0])

    def vector_width(self) -> int:
        """Widest power-of-two access (<= 16 bytes) that every page address and size allows."""
        width = 16
        values = [self.page_bytes, *self.base.tolist(), *self.part_stride.tolist(),
                  *self.block_stride.tolist()]
        for v in values:
            while width > 1 and int(v) % width:
                width //= 2
        return width

    def page_table(self, engine_ids: np.ndarray, engine_blocks_per_block: int) -> np.ndarray:
        """Address of every page of the job, in slot order (int64, flat).

        ``engine_ids`` holds ``engine_blocks_per_block`` ids per kvtier block, in order.
        """
        ids = np.asarray(engine_ids, dtype=np.int64).reshape(-1, engine_blocks_per_block)
        parts = np.arange(self.kv_parts, dtype=np.int64)
        table = (
            self.base[None, :, None, None]
            + parts[None, None, :, None] * self.part_stride[None, :, None, None]
            + ids[:, None, None, :] * self.block_stride[None, :, None, None]
        )  # [blocks, layers, kv_parts, engine_blocks_in_block]
        return np.ascontiguousarray(table).reshape(-1)


@dataclass(frozen=True)
class HostRun:
    """``nbytes`` of the job's byte stream starting at ``job_offset`` live contiguously in
    ``chunk`` (a pinned pool chunk, flat uint8) from ``chunk_offset`` on."""

    job_offset: int
    nbytes: int
    chunk: torch.Tensor
    chunk_offset: int


def host_runs(pool: CpuBlockPool, slots: Sequence[int]) -> list[HostRun]:
    """Group the job's slots into runs of neighbouring slots in one pool chunk.

    Vectorised (a job can hold thousands of slots and this runs before its first copy).
    Waits for a chunk that is still being allocated (the caller is a transfer thread).
    """
    block_bytes = pool.geometry.block_bytes
    s = np.asarray(slots, dtype=np.int64)
    if s.size == 0:
        return []
    chunk = s // pool.slots_per_chunk
    breaks = np.flatnonzero((s[1:] != s[:-1] + 1) | (chunk[1:] != chunk[:-1])) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), int(s.size)]
    flats: dict[int, torch.Tensor] = {}
    runs: list[HostRun] = []
    for a, b in zip(starts, ends):
        first = pool.slot(int(s[a]))  # range-checked; waits for its chunk
        c = int(chunk[a])
        flat = flats.get(c)
        if flat is None:  # the whole chunk as one flat tensor (no copy)
            flat = flats[c] = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        runs.append(HostRun(a * block_bytes, (b - a) * block_bytes, flat,
                            first.data_ptr() - flat.data_ptr()))
    return runs


@dataclass(frozen=True)
class Segment:
    """One DMA request: ``nbytes`` between staging offset ``stage_offset`` and host memory."""

    stage_offset: int
    nbytes: int
    chunk: torch.Tensor
    chunk_offset: int

    def host_ptr(self) -> int:
        return self.chunk.data_ptr() + self.chunk_offset


def segments_for_range(runs: Sequence[HostRun], begin: int, end: int, first_run: int = 0
                       ) -> tuple[list[Segment], int]:
    """DMA requests covering job bytes ``[begin, end)``, staged from staging offset 0.

    Returns the segments and the index of the run holding ``end`` (to resume the next range
    there: chunks are visited in order, so the walk over runs is linear overall).
    """
    out: list[Segment] = []
    i = first_run
    while i < len(runs) and runs[i].job_offset + runs[i].nbytes <= begin:
        i += 1
    while i < len(runs) and runs[i].job_offset < end:
        r = runs[i]
        lo = max(begin, r.job_offset)
        hi = min(end, r.job_offset + r.nbytes)
        out.append(Segment(lo - begin, hi - lo, r.chunk, r.chunk_offset + lo - r.job_offset))
        if hi == end:
            break
        i += 1
    return out, i


def validate_job(view: GpuKvView | LayerAddressing, pool: CpuBlockPool,
                 engine_ids: Sequence[int], slots: Sequence[int], *, to_gpu: bool) -> int:
    """Check a job's addresses (``ValueError`` on any bad one); returns engine_blocks_per_block.
    ``view``: the KV view, or its addressing (the same four sizes are read).

    A destination named twice in one job would end up holding whichever copy ran last, so a
    load refuses duplicate engine ids and a store duplicate slots.
    """
    geo = pool.geometry
    if (geo.num_layers, geo.kv_parts, geo.page_bytes) != (
        view.num_layers, view.kv_parts, view.page_bytes
    ):
        raise ValueError(
            f"CPU pool geometry ({geo.describe()}) does not match the GPU KV view "
            f"({view.num_layers} layers x {view.kv_parts} kv x {view.page_bytes} B pages)"
        )
    per = geo.engine_blocks_per_block
    if len(engine_ids) != len(slots) * per:
        raise ValueError(
            f"{len(engine_ids)} engine block ids for {len(slots)} CPU slots; expected "
            f"{per} ids per slot"
        )
    ids = np.asarray(engine_ids, dtype=np.int64)
    sl = np.asarray(slots, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= view.num_blocks)]
    if bad.size:
        raise ValueError(f"engine block ids {bad[:8].tolist()} out of range [0, {view.num_blocks})")
    bad = sl[(sl < 0) | (sl >= pool.num_slots)]
    if bad.size:
        raise ValueError(f"CPU slots {bad[:8].tolist()} out of range [0, {pool.num_slots})")
    if to_gpu and np.unique(ids).size != ids.size:
        raise ValueError("duplicate destination engine block ids in one load")
    if not to_gpu and np.unique(sl).size != sl.size:
        raise ValueError("duplicate destination CPU slots in one store")
    return per
