"""``CpuBlockPool.slot_addresses``: the host address of each slot, vectorised, for kernels
that read pinned slots through UVA (one-launch loads) without a tensor view per slot."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=256)


@pytest.mark.parametrize("shared", [False, True])
def test_addresses_match_each_slots_bytes_across_chunks(shared):
    # 5 slots per chunk, 23 slots: 5 chunks, the last one short; allocated in the background
    pool = CpuBlockPool(GEO, num_slots=23, pin=False, chunk_bytes=5 * GEO.block_bytes,
                        shared=shared)
    rng = random.Random(3)
    slots = rng.sample(range(23), 23) + [22, 0, 0, 7]  # every chunk, repeats, both ends
    got = pool.slot_addresses(slots)
    assert got.dtype == np.int64 and got.shape == (len(slots),)
    assert got.tolist() == [pool.slot(s).data_ptr() for s in slots]
    assert pool.slot_addresses([]).shape == (0,)
    # a second call hits the cached chunk addresses and agrees
    assert pool.slot_addresses(slots).tolist() == got.tolist()


def test_bad_slots_raise_before_any_address_is_looked_up():
    pool = CpuBlockPool(GEO, num_slots=8, pin=False, chunk_bytes=4 * GEO.block_bytes)
    for bad in ([8], [0, -1], [3, 99]):
        with pytest.raises(IndexError, match="out of range"):
            pool.slot_addresses(bad)


def test_a_shared_pool_gives_its_memory_back_when_it_goes():
    """The memfd keeps the pool's memory for as long as it is open: a process that builds
    runtimes one after another (benchmarks, tests) held every earlier pool."""
    import gc
    import os

    pool = CpuBlockPool(GEO, num_slots=8, pin=False, shared=True, background=False)
    fd = pool.shared_fd
    pool.slot(3).fill_(7)
    link = os.readlink(f"/proc/self/fd/{fd}")
    assert "kvtier-cpu-pool" in link
    del pool
    gc.collect()
    try:
        now = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        now = None
    assert now != link  # closed (or the number reused by something else)
