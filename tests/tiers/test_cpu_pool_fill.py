"""``CpuBlockPool(fill="on_start")``: only the first chunk is allocated until ``start_filling``
(vLLM's start-up must not wait for page-locking), and anything that needs a later chunk before
then starts the filling itself and gets its bytes: nothing waits for a signal that never
comes, nothing written is lost."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvtier.manager.specs import LoadStoreSpec as Spec
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.transfer import TransferEngine
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler

SAFETY = 20.0
GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=256)
PER_CHUNK = 4


def deferred(num_slots: int = 4 * PER_CHUNK + 1, *, shared: bool = False) -> CpuBlockPool:
    """Five chunks (the last one short), only the first allocated until started."""
    return CpuBlockPool(GEO, num_slots, pin=False, chunk_bytes=PER_CHUNK * GEO.block_bytes,
                        shared=shared, fill="on_start")


@pytest.mark.parametrize("shared", [False, True])
def test_only_the_first_chunk_until_started(shared):
    pool = deferred(shared=shared)
    first = PER_CHUNK * GEO.block_bytes
    time.sleep(0.2)  # a fill="now" pool of this size is complete well within this
    assert pool.allocated_bytes == first
    assert not pool.filling
    assert pool.slot(PER_CHUNK - 1).numel() == GEO.block_bytes  # the first chunk serves at once
    assert not pool.filling
    assert pool.start_filling("test") is True
    assert pool.start_filling("again") is False  # once only
    assert pool.wait_ready(SAFETY)
    assert pool.allocated_bytes == pool.capacity_bytes


def test_fill_now_starts_at_construction():
    pool = CpuBlockPool(GEO, 4 * PER_CHUNK + 1, pin=False,
                        chunk_bytes=PER_CHUNK * GEO.block_bytes)
    assert pool.filling
    assert pool.start_filling("test") is False
    assert pool.wait_ready(SAFETY)
    assert pool.allocated_bytes == pool.capacity_bytes


def test_wait_ready_starts_the_filling():
    pool = deferred()
    assert pool.wait_ready(SAFETY)
    assert pool.allocated_bytes == pool.capacity_bytes


@pytest.mark.parametrize("shared", [False, True])
def test_a_copy_into_a_later_chunk_starts_the_filling_and_lands(shared):
    pool = deferred(shared=shared)
    last = pool.num_slots - 1
    data = torch.randint(0, 256, (GEO.block_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    done = threading.Event()

    def copy() -> None:  # as a transfer thread would, before any start-up signal
        pool.slot(last).copy_(data)
        done.set()

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    assert done.wait(SAFETY), "a copy into a chunk not allocated yet never finished"
    assert pool.filling
    assert torch.equal(pool.slot(last), data)
    assert pool.slot_addresses([last]).tolist() == [pool.slot(last).data_ptr()]
    assert pool.wait_ready(SAFETY)
    assert torch.equal(pool.slot(last), data)  # the rest of the filling leaves it alone


def test_stores_before_the_signal_round_trip_bit_exact():
    """A store submitted before ``start_filling`` into slots of every chunk neither deadlocks
    nor loses a byte: it starts the filling, waits on the transfer thread, and loads back."""
    blocks = 12
    gen = torch.Generator().manual_seed(7)
    src = {f"layer.{i}": torch.randint(0, 256, (2, blocks, 4, 2, 16), dtype=torch.uint8,
                                       generator=gen).view(torch.float16) for i in range(2)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    src_view, dst_view = GpuKvView(src, "kv_first"), GpuKvView(dst, "kv_first")
    geometry = src_view.geometry(1)
    pool = CpuBlockPool(geometry, 4 * PER_CHUNK + 1, pin=False,
                        chunk_bytes=PER_CHUNK * geometry.block_bytes, fill="on_start")
    rng = random.Random(3)
    slots = [pool.num_slots - 1] + rng.sample(range(pool.num_slots - 1), blocks - 1)
    gpu_ids = list(range(blocks))
    assert not pool.filling
    with TransferEngine([GpuToCpuHandler(src_view, pool), CpuToGpuHandler(dst_view, pool)]) as eng:
        [store] = eng.wait([eng.submit(Spec.gpu(gpu_ids), Spec.cpu(slots))], SAFETY)
        assert store.ok, store.error
        assert pool.filling
        [load] = eng.wait([eng.submit(Spec.cpu(slots), Spec.gpu(gpu_ids))], SAFETY)
        assert load.ok, load.error
    for name in src:
        assert torch.equal(dst[name].view(torch.uint8), src[name].view(torch.uint8))


def test_bad_fill_is_refused():
    with pytest.raises(ValueError, match="fill must be one of"):
        CpuBlockPool(GEO, 8, pin=False, fill="later")
    with pytest.raises(ValueError, match="needs background=True"):
        CpuBlockPool(GEO, 8, pin=False, fill="on_start", background=False)


def test_a_one_chunk_pool_is_complete_at_once():
    pool = CpuBlockPool(GEO, PER_CHUNK, pin=False, chunk_bytes=PER_CHUNK * GEO.block_bytes,
                        fill="on_start")
    assert pool.filling and pool.allocated_bytes == pool.capacity_bytes
    assert pool.start_filling("test") is False
