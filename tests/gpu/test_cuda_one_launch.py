"""Small loads in one kernel launch (kvtier.transfer.cuda.one_launch) on a real GPU.

Bit-exact bytes in every cache layout, ordering after the submitting stream, the pinned
argument buffers reused only once the kernel that read them finished, and the staged path
taking over when no buffer is free or a job does not fit. Skipped without CUDA (CI).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.transfer.cuda import CudaCpuToGpuHandler, CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.direct import LayeredJob  # noqa: E402
from kvtier.transfer.cuda.one_launch import PinnedArgRing  # noqa: E402
from kvtier.transfer.cuda.pipeline import EnqueuedJob  # noqa: E402
from kvtier.transfer.cuda.page_movers import cupy_available  # noqa: E402

from test_cuda_transfer import (  # noqa: E402
    CASES, DEV, assert_untouched, case_view_and_pool, reference_slots, scrambled_destination,
    view_and_filled_pool)

pytestmark.append(pytest.mark.skipif(not cupy_available(), reason="one-launch loads need CuPy"))


def spy(handler: CudaCpuToGpuHandler) -> list:
    """Record what each ``enqueue_whole`` returned (None: it handed the job back)."""
    seen: list = []
    real = handler.direct.enqueue_whole
    handler.direct.enqueue_whole = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    return seen


@pytest.mark.parametrize("layout,dtype,page_bytes,layers,per", CASES)
def test_a_small_load_is_one_launch_and_bit_exact(layout, dtype, page_bytes, layers, per):
    seed = hash((layout, page_bytes, per, "one")) & 0xFFFFF
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rng = random.Random(seed)
    view, pool, num_blocks = case_view_and_pool(layout, dtype, page_bytes, layers, per, gen)
    geo = pool.geometry
    store = CudaGpuToCpuHandler(view, pool)
    load = CudaCpuToGpuHandler(view, pool)  # auto: these jobs are far under LAYERED_MIN_BYTES
    seen = spy(load)
    n = min(num_blocks // per // 2, 7)
    ids = rng.sample(range(num_blocks), n * per)
    slots = rng.sample(range(16), n)  # scattered over pool chunks
    want = reference_slots(view, ids, per)
    store.finish(store.start(LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(slots)))
    dst, before = scrambled_destination(view, ids, num_blocks, rng, gen)
    pending = load.start(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(dst))
    assert len(seen) == 1 and seen[0] is pending.job and not isinstance(pending.job, LayeredJob)
    out = load.finish(pending)
    assert out.bytes == n * geo.block_bytes and out.seconds > 0
    assert torch.equal(reference_slots(view, dst, per), want)
    assert_untouched(view, before)


def filled(gen):
    """3 layers of 32 engine blocks (8 KiB pages) and a pinned pool of 8 random slots."""
    return view_and_filled_pool(gen, layers=3, blocks=32, page_bytes=8 << 10, slots=8)


def test_an_argument_buffer_is_reused_only_after_its_kernel_ran():
    """With one buffer: a load submitted while the first one's kernel still waits (behind a
    long kernel on the submitting stream) goes through the staging ring, and both land; once
    the first finished, the buffer serves the next load."""
    gen = torch.Generator(device=DEV).manual_seed(41)
    view, pool = filled(gen)
    load = CudaCpuToGpuHandler(view, pool)
    load._args = PinnedArgRing(buffers=1, words=64)
    seen = spy(load)
    want = torch.stack([pool.slot(s) for s in range(8)])
    compute = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # both loads are ordered after this
        first = load.start(LoadStoreSpec.cpu([0, 1, 2]), LoadStoreSpec.gpu([4, 5, 6]))
        second = load.start(LoadStoreSpec.cpu([3, 4]), LoadStoreSpec.gpu([9, 10]))
    assert seen[0] is first.job and seen[1] is None, "the busy buffer was handed out again"
    assert not first.job.done.query(), "the first kernel should still be waiting"
    load.finish(first)
    load.finish(second)
    third = load.start(LoadStoreSpec.cpu([5, 6, 7]), LoadStoreSpec.gpu([20, 21, 22]))
    assert seen[2] is third.job, "the buffer was not reused after its kernel finished"
    load.finish(third)
    compute.synchronize()
    assert torch.equal(reference_slots(view, [4, 5, 6, 9, 10, 20, 21, 22], 1), want)


def test_a_job_larger_than_a_buffer_is_staged():
    gen = torch.Generator(device=DEV).manual_seed(43)
    view, pool = filled(gen)
    load = CudaCpuToGpuHandler(view, pool)
    load._args = PinnedArgRing(buffers=2, words=5)  # 2 blocks need 4 words, 3 need 6
    seen = spy(load)
    want = torch.stack([pool.slot(s) for s in range(5)])
    load.finish(load.start(LoadStoreSpec.cpu([0, 1]), LoadStoreSpec.gpu([1, 2])))
    load.finish(load.start(LoadStoreSpec.cpu([2, 3, 4]), LoadStoreSpec.gpu([7, 8, 9])))
    assert seen[0] is not None and seen[1] is None
    assert torch.equal(reference_slots(view, [1, 2, 7, 8, 9], 1), want)


def test_a_one_launch_load_waits_for_the_submitting_stream():
    """Pages that earlier compute still reads are overwritten only after it ran."""
    gen = torch.Generator(device=DEV).manual_seed(47)
    view, pool = filled(gen)
    load = CudaCpuToGpuHandler(view, pool)
    seen = spy(load)
    ids = [3, 5, 7, 9]
    old = torch.stack([layer.pages[:, ids] for layer in view.layers])
    snapshot = torch.empty_like(old)
    compute = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)
        for i, layer in enumerate(view.layers):  # the "old" reader of those pages
            snapshot[i] = layer.pages[:, ids]
        pending = load.start(LoadStoreSpec.cpu(range(4)), LoadStoreSpec.gpu(ids))
    assert seen == [pending.job]
    load.finish(pending)
    compute.synchronize()
    assert torch.equal(snapshot, old), "the load overwrote pages before earlier compute read them"


def test_without_an_argument_ring_small_loads_are_staged():
    """The staging ring is the fallback of a small load (no argument ring: no CuPy loader),
    never a layered copy, and lands bit-exact."""
    gen = torch.Generator(device=DEV).manual_seed(53)
    view, pool = filled(gen)
    load = CudaCpuToGpuHandler(view, pool)
    assert load._args is not None  # the rule as shipped: small loads in one launch
    load._args = None
    want = torch.stack([pool.slot(s) for s in range(2)])
    pending = load.start(LoadStoreSpec.cpu([0, 1]), LoadStoreSpec.gpu([11, 12]))
    assert isinstance(pending.job, EnqueuedJob), type(pending.job)
    load.finish(pending)
    assert torch.equal(reference_slots(view, [11, 12], 1), want)


def test_a_whole_load_goes_in_one_launch_above_the_layered_size():
    """``LoadStoreSpec.whole`` (the forward waits for all of it): one launch at a size the
    handler would otherwise copy layer by layer, and no prefetch is started for it; the same
    load not marked whole is layered. Both land bit-exact. ``whole_max_bytes = 0`` ignores
    the mark."""
    gen = torch.Generator(device=DEV).manual_seed(59)
    view, pool = filled(gen)
    block = pool.geometry.block_bytes
    load = CudaCpuToGpuHandler(view, pool)
    load.layered_min_bytes = 2 * block  # 3-block loads are "large" here
    seen = spy(load)
    whole = load.start(LoadStoreSpec.cpu([0, 1, 2]), LoadStoreSpec.gpu([4, 5, 6], whole=True))
    assert seen == [whole.job] and not isinstance(whole.job, LayeredJob)
    layered = load.start(LoadStoreSpec.cpu([3, 4, 5]), LoadStoreSpec.gpu([9, 10, 11]))
    assert len(seen) == 1 and isinstance(layered.job, LayeredJob)
    load.finish(whole)
    load.finish(layered)
    want = torch.stack([pool.slot(s) for s in range(6)])
    assert torch.equal(reference_slots(view, [4, 5, 6, 9, 10, 11], 1), want)
    if load.prefetch_min_bytes is not None:  # CuPy's 2-D copy: prefetches are taken
        assert not load.prefetch(LoadStoreSpec.cpu([0, 1, 2]), whole=True)
        assert load.prefetch(LoadStoreSpec.cpu([0, 1, 2]), whole=False)
        load.drop_prefetch()
    load.whole_max_bytes = 0
    old = load.start(LoadStoreSpec.cpu([6, 7, 0]), LoadStoreSpec.gpu([20, 21, 22], whole=True))
    assert isinstance(old.job, LayeredJob)
    load.finish(old)
    assert torch.equal(reference_slots(view, [20, 21, 22], 1),
                       torch.stack([pool.slot(s) for s in (6, 7, 0)]))
    narrow = CudaCpuToGpuHandler(view, pool, layered_min_bytes=2 * block, whole_max_bytes=0)
    marked = narrow.start(LoadStoreSpec.cpu([0, 1, 2]), LoadStoreSpec.gpu([24, 25, 26], whole=True))
    assert isinstance(marked.job, LayeredJob)
    narrow.finish(marked)
    assert torch.equal(reference_slots(view, [24, 25, 26], 1),
                       torch.stack([pool.slot(s) for s in range(3)]))
