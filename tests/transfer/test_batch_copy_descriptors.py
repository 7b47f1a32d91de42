"""The batched-DMA store's descriptors (kvtier/transfer/cuda/batch_copy.py), without a GPU.

Engine addresses are plain integers (a fake ``LayerAddressing``); slots are a real CPU pool's.
Every page of a job must land at its slot offset and engine address; descriptors are merged
exactly where pages follow each other on both sides inside one allocation; bad jobs are
refused as ``validate_job`` refuses them. The driver binding's retry and error paths run
against a fake driver library.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry
from kvtier.transfer.cuda import batch_copy
from kvtier.transfer.cuda.batch_copy import (
    DescriptorWorkspace,
    _Driver,
    _MemcpyAttributes,
    batch_copy_available,
    batch_copy_unavailable_reason,
)
from kvtier.transfer.cuda.handlers import dma_store_blocker
from kvtier.transfer.cuda.plan import LayerAddressing, validate_job

PAGE = 64
BLOCKS = 32  # engine blocks
GiB = 1 << 30


def fake_addressing(layout: str, layers: int) -> tuple[LayerAddressing, list[int] | None]:
    """Addresses of a layout (integers, no memory) and its layers' allocations (None: each
    layer its own). Separate layers lie 1 GiB apart; ``block_major`` is one allocation with
    a block's layers side by side (vLLM's block-outer layouts)."""
    kv = 1 if layout in ("mla", "block_major") else 2
    spread = 1 << 40
    if layout == "kv_first":  # [kv, block, page] per layer
        part, block, base = BLOCKS * PAGE, PAGE, [spread + i * GiB for i in range(layers)]
    elif layout == "blocks_first":  # [block, kv, page] per layer
        part, block, base = PAGE, 2 * PAGE, [spread + i * GiB for i in range(layers)]
    elif layout == "mla":
        part, block, base = 0, PAGE, [spread + i * GiB for i in range(layers)]
    else:  # block_major: [block, layer, page], one allocation
        part, block, base = 0, layers * PAGE, [spread + i * PAGE for i in range(layers)]
    a = LayerAddressing(base=np.asarray(base, dtype=np.int64),
                        part_stride=np.full(layers, part, dtype=np.int64),
                        block_stride=np.full(layers, block, dtype=np.int64),
                        kv_parts=kv, num_blocks=BLOCKS, page_bytes=PAGE)
    return a, ([7] * layers if layout == "block_major" else None)


def pool_for(a: LayerAddressing, per: int, slots: int = 12, chunk_slots: int = 3,
             shared: bool = False) -> CpuBlockPool:
    geo = BlockGeometry(num_layers=a.num_layers, kv_parts=a.kv_parts,
                        engine_blocks_per_block=per, page_bytes=PAGE)
    return CpuBlockPool(geo, slots, pin=False, chunk_bytes=chunk_slots * geo.block_bytes,
                        background=False, shared=shared)


def reference_pages(a, pool, ids, slots, allocations):
    """Every page of a job in slot order, the way the kernels address it: (engine address,
    host address, engine allocation, pool chunk)."""
    per = pool.geometry.engine_blocks_per_block
    alloc = list(range(a.num_layers)) if allocations is None else allocations
    pages = []
    for i, s in enumerate(slots):
        slot = pool.slot(s).data_ptr()
        for l in range(a.num_layers):
            for k in range(a.kv_parts):
                for e in range(per):
                    engine_id = ids[i * per + e]
                    gpu = int(a.base[l] + k * a.part_stride[l] + engine_id * a.block_stride[l])
                    host = slot + ((l * a.kv_parts + k) * per + e) * PAGE
                    pages.append((gpu, host, alloc[l], s // pool.slots_per_chunk))
    return pages


def reference_merge(pages, to_gpu):
    """(dst, src, size) with neighbours merged by a plain loop."""
    out, last = [], None
    for gpu, host, alloc, chunk in pages:
        dst, src = (gpu, host) if to_gpu else (host, gpu)
        if (last is not None and (alloc, chunk) == last and dst == out[-1][0] + out[-1][2]
                and src == out[-1][1] + out[-1][2]):
            out[-1][2] += PAGE
        else:
            out.append([dst, src, PAGE])
        last = (alloc, chunk)
    return [tuple(d) for d in out]


def listed(batch):
    assert batch.dst.dtype == batch.src.dtype == batch.sizes.dtype == np.uint64
    return list(zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()))


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "mla", "block_major"])
@pytest.mark.parametrize("per", [1, 2])
@pytest.mark.parametrize("to_gpu", [False, True])
def test_every_page_lands_at_its_slot_offset_and_engine_address(layout, per, to_gpu):
    rng = random.Random(f"{layout}-{per}-{to_gpu}")
    a, allocations = fake_addressing(layout, layers=3)
    pool = pool_for(a, per)
    slots = [3, 4, 5, 6, 9, 0, 1, 11, 2]  # runs in a chunk, across chunks, out of order
    ids = list(range(4, 4 + 3 * per)) + rng.sample(range(4 + 3 * per, BLOCKS), 6 * per)
    ws = DescriptorWorkspace(a, pool, allocations)
    got = listed(ws.job(ids, slots, to_gpu=to_gpu))
    pages = reference_pages(a, pool, ids, slots, allocations)
    assert got == reference_merge(pages, to_gpu)
    assert sum(size for _, _, size in got) == len(slots) * pool.geometry.block_bytes
    expanded = [(d + j, s + j) for d, s, size in got for j in range(0, size, PAGE)]
    assert expanded == [((g, h) if to_gpu else (h, g)) for g, h, _, _ in pages]


def test_coalescing_merges_exactly_the_neighbours():
    a, _ = fake_addressing("kv_first", layers=2)
    ws = DescriptorWorkspace(a, pool_for(a, per=2), None)
    sizes = ws.job([4, 5], [0], to_gpu=False).sizes.tolist()
    assert sizes == [2 * PAGE] * 4  # consecutive engine blocks: one copy per (layer, kv)
    assert ws.job([5, 4], [0], to_gpu=False).sizes.tolist() == [PAGE] * 8  # reversed: none

    a, _ = fake_addressing("blocks_first", layers=2)
    ws = DescriptorWorkspace(a, pool_for(a, per=1), None)
    assert ws.job([7], [0], to_gpu=False).sizes.tolist() == [2 * PAGE] * 2  # K and V together
    assert ws.job([7, 8], [0, 1], to_gpu=False).sizes.tolist() == [2 * PAGE] * 4

    a, shared = fake_addressing("block_major", layers=3)
    bb = 3 * PAGE
    ws = DescriptorWorkspace(a, pool_for(a, per=1), shared)
    assert ws.job([3, 4], [0, 1], to_gpu=False).sizes.tolist() == [2 * bb]  # two whole blocks
    assert ws.job([3, 4], [1, 0], to_gpu=False).sizes.tolist() == [bb, bb]  # slots reversed
    assert ws.job([3, 5], [0, 1], to_gpu=False).sizes.tolist() == [bb, bb]  # engine gap
    # layers that only happen to lie back to back are separate allocations: never spanned
    ws = DescriptorWorkspace(a, pool_for(a, per=1), None)
    assert ws.job([3, 4], [0, 1], to_gpu=False).sizes.tolist() == [PAGE] * 6


def test_neighbouring_slots_of_two_chunks_are_never_one_copy():
    """A shared pool is one mapping: slots 2 and 3 touch, but lie in two pinned chunks."""
    a, shared = fake_addressing("block_major", layers=3)
    pool = pool_for(a, per=1, shared=True)
    assert pool.slot(3).data_ptr() == pool.slot(2).data_ptr() + pool.geometry.block_bytes
    ws = DescriptorWorkspace(a, pool, shared)
    bb = pool.geometry.block_bytes
    assert ws.job([3, 4], [1, 2], to_gpu=False).sizes.tolist() == [2 * bb]
    batch = ws.job([3, 4], [2, 3], to_gpu=False)
    assert batch.sizes.tolist() == [bb, bb]
    assert batch.dst.tolist() == [pool.slot(2).data_ptr(), pool.slot(3).data_ptr()]


def test_slots_of_a_chunked_pool_get_their_chunks_addresses():
    a, _ = fake_addressing("mla", layers=2)
    pool = pool_for(a, per=1, slots=10, chunk_slots=2)
    slots = [9, 0, 5, 3, 1]  # chunks 4, 0, 2, 1, 0
    batch = DescriptorWorkspace(a, pool, None).job([1, 2, 3, 4, 5], slots, to_gpu=False)
    starts = batch.dst.tolist()[::2]  # two layers, one page each, per slot
    assert starts == [pool.slot(s).data_ptr() for s in slots]
    assert len({s // pool.slots_per_chunk for s in slots}) == 4


@pytest.mark.parametrize("ids, slots, to_gpu", [
    ([0, 1, 2], [0, 1], False),  # wrong id count
    ([0, BLOCKS], [0, 1], False),  # engine id out of range
    ([0, -1], [0, 1], False),
    ([0, 1], [0, 12], False),  # slot out of range
    ([0, 1], [3, 3], False),  # a store writing one slot twice
    ([1, 1], [0, 1], True),  # a load writing one engine block twice
])
def test_bad_jobs_are_refused_as_validate_job_refuses_them(ids, slots, to_gpu):
    a, _ = fake_addressing("kv_first", layers=2)
    pool = pool_for(a, per=1)
    with pytest.raises(ValueError) as expected:
        validate_job(a, pool, ids, slots, to_gpu=to_gpu)
    with pytest.raises(ValueError) as got:
        DescriptorWorkspace(a, pool, None).job(ids, slots, to_gpu=to_gpu)
    assert str(got.value) == str(expected.value)


def test_a_store_may_read_one_page_twice_and_a_geometry_mismatch_is_refused():
    a, _ = fake_addressing("kv_first", layers=2)
    ws = DescriptorWorkspace(a, pool_for(a, per=1), None)
    assert len(ws.job([1, 1], [0, 1], to_gpu=False).sizes) == 8
    other, _ = fake_addressing("kv_first", layers=3)
    with pytest.raises(ValueError, match="does not match"):
        DescriptorWorkspace(other, pool_for(a, per=1), None).job([1], [0], to_gpu=False)


def test_the_workspace_grows_and_is_reused():
    a, _ = fake_addressing("kv_first", layers=2)
    pool = pool_for(a, per=1)
    ws = DescriptorWorkspace(a, pool, None)
    small = ws.capacity
    ws.job(list(range(12)), list(range(12)), to_gpu=False)
    assert ws.capacity >= 12 * 4 > small
    grown, arrays = ws.capacity, ws._engine
    got = listed(ws.job([5], [7], to_gpu=True))
    assert ws.capacity == grown and ws._engine is arrays
    assert got == reference_merge(reference_pages(a, pool, [5], [7], None), True)
    assert listed(ws.job([], [], to_gpu=False)) == []


def test_attributes_struct_matches_the_driver_layout():
    assert ctypes.sizeof(_MemcpyAttributes) == 24
    offsets = [getattr(_MemcpyAttributes, f).offset
               for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")]
    assert offsets == [0, 4, 12, 20]


def test_availability_probe_never_raises():
    available = batch_copy_available()
    assert isinstance(available, bool)
    assert (batch_copy_unavailable_reason() is None) == available


def test_an_unpinned_pool_keeps_stores_on_the_kernel():
    a, _ = fake_addressing("kv_first", layers=2)
    assert "not pinned" in dma_store_blocker(pool_for(a, per=1))


class FakeLib:
    """libcuda with only the named functions (Python callables take ctypes attributes)."""

    def __init__(self, **functions):
        self.functions = functions

    def __getitem__(self, name):
        if name not in self.functions:
            raise AttributeError(name)
        return self.functions[name]


def error_name(code, out):
    out._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE", 801: b"CUDA_ERROR_NOT_SUPPORTED"}[code]
    return 0


def one_batch():
    a, _ = fake_addressing("kv_first", layers=1)
    return DescriptorWorkspace(a, pool_for(a, per=1), None).job([2], [0], to_gpu=False)


def test_a_refused_overlap_flag_is_dropped_once_and_for_all():
    calls = []

    def batch_v2(dst, src, sizes, count, attrs, idx, num_attrs, stream):
        a = attrs._obj
        calls.append((count, a.flags, a.srcAccessOrder, a.srcLocHint.type, a.dstLocHint.type,
                      num_attrs, idx[0], stream))
        return 1 if a.flags else 0

    driver = _Driver(FakeLib(cuMemcpyBatchAsync_v2=batch_v2,
                             cuGetErrorName=error_name))
    assert driver.symbol == "cuMemcpyBatchAsync_v2" and not driver.has_fail_index
    attrs = _MemcpyAttributes(1, batch_copy._MemLocation(1, 0), batch_copy._MemLocation(2, 0), 0)
    driver.memcpy_batch(one_batch(), attrs, 1234)
    driver.memcpy_batch(one_batch(), attrs, 1234)
    assert calls == [(2, 1, 1, 1, 2, 1, 0, 1234), (2, 0, 1, 1, 2, 1, 0, 1234),
                     (2, 0, 1, 1, 2, 1, 0, 1234)]


def test_the_12_8_symbol_reports_the_failing_copy_by_name():
    def batch_v1(dst, src, sizes, count, attrs, idx, num_attrs, fail, stream):
        fail._obj.value = 1
        return 801

    driver = _Driver(FakeLib(cuMemcpyBatchAsync=batch_v1, cuGetErrorName=error_name))
    assert driver.symbol == "cuMemcpyBatchAsync" and driver.has_fail_index
    with pytest.raises(RuntimeError, match=r"cuMemcpyBatchAsync of 2 copies failed at copy 1: "
                                           r"CUDA_ERROR_NOT_SUPPORTED \(801\)"):
        driver.memcpy_batch(one_batch(), _MemcpyAttributes(), 1)


def test_an_accepted_flag_is_kept_and_a_later_invalid_value_raises():
    codes = iter([0, 1])
    driver = _Driver(FakeLib(cuMemcpyBatchAsync_v2=lambda *args: next(codes)))
    driver.memcpy_batch(one_batch(), _MemcpyAttributes(), 1)
    with pytest.raises(RuntimeError, match=r"failed: CUresult 1"):
        driver.memcpy_batch(one_batch(), _MemcpyAttributes(), 1)
    assert driver.flags == batch_copy.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


def test_a_driver_without_the_batch_call_is_not_bound():
    with pytest.raises(AttributeError):
        _Driver(FakeLib(cuGetErrorName=error_name))
