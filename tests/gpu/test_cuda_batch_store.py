"""Stores as batched DMA (``store_copy="dma"``, kvtier/transfer/cuda/batch_copy.py) on a GPU.

The same engine pages are stored by the copy kernel into one pinned pool and by the batched
DMA into another, both pools starting from the same random bytes: the two pools must end up
byte-identical (and equal to a torch-indexing reference), for a K/V-outer layout, a
block-outer one and one allocation with a block's layers side by side (where whole blocks
merge into one copy). An unpinned pool keeps stores on the kernel. Skipped without CUDA;
no timing assertions.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.transfer.cuda import CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.batch_copy import (  # noqa: E402
    BatchCopier,
    batch_copy_available,
    batch_copy_unavailable_reason,
)
from kvtier.transfer.cuda.pipeline import PagedCopier  # noqa: E402
from kvtier.transfer.engine import TransferEngine  # noqa: E402

DEV = torch.device("cuda", 0)
BLOCKS, LAYERS, PAGE = 48, 3, 8 << 10  # PAGE: bytes of one page
SLOTS = 16
needs_batch_copy = pytest.mark.skipif(not batch_copy_available(),
                                      reason=f"no batched DMA: {batch_copy_unavailable_reason()}")


def random_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=gen)


def make_view(layout: str, gen) -> GpuKvView:
    """``kv_first`` [2, blocks, page] and ``blocks_first`` [blocks, 2, page] per layer, each
    its own allocation; ``block_major``: one allocation [blocks, layers, page] with each
    layer a view (vLLM's block-outer layouts, read as ``block_pages``)."""
    if layout == "block_major":
        whole = random_bytes((BLOCKS, LAYERS, PAGE // 2), gen).view(torch.bfloat16)
        return GpuKvView({f"layer{i}": whole[:, i] for i in range(LAYERS)}, layout="block_pages")
    shape = (2, BLOCKS, PAGE // 2) if layout == "kv_first" else (BLOCKS, 2, PAGE // 2)
    caches = {f"layer{i}": random_bytes(shape, gen).view(torch.bfloat16) for i in range(LAYERS)}
    return GpuKvView(caches, layout=layout)


def reference_slots(view: GpuKvView, ids: list[int], per: int) -> torch.Tensor:
    """Expected slot bytes by torch indexing, ``[n, block_bytes]`` on the CPU."""
    idx = torch.tensor(ids, device=DEV).view(-1, per)
    rows = [torch.stack([layer.pages[:, b] for layer in view.layers]) for b in idx]
    return torch.stack(rows).reshape(len(rows), -1).cpu()


def filled_pool(view: GpuKvView, per: int, seed: int, pin: bool = True) -> CpuBlockPool:
    """A pool of ``SLOTS`` slots in chunks of 5 (a job spans chunks), random bytes from
    ``seed`` (two pools of one seed start identical)."""
    geo = view.geometry(per)
    pool = CpuBlockPool(geo, num_slots=SLOTS, pin=pin, chunk_bytes=geo.block_bytes * 5)
    pool.wait_ready()
    g = torch.Generator().manual_seed(seed)
    for s in range(SLOTS):
        pool.slot(s).copy_(torch.randint(0, 256, (geo.block_bytes,), dtype=torch.uint8,
                                         generator=g))
    return pool


def store(handler: CudaGpuToCpuHandler, ids, slots):
    return asyncio.run(handler.run(LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(slots)))


def job(per: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Engine ids (a run of neighbours, then scattered) and slots (a run across the chunk
    boundary 4 | 5, then out of order)."""
    slots = [3, 4, 5, 6, 9, 0, 1, 15, 12]
    run = 4 * per
    ids = list(range(10, 10 + run)) + rng.sample(range(10 + run, BLOCKS), (len(slots) - 4) * per)
    return ids, slots


@needs_batch_copy
@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "block_major"])
@pytest.mark.parametrize("per", [1, 2])
def test_dma_store_writes_the_same_bytes_as_the_kernel(layout, per):
    seed = sum(map(ord, layout)) * 10 + per
    gen = torch.Generator(device=DEV).manual_seed(seed)
    view = make_view(layout, gen)
    by_kernel, by_dma = filled_pool(view, per, seed), filled_pool(view, per, seed)
    kernel = CudaGpuToCpuHandler(view, by_kernel, store_copy="kernel")
    dma = CudaGpuToCpuHandler(view, by_dma, store_copy="dma")
    assert isinstance(kernel.copier, PagedCopier) and isinstance(dma.copier, BatchCopier)
    assert dma.copier.stream.priority == torch.cuda.Stream.priority_range()[0]  # the lowest
    ids, slots = job(per, random.Random(seed))
    want = reference_slots(view, ids, per)
    out_kernel, out_dma = store(kernel, ids, slots), store(dma, ids, slots)
    assert out_dma.bytes == out_kernel.bytes == len(slots) * by_dma.geometry.block_bytes
    for i, s in enumerate(slots):
        assert torch.equal(by_dma.slot(s), want[i]), f"slot {s} differs from the reference"
    for s in range(SLOTS):  # stored slots equal, the others untouched in both
        assert torch.equal(by_dma.slot(s), by_kernel.slot(s)), f"slot {s} differs"


@needs_batch_copy
def test_dma_store_waits_for_the_compute_that_writes_its_blocks():
    """The blocks are written after a long kernel on the submitting stream; the store must
    copy the final values (the batch is ordered after the handler's wait events)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    view = make_view("kv_first", gen)
    pool = filled_pool(view, 1, 5)
    handler = CudaGpuToCpuHandler(view, pool, store_copy="dma")
    ids = list(range(0, 2 * SLOTS, 2))
    final = random_bytes((LAYERS, 2, len(ids), PAGE // 2), gen)
    torch.cuda.synchronize()
    compute = torch.cuda.Stream(DEV)
    with TransferEngine([handler]) as engine, torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the writes
        for layer, new in zip(view.layers, final):
            layer.pages[:, ids] = new
        job_id = engine.submit(LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(range(SLOTS)))
        result = engine.wait([job_id], timeout=60)[0]
    assert result.ok, result.error
    want = final.permute(2, 0, 1, 3).reshape(len(ids), -1).cpu()
    for i in range(len(ids)):
        assert torch.equal(pool.slot(i), want[i]), f"slot {i} holds stale bytes"


def test_an_unpinned_pool_keeps_dma_stores_on_the_kernel():
    gen = torch.Generator(device=DEV).manual_seed(9)
    view = make_view("kv_first", gen)
    pool = filled_pool(view, 1, 9, pin=False)
    handler = CudaGpuToCpuHandler(view, pool, store_copy="dma")
    assert isinstance(handler.copier, PagedCopier)
    ids, slots = job(1, random.Random(9))
    store(handler, ids, slots)
    want = reference_slots(view, ids, 1)
    for i, s in enumerate(slots):
        assert torch.equal(pool.slot(s), want[i]), f"slot {s} differs from the reference"


def test_an_unknown_store_copy_is_refused():
    view = make_view("kv_first", torch.Generator(device=DEV).manual_seed(1))
    with pytest.raises(ValueError, match="kernel, dma"):
        CudaGpuToCpuHandler(view, filled_pool(view, 1, 1), store_copy="sm")
