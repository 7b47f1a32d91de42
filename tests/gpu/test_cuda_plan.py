"""The CUDA path's address arithmetic, checked on CPU tensors (runs without a GPU).

The page table and the DMA segments are plain integers, so a copy can be emulated with raw
memory reads/writes on CPU tensors: gather pages by address into a staging buffer chunk by chunk,
then write each segment to its host address. The slots must end up byte-identical to a torch
indexing reference, for every layout, odd page sizes and staging sizes that cut blocks.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer.cuda.plan import LayerAddressing, host_runs, segments_for_range, validate_job


def make_caches(layout: str, layers: int, num_blocks: int, page_bytes: int, dtype, seed: int):
    """Random per-layer KV tensors, each its own allocation, pages of ``page_bytes``."""
    g = torch.Generator().manual_seed(seed)
    shape = {"kv_first": (2, num_blocks, page_bytes), "blocks_first": (num_blocks, 2, page_bytes),
             "mla": (num_blocks, 1, page_bytes)}[layout]
    caches = {}
    for i in range(layers):
        raw = torch.randint(0, 255, shape, dtype=torch.uint8, generator=g)
        caches[f"layer{i}"] = raw.view(dtype)
    return caches


def reference_slot(view: GpuKvView, ids: list[int]) -> bytes:
    parts = []
    for layer in view.layers:
        for k in range(view.kv_parts):
            for e in ids:
                parts.append(layer.pages[k, e].numpy().tobytes())
    return b"".join(parts)


def emulate_store(view, pool, gpu_ids, slots, staging_bytes):
    per = validate_job(view, pool, gpu_ids, slots, to_gpu=False)
    table = LayerAddressing.of(view).page_table(np.asarray(gpu_ids), per)
    page = view.page_bytes
    runs = host_runs(pool, slots)
    ppc = max(1, staging_bytes // page)
    stage = (ctypes.c_char * (ppc * page))()
    r = 0
    for p0 in range(0, len(table), ppc):
        p1 = min(len(table), p0 + ppc)
        for j, addr in enumerate(table[p0:p1]):
            ctypes.memmove(ctypes.addressof(stage) + j * page, int(addr), page)
        segs, r = segments_for_range(runs, p0 * page, p1 * page, r)
        assert sum(s.nbytes for s in segs) == (p1 - p0) * page
        for s in segs:
            ctypes.memmove(s.host_ptr(), ctypes.addressof(stage) + s.stage_offset, s.nbytes)


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "mla"])
@pytest.mark.parametrize("dtype,page_bytes", [(torch.bfloat16, 128), (torch.uint8, 63)])
@pytest.mark.parametrize("staging_pages", [1, 5, 64])
def test_emulated_store_matches_reference(layout, dtype, page_bytes, staging_pages):
    rng = random.Random(hash((layout, page_bytes, staging_pages)) & 0xFFFF)
    caches = make_caches(layout, layers=3, num_blocks=40, page_bytes=page_bytes, dtype=dtype,
                         seed=rng.randrange(1 << 30))
    view = GpuKvView(caches, layout=layout)
    per = 2
    geo = view.geometry(per)
    pool = CpuBlockPool(geo, num_slots=23, pin=False, chunk_bytes=geo.block_bytes * 4,
                        background=False)
    n = 9
    gpu_ids = rng.sample(range(view.num_blocks), n * per)
    slots = [3, 4, 5, 6, 9, 0, 1, 22, 13]  # runs inside a chunk, across chunks, out of order
    emulate_store(view, pool, gpu_ids, slots, staging_pages * view.page_bytes)
    for i, s in enumerate(slots):
        want = reference_slot(view, gpu_ids[i * per:(i + 1) * per])
        assert pool.slot(s).numpy().tobytes() == want, f"slot {s}"


def test_vector_width_follows_alignment():
    caches = make_caches("mla", layers=2, num_blocks=4, page_bytes=63, dtype=torch.uint8, seed=1)
    assert LayerAddressing.of(GpuKvView(caches, layout="mla")).vector_width() == 1
    caches = make_caches("kv_first", layers=2, num_blocks=4, page_bytes=128, dtype=torch.bfloat16,
                         seed=1)
    assert LayerAddressing.of(GpuKvView(caches, layout="kv_first")).vector_width() == 16


def test_host_runs_merge_only_neighbouring_slots_of_one_chunk():
    caches = make_caches("kv_first", layers=1, num_blocks=8, page_bytes=16, dtype=torch.uint8, seed=2)
    view = GpuKvView(caches, layout="kv_first")
    geo = view.geometry(1)
    pool = CpuBlockPool(geo, num_slots=8, pin=False, chunk_bytes=geo.block_bytes * 3,
                        background=False)
    runs = host_runs(pool, [0, 1, 2, 3, 4, 7, 6])
    lengths = [r.nbytes // geo.block_bytes for r in runs]
    assert lengths == [3, 2, 1, 1]  # chunk boundary after slot 2; 7 -> 6 is not ascending
    assert [r.job_offset // geo.block_bytes for r in runs] == [0, 3, 5, 6]


@pytest.mark.parametrize("bad", [
    dict(gpu=[0, 1, 2], slots=[0, 1]),  # wrong id count
    dict(gpu=[0, 99], slots=[0]),  # engine id out of range
    dict(gpu=[0, 1], slots=[8]),  # slot out of range
])
def test_validate_job_rejects_bad_addresses(bad):
    caches = make_caches("kv_first", layers=1, num_blocks=8, page_bytes=16, dtype=torch.uint8, seed=3)
    view = GpuKvView(caches, layout="kv_first")
    pool = CpuBlockPool(view.geometry(2), num_slots=8, pin=False, background=False)
    with pytest.raises(ValueError):
        validate_job(view, pool, bad["gpu"], bad["slots"], to_gpu=False)


def test_validate_job_rejects_duplicate_destinations():
    caches = make_caches("kv_first", layers=1, num_blocks=8, page_bytes=16, dtype=torch.uint8, seed=4)
    view = GpuKvView(caches, layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=8, pin=False, background=False)
    with pytest.raises(ValueError, match="duplicate"):
        validate_job(view, pool, [1, 1], [0, 1], to_gpu=True)
    with pytest.raises(ValueError, match="duplicate"):
        validate_job(view, pool, [1, 2], [3, 3], to_gpu=False)
    validate_job(view, pool, [1, 1], [0, 1], to_gpu=False)  # a store may read a page twice
