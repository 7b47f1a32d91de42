"""CUDA transfer handlers on a real GPU: bit-exact round trips, concurrency, stream races.

Skipped without CUDA (CI); run on the lent GPU machine. No timing assertions here: speed is
measured by benchmarks/transfer_bandwidth.py.
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
from kvtier.transfer.cuda import CudaCpuToGpuHandler, CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.direct import LayeredJob  # noqa: E402
from kvtier.transfer.cuda.page_movers import cupy_available  # noqa: E402
from kvtier.transfer.engine import TransferEngine  # noqa: E402

DEV = torch.device("cuda", 0)
BACKENDS = ["cupy", "torch"] if cupy_available() else ["torch"]


def random_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=gen)


def make_caches(layout, layers, num_blocks, page_bytes, dtype, gen):
    """Per-layer tensors at unrelated addresses (a spacer allocation between layers)."""
    shape = {"kv_first": (2, num_blocks, page_bytes), "blocks_first": (num_blocks, 2, page_bytes),
             "mla": (num_blocks, 1, page_bytes)}[layout]
    caches, spacers = {}, []
    for i in range(layers):
        caches[f"model.layers.{i}.attn"] = random_bytes(shape, gen).view(dtype)
        spacers.append(torch.empty(4096 * (i + 1) + 512, dtype=torch.uint8, device=DEV))
    return caches


def reference_slots(view: GpuKvView, ids: list[int], per: int) -> torch.Tensor:
    """Expected slot bytes by torch indexing, ``[n, block_bytes]`` on the CPU."""
    idx = torch.tensor(ids, device=DEV).view(-1, per)
    rows = [torch.stack([layer.pages[:, b] for layer in view.layers]) for b in idx]
    return torch.stack(rows).reshape(len(rows), -1).cpu()  # [n, L, K, E, P] flattened


def view_and_filled_pool(gen, layers: int = 4, blocks: int = 64, page_bytes: int = 32 << 10,
                         slots: int = 32) -> tuple[GpuKvView, CpuBlockPool]:
    """``layers`` layers of ``blocks`` engine blocks (kv_first, bf16) and a pinned pool of
    ``slots`` random slots."""
    view = GpuKvView(make_caches("kv_first", layers, blocks, page_bytes, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=slots)
    pool.wait_ready()
    for s in range(slots):
        pool.slot(s).copy_(torch.randint(0, 256, (pool.geometry.block_bytes,), dtype=torch.uint8))
    return view, pool


def scrambled_destination(view, ids, num_blocks, rng, gen):
    """Engine blocks to load ``ids``' bytes into (others if there are enough free ones),
    scrambled first so a skipped page cannot pass by luck, and a copy of every other block
    (``assert_untouched``)."""
    free = [b for b in range(num_blocks) if b not in ids]
    dst = rng.sample(free, len(ids)) if len(free) >= len(ids) else ids
    for layer in view.layers:
        layer.pages[:, dst] = random_bytes((view.kv_parts, len(dst), view.page_bytes), gen)
    before = {b: [layer.pages[:, b].clone() for layer in view.layers]
              for b in range(num_blocks) if b not in dst}
    return dst, before


def assert_untouched(view, before) -> None:
    for b, pages in before.items():  # nothing else was written
        for layer, p in zip(view.layers, pages):
            assert torch.equal(layer.pages[:, b], p), f"engine block {b} was overwritten"


def case_view_and_pool(layout, dtype, page_bytes, layers, per, gen):
    """One of ``CASES``: its KV caches (40 engine blocks, 12 for pages of 1 MiB and more) and
    an empty pinned pool of 16 slots in chunks of 5. Returns (view, pool, engine blocks)."""
    num_blocks = 40 if page_bytes < (1 << 20) else 12
    view = GpuKvView(make_caches(layout, layers, num_blocks, page_bytes, dtype, gen), layout=layout)
    geo = view.geometry(per)
    pool = CpuBlockPool(geo, num_slots=16, chunk_bytes=geo.block_bytes * 5)
    pool.wait_ready()
    return view, pool, num_blocks


def run(coro):
    return asyncio.run(coro)


def staged_only(handler: CudaCpuToGpuHandler) -> CudaCpuToGpuHandler:
    """Every load of ``handler`` through the staging ring, the fallback it takes without a
    pinned pool or CuPy (and for a whole load no argument buffer can take)."""
    handler.direct = None
    handler._args = None
    handler.whole_max_bytes = 0.0
    handler.prefetch_min_bytes = None
    return handler


def load_handler(view, pool, path: str, **kw) -> CudaCpuToGpuHandler:
    """A load handler whose loads of any size take one path: ``"rule"`` (the size rule as
    shipped), ``"layered"`` (its bounds at 0: layer by layer) or ``"staged"``."""
    if path == "layered":
        kw.update(layered_min_bytes=0, whole_max_bytes=0)
    handler = CudaCpuToGpuHandler(view, pool, **kw)
    return staged_only(handler) if path == "staged" else handler


CASES = [
    # layout, dtype, page_bytes, layers, engine blocks per kvtier block
    ("kv_first", torch.bfloat16, 32 << 10, 4, 1),
    ("kv_first", torch.float16, 8 << 10, 3, 2),
    ("blocks_first", torch.bfloat16, 8 << 10, 3, 1),
    ("blocks_first", torch.float8_e4m3fn, 16 << 10, 2, 3),
    ("mla", torch.bfloat16, 18 << 10, 3, 1),  # 576-dim latent x 16 tokens
    ("mla", torch.uint8, 8 << 10 | 1, 2, 1),  # odd page size: byte-wide kernel path
    ("kv_first", torch.bfloat16, 2 << 20, 2, 1),
]


# layered: slots in two runs (one strided DMA per layer and run); scattered: slots at random
# (the layered path reads them through UVA, direct.scattered); uva: UVA forced
MODES = [("cupy", "layered"), ("cupy", "scattered"), ("cupy", "uva"), ("cupy", "staged"),
         ("torch", "staged")] if cupy_available() else [("torch", "staged")]


@pytest.mark.parametrize("backend,loads", MODES)
@pytest.mark.parametrize("layout,dtype,page_bytes,layers,per", CASES)
def test_round_trip_is_bit_exact(backend, loads, layout, dtype, page_bytes, layers, per):
    seed = hash((backend, layout, page_bytes, per)) & 0xFFFFF
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rng = random.Random(seed)
    view, pool, num_blocks = case_view_and_pool(layout, dtype, page_bytes, layers, per, gen)
    geo = pool.geometry
    # staging of a few pages (not a multiple of the block) so chunks straddle blocks and slots
    staging = max(view.page_bytes, 3 * view.page_bytes + 7)
    kw = dict(backend=backend, staging_bytes=staging, ring_slots=2, max_ctas=8)
    store = CudaGpuToCpuHandler(view, pool, **kw)
    load = load_handler(view, pool, "staged" if loads == "staged" else "layered", **kw)
    taken = []
    if load.direct is not None:  # which way the job's layers went
        real = load.direct.enqueue
        load.direct.enqueue = lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    assert (load.direct is not None) == (loads != "staged")
    copy2d = load.direct is not None and load.direct._copy2d is not None
    if loads == "uva":
        load.direct._copy2d = None
    n = min(num_blocks // per // 2, 7)
    ids = rng.sample(range(num_blocks), n * per)
    slots = rng.sample(range(16), n)
    slots[:3] = sorted(slots[:3])  # some neighbours, some not
    if loads == "layered":  # two runs of neighbouring slots
        slots = list(range(9, 9 + n // 2)) + list(range(n - n // 2))
    elif loads == "scattered":  # descending: every slot its own run
        slots = list(range(15, 15 - n, -1))
    want = reference_slots(view, ids, per)

    out = run(store.run(LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(slots)))
    assert out.bytes == n * geo.block_bytes
    for i, s in enumerate(slots):
        assert torch.equal(pool.slot(s), want[i]), f"stored slot {s} differs"

    # load into other engine blocks, after scrambling them
    dst, before = scrambled_destination(view, ids, num_blocks, rng, gen)
    out = run(load.run(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(dst)))
    assert out.bytes == n * geo.block_bytes
    if loads != "staged":
        assert [j.uva for j in taken] == [loads != "layered" or not copy2d]
    # completion was reported only after the copy finished: read on another stream, no sync
    assert torch.equal(reference_slots(view, dst, per), want)
    assert_untouched(view, before)


def test_empty_job_is_a_no_op_and_bad_jobs_raise():
    gen = torch.Generator(device=DEV).manual_seed(7)
    view = GpuKvView(make_caches("kv_first", 2, 16, 4096, torch.bfloat16, gen), layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=8)
    pool.wait_ready()
    h = CudaGpuToCpuHandler(view, pool, backend=BACKENDS[0])
    assert run(h.run(LoadStoreSpec.gpu([]), LoadStoreSpec.cpu([]))).bytes == 0
    with pytest.raises(ValueError):
        run(h.run(LoadStoreSpec.gpu([0, 99]), LoadStoreSpec.cpu([0, 1])))
    with pytest.raises(ValueError):
        run(h.run(LoadStoreSpec.cpu([0]), LoadStoreSpec.gpu([0])))  # wrong direction


def test_concurrent_loads_and_stores_through_the_engine():
    gen = torch.Generator(device=DEV).manual_seed(11)
    rng = random.Random(11)
    layers, num_blocks, page = 8, 512, 32 << 10
    view = GpuKvView(make_caches("kv_first", layers, num_blocks, page, torch.bfloat16, gen),
                     layout="kv_first")
    geo = view.geometry(1)
    pool = CpuBlockPool(geo, num_slots=256, chunk_bytes=geo.block_bytes * 64)
    pool.wait_ready()
    store = CudaGpuToCpuHandler(view, pool, staging_bytes=1 << 20)
    load = CudaCpuToGpuHandler(view, pool, staging_bytes=1 << 20)
    # first half of the slots: filled by an initial store, then loaded back while the second
    # half is being stored from other blocks
    src_a = rng.sample(range(num_blocks), 128)
    run(store.run(LoadStoreSpec.gpu(src_a), LoadStoreSpec.cpu(range(128))))
    want_a = reference_slots(view, src_a, 1)
    rest = [b for b in range(num_blocks) if b not in src_a]
    src_b = rng.sample(rest, 128)
    dst_a = [b for b in rest if b not in src_b][:128]
    want_b = reference_slots(view, src_b, 1)
    with TransferEngine([store, load]) as engine:
        jobs = []
        for j in range(16):  # 16 interleaved jobs per direction, 8 blocks each
            sl = slice(8 * j, 8 * (j + 1))
            jobs.append(engine.submit(LoadStoreSpec.gpu(src_b[sl]),
                                      LoadStoreSpec.cpu(range(128 + 8 * j, 136 + 8 * j))))
            jobs.append(engine.submit(LoadStoreSpec.cpu(range(8 * j, 8 * j + 8)),
                                      LoadStoreSpec.gpu(dst_a[sl])))
        results = engine.wait(jobs, timeout=60)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert torch.equal(reference_slots(view, dst_a, 1), want_a)
    for i in range(128):
        assert torch.equal(pool.slot(128 + i), want_b[i])


@pytest.mark.parametrize("hook", ["caller_stream", "construction_stream"])
def test_store_waits_for_the_compute_that_writes_its_blocks(hook):
    """The model writes the blocks after a long kernel on the compute stream; the store is
    submitted right away (on that stream, or from another stream while the handler was built
    on the compute stream). It must copy the final values, not what was there before."""
    gen = torch.Generator(device=DEV).manual_seed(13)
    view = GpuKvView(make_caches("kv_first", 4, 64, 32 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=32)
    pool.wait_ready()
    compute = torch.cuda.Stream(DEV)
    with torch.cuda.stream(compute):
        store = CudaGpuToCpuHandler(view, pool, staging_bytes=1 << 20)
    ids = list(range(0, 64, 2))
    final = random_bytes((len(view.layers), 2, len(ids), view.page_bytes), gen)
    torch.cuda.synchronize()
    src, dst = LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(range(32))
    with TransferEngine([store]) as engine:
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the writes
            for layer, new in zip(view.layers, final):
                layer.pages[:, ids] = new
            if hook == "caller_stream":
                job = engine.submit(src, dst)
        if hook == "construction_stream":
            job = engine.submit(src, dst)
        result = engine.wait([job], timeout=60)[0]
    assert result.ok, result.error
    want = final.permute(2, 0, 1, 3).reshape(len(ids), -1).cpu()
    for i in range(len(ids)):
        assert torch.equal(pool.slot(i), want[i]), f"slot {i} holds stale bytes"


def test_load_waits_for_the_submitting_stream_before_overwriting_pages():
    """Pages still read by earlier compute are overwritten only after that compute ran."""
    gen = torch.Generator(device=DEV).manual_seed(17)
    view = GpuKvView(make_caches("kv_first", 2, 16, 8 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=4)
    pool.wait_ready()
    load = CudaCpuToGpuHandler(view, pool)
    for s in range(4):
        pool.slot(s).copy_(torch.randint(0, 256, (pool.geometry.block_bytes,), dtype=torch.uint8))
    ids = [3, 5, 7, 9]
    compute = torch.cuda.Stream(DEV)
    snapshot = torch.empty((2, 2, 4, view.page_bytes), dtype=torch.uint8, device=DEV)
    old = torch.stack([layer.pages[:, ids] for layer in view.layers])
    torch.cuda.synchronize()
    src, dst = LoadStoreSpec.cpu(range(4)), LoadStoreSpec.gpu(ids)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)
        for i, layer in enumerate(view.layers):  # the "old" reader of those pages
            snapshot[i] = layer.pages[:, ids]
        pending = load.start(src, dst)
    load.finish(pending)
    compute.synchronize()
    assert torch.equal(snapshot, old), "load overwrote pages before earlier compute read them"


def test_fence_orders_the_callers_next_kernel_after_the_load():
    """A forward enqueued after ``fence`` reads the loaded bytes, though the host never waited
    for the copy (the copy is made slow by a long kernel the load must wait for)."""
    gen = torch.Generator(device=DEV).manual_seed(19)
    view, pool = view_and_filled_pool(gen)
    ids = list(range(1, 64, 2))
    want = torch.stack([pool.slot(s) for s in range(32)])
    compute = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with TransferEngine([CudaCpuToGpuHandler(view, pool)]) as engine:
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # the load is ordered after this
            job = engine.submit(LoadStoreSpec.cpu(range(32)), LoadStoreSpec.gpu(ids))
            engine.fence([job])
            # enqueued on `compute` after the fence; stays on the GPU (no host sync)
            seen = torch.stack([torch.stack([layer.pages[:, b] for layer in view.layers])
                                for b in ids])
        assert engine.get_finished() == []  # the host went on while the copy waits
        result = engine.wait([job], timeout=60)[0]
        compute.synchronize()
    assert result.ok and result.seconds > 0
    assert torch.equal(seen.reshape(len(ids), -1).cpu(), want), \
        "a kernel after fence() read pages before the load"


@pytest.mark.skipif(not cupy_available(), reason="layer-by-layer loads need CuPy")
@pytest.mark.parametrize("uva", [False, True])
def test_fence_layer_orders_a_kernel_after_that_layers_pages_only(uva):
    """After ``fence_layer(job, l)`` a kernel reading layer ``l`` sees the loaded bytes while the
    host never waited; each layer has its own completion event."""
    gen = torch.Generator(device=DEV).manual_seed(23)
    view, pool = view_and_filled_pool(gen)
    ids = list(range(1, 64, 2))
    want = torch.stack([pool.slot(s) for s in range(32)]).view(32, 4, -1)  # [block, layer, ..]
    handler = load_handler(view, pool, "layered")
    if uva:  # the fallback: the kernel reads the pinned slots through their UVA addresses
        handler.direct._copy2d = None
    else:
        assert handler.direct._copy2d is not None, "CuPy's 2-D copy should be used"
    compute = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with TransferEngine([handler]) as engine:
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # the load is ordered after this
            job = engine.submit(LoadStoreSpec.cpu(range(32)), LoadStoreSpec.gpu(ids))
            seen = []
            for layer in range(4):
                engine.fence_layer([job], layer)
                seen.append(torch.stack([view.layers[layer].pages[:, b] for b in ids]))
        assert engine.get_finished() == []  # the host went on while the copy waits
        pending = engine._immediate.running[job].pending  # the handler's handle of the job
        assert len(pending.job.layer_done) == 4
        result = engine.wait([job], timeout=60)[0]
        compute.synchronize()
    assert result.ok and result.bytes == 32 * pool.geometry.block_bytes
    for layer in range(4):
        assert torch.equal(seen[layer].reshape(32, -1).cpu(), want[:, layer]), \
            f"layer {layer} was read before its pages were loaded"


def test_layered_loads_need_a_pinned_pool_else_loads_are_staged():
    gen = torch.Generator(device=DEV).manual_seed(29)
    view = GpuKvView(make_caches("kv_first", 2, 8, 8 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=4, pin=False)
    pool.wait_ready()
    load = CudaCpuToGpuHandler(view, pool, layered_min_bytes=0)
    assert load.direct is None and load._args is None and load.whole_max_bytes == 0
    assert load.prefetch_min_bytes is None
    with pytest.raises(ValueError, match="pinned"):
        load._layered(None)


@pytest.mark.skipif(not cupy_available(), reason="layered loads need CuPy")
def test_the_rule_loads_small_jobs_whole_and_large_ones_layer_by_layer():
    """A load under ``layered_min_bytes`` (LAYERED_MIN_BYTES as shipped) goes whole (one
    launch, else staged: a layered job costs the host a fixed amount per layer whatever its
    size), a larger one layer by layer; both land bit-exact."""
    from kvtier.transfer.cuda import handlers

    gen = torch.Generator(device=DEV).manual_seed(31)
    view = GpuKvView(make_caches("kv_first", 4, 16, 8 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=8)
    pool.wait_ready()
    block = pool.geometry.block_bytes
    store = CudaGpuToCpuHandler(view, pool)
    load = CudaCpuToGpuHandler(view, pool, layered_min_bytes=4 * block)
    assert load.direct is not None and load.layered_min_bytes == 4 * block
    want = reference_slots(view, list(range(8)), 1)
    run(store.run(LoadStoreSpec.gpu(range(8)), LoadStoreSpec.cpu(range(8))))
    for n, layered in ((3, False), (4, True)):
        dst = list(range(8, 8 + n))
        pending = load.start(LoadStoreSpec.cpu(range(n)), LoadStoreSpec.gpu(dst))
        assert isinstance(pending.job, LayeredJob) == layered, n
        load.finish(pending)
        assert torch.equal(reference_slots(view, dst, 1), want[:n])
    shipped = CudaCpuToGpuHandler(view, pool)
    assert shipped.layered_min_bytes == handlers.LAYERED_MIN_BYTES
    assert shipped.whole_max_bytes == handlers.WHOLE_ONE_LAUNCH_MAX_BYTES


@pytest.mark.parametrize("loads", ["rule", "layered", "staged"])
def test_a_load_queued_behind_compute_reports_the_copy_time_not_the_wait(loads):
    """The seconds a load reports feed the cost model's bandwidth; a load queued behind a long
    forward must not report the forward's time (the model would then find CPU hits slower
    than recomputing them and skip them: the trace replay saw 27k blocks skipped)."""
    gen = torch.Generator(device=DEV).manual_seed(23)
    view = GpuKvView(make_caches("kv_first", 2, 16, 8 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=4)
    pool.wait_ready()
    load = load_handler(view, pool, loads)
    compute = torch.cuda.Stream(DEV)
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        before.record(compute)
        torch.cuda._sleep(400_000_000)  # the "forward" the load is ordered after
        after.record(compute)
        pending = load.start(LoadStoreSpec.cpu(range(4)), LoadStoreSpec.gpu([2, 4, 6, 8]))
    out = load.finish(pending)
    compute.synchronize()
    wait_s = before.elapsed_time(after) / 1e3
    assert out.bytes == 4 * pool.geometry.block_bytes
    assert 0 < out.seconds < wait_s / 4, (out.seconds, wait_s)


@pytest.mark.parametrize("loads", ["rule", "layered", "staged"])
def test_shared_pool_round_trip_through_the_disk_process_is_bit_exact(tmp_path, loads):
    """The default disk configuration: the CPU pool is a memfd registered with CUDA (not
    torch's pinned allocator) and a child process writes and reads it. GPU -> CPU -> disk
    (child) -> other CPU slots -> GPU must land bit-exact in every load mode, and the
    registered memory must count as pinned (else copies silently turn synchronous)."""
    from kvtier.config.schema import DiskTierConfig
    from kvtier.tiers.disk.io.process import DiskProcess

    if loads != "staged" and not cupy_available():
        pytest.skip("layered loads need CuPy")
    gen = torch.Generator(device=DEV).manual_seed(47)
    view = GpuKvView(make_caches("kv_first", 4, 16, 8 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=16, shared=True)
    pool.wait_ready()
    assert pool.pin and pool.slot(0).is_pinned() and pool.shared_fd is not None
    want = reference_slots(view, list(range(6)), 1)
    run(CudaGpuToCpuHandler(view, pool).run(LoadStoreSpec.gpu(range(6)),
                                            LoadStoreSpec.cpu(range(6))))
    disk = DiskProcess(pool, DiskTierConfig(path=tmp_path / "disk", capacity=1 << 30),
                       view.geometry(1))
    try:
        keys = [bytes([i]) * 32 for i in range(6)]
        disk.put_slots(list(range(6)), keys)
        assert disk.fetch_slots(keys, list(range(8, 14))) == ([], [])
    finally:
        disk.close()
    load = load_handler(view, pool, loads)
    run(load.run(LoadStoreSpec.cpu(range(8, 14)), LoadStoreSpec.gpu(range(10, 16))))
    torch.cuda.synchronize()
    assert torch.equal(reference_slots(view, list(range(10, 16)), 1), want)


@pytest.mark.skipif(not cupy_available(), reason="layered loads need CuPy")
def test_a_prefetched_load_lands_bit_exact_and_unused_prefetches_give_their_buffers_back():
    """kvtier.transfer.cuda.direct.Prefetch: a load's first pieces DMA'd into the staging ring before
    its engine blocks are known are scattered by the load of exactly those slots; a load of
    other slots, a small (whole) load or an explicit drop gives them back, and every later load still
    lands bit-exact (the ring's buffers stay in order). Pieces are smaller than a layer here,
    so a prefetch ends inside one and the ring wraps."""
    from kvtier.manager.specs import Medium

    gen = torch.Generator(device=DEV).manual_seed(37)
    view, pool = view_and_filled_pool(gen)
    layer_bytes = pool.geometry.block_bytes // 4
    load = load_handler(view, pool, "layered", staging_bytes=3 * layer_bytes, ring_slots=2)
    assert load.direct._copy2d is not None and load.prefetch_min_bytes == 1
    load.layered_min_bytes = 3 * pool.geometry.block_bytes  # 2-slot loads go whole
    rng = random.Random(37)

    def landed(slots, dst):
        want = torch.stack([pool.slot(s) for s in slots]).view(len(slots), 4, -1)
        for layer in range(4):
            got = torch.stack([view.layers[layer].pages[:, b] for b in dst])
            assert torch.equal(got.reshape(len(dst), -1).cpu(), want[:, layer]), layer
        return True

    a, b = list(range(20, 30)), list(range(2, 12))
    cases = [("used", a, a), ("other slots", a, b), ("small", a, [5, 6]),
             ("dropped", a, a), ("used after drops", a, a), ("other slots", b, a)]
    with TransferEngine([load]) as engine:
        for name, hinted, slots in cases:
            dst = rng.sample(range(64), len(slots))
            for layer in view.layers:  # scrambled: a skipped piece cannot pass by luck
                layer.pages[:, dst] = random_bytes((2, len(dst), view.page_bytes), gen)
            before = dict(load.prefetches)
            assert engine.prefetch(LoadStoreSpec.cpu(hinted), Medium.GPU)
            if name == "dropped":
                engine.drop_prefetches()
            job = engine.submit(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(dst))
            result = engine.wait([job], timeout=60)[0]
            assert result.ok and result.bytes == len(slots) * pool.geometry.block_bytes, name
            assert landed(slots, dst), name
            used = load.prefetches["used"] - before["used"]
            dropped = load.prefetches["dropped"] - before["dropped"]
            assert (used, dropped) == ((1, 0) if name.startswith("used") else (0, 1)), name
    assert engine.prefetch_min_bytes(Medium.CPU, Medium.GPU) == 1
    assert engine.prefetch_min_bytes(Medium.GPU, Medium.CPU) is None
