"""Transfer engine and handlers: routing, ordering, failure isolation, bit-exact copies."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from kvtier.manager.specs import LoadStoreSpec as Spec
from kvtier.manager.specs import Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import ReadStatus
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer import TransferEngine, TransferHandler, TransferOutcome
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler
from kvtier.transfer.disk_io import CpuToDiskHandler, DiskDropHandler, DiskToCpuHandler

SAFETY = 20.0  # generous timeout so a broken engine fails the test instead of hanging it
BS, HEADS, DIM = 4, 2, 4  # engine block tokens, kv heads, head dim (float16)
NUM_LAYERS, NUM_ENGINE_BLOCKS = 3, 12


# ---- fixtures and helpers -----------------------------------------------------------------------


def make_kv(layout: str, *, fill: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    shape = {
        "kv_first": (2, NUM_ENGINE_BLOCKS, BS, HEADS, DIM),
        "blocks_first": (NUM_ENGINE_BLOCKS, 2, BS, HEADS, DIM),
        "mla": (NUM_ENGINE_BLOCKS, BS, DIM),
    }[layout]
    gen = torch.Generator().manual_seed(seed)
    raw_shape = shape[:-1] + (shape[-1] * 2,)
    out = {}
    for layer in range(NUM_LAYERS):
        if fill:
            raw = torch.randint(0, 256, raw_shape, dtype=torch.uint8, generator=gen)
        else:
            raw = torch.zeros(raw_shape, dtype=torch.uint8)
        out[f"layer.{layer}"] = raw.view(torch.float16)  # random bit patterns, NaNs included
    return out


def page_bytes_of(t: torch.Tensor, layout: str, part: int, block: int) -> torch.Tensor:
    """Independent oracle: one engine page's bytes, addressed in the engine tensor's own layout."""
    page = {"kv_first": lambda: t[part, block], "blocks_first": lambda: t[block, part],
            "mla": lambda: t[block]}[layout]()
    return page.contiguous().view(torch.uint8).reshape(-1)


def make_pool(view: GpuKvView, k: int, num_slots: int = 10) -> CpuBlockPool:
    geometry = view.geometry(k)
    # three slots per chunk, so scattered slots span several chunks
    return CpuBlockPool(geometry, num_slots, pin=False, chunk_bytes=3 * geometry.block_bytes,
                        background=False)


class FakeStore:
    """In-memory DiskStore stand-in (same API as kvtier.tiers.disk's store)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.broken: set[bytes] = set()  # fetch_into raises OSError for these
        self.lock = threading.Lock()

    def put_many(self, items):
        with self.lock:
            for key, buf in items:
                self.data[key] = bytes(buf)

    def fetch_into(self, key, out):
        if key in self.broken:
            raise OSError(f"unreadable {key!r}")
        with self.lock:
            blob = self.data.get(key)
        if blob is None or len(blob) != len(out):
            return ReadStatus.MISS
        out[:] = blob
        return ReadStatus.HIT

    def delete_many(self, keys):
        with self.lock:
            return sum(self.data.pop(k, None) is not None for k in keys)


class Gate:
    """Lets a test hold jobs inside a handler and observe how many are in there."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.open = False
        self.inside = 0

    def enter_and_wait(self) -> None:
        with self.cond:
            self.inside += 1
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.open, SAFETY)

    def wait_inside(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.inside >= n, SAFETY)

    def release(self) -> None:
        with self.cond:
            self.open = True
            self.cond.notify_all()


class FakeHandler(TransferHandler):
    """Records start order; job behaviour is chosen by the first id of the source spec:
    666 raises, 777 reports its keys as failed, 888 blocks on ``gate``."""

    def __init__(self, direction, *, concurrency=1, gate: Gate | None = None, nbytes=10):
        self.direction = direction
        self.concurrency = concurrency
        self.gate = gate
        self.nbytes = nbytes
        self.started: list[int] = []
        self.lock = threading.Lock()

    async def run(self, src, dst):
        tag = src.ids[0] if src.ids else -1
        with self.lock:
            self.started.append(tag)
        if tag == 666:
            raise RuntimeError("boom")
        if tag == 777:
            return TransferOutcome(bytes=0, failed_keys=src.keys or dst.keys)
        if tag == 888 or (self.gate is not None and tag >= 1000):
            await self.run_blocking(self.gate.enter_and_wait)
        await asyncio.sleep(0)
        return TransferOutcome(bytes=self.nbytes)


def cpu(*ids):
    return Spec.cpu(ids)


# ---- GPU <-> CPU copies -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "mla"])
@pytest.mark.parametrize("k", [1, 2])
def test_gpu_cpu_round_trip_bit_exact(layout, k):
    rng = random.Random(f"{layout}-{k}")
    src_kv, dst_kv = make_kv(layout, fill=True, seed=k), make_kv(layout, fill=False)
    src_view, dst_view = GpuKvView(src_kv, layout), GpuKvView(dst_kv, layout)
    pool = make_pool(src_view, k)
    n = 5
    gpu_ids = rng.sample(range(NUM_ENGINE_BLOCKS), n * k)
    slots = rng.sample(range(pool.num_slots), n)
    dst_ids = rng.sample(range(NUM_ENGINE_BLOCKS), n * k)
    parts = 1 if layout == "mla" else 2
    with TransferEngine([GpuToCpuHandler(src_view, pool), CpuToGpuHandler(dst_view, pool)]) as eng:
        [store] = eng.wait([eng.submit(Spec.gpu(gpu_ids), Spec.cpu(slots))], SAFETY)
        assert store.ok, store.error
        assert store.bytes == n * pool.geometry.block_bytes
        for i, slot in enumerate(slots):  # the slot layout: [layer][kv_part][sub-page][page]
            expected = torch.cat([
                page_bytes_of(src_kv[f"layer.{layer}"], layout, p, gpu_ids[i * k + j])
                for layer in range(NUM_LAYERS) for p in range(parts) for j in range(k)
            ])
            assert torch.equal(pool.slot(slot), expected)
        [load] = eng.wait([eng.submit(Spec.cpu(slots), Spec.gpu(dst_ids))], SAFETY)
        assert load.ok, load.error
    for name in src_kv:
        for p in range(parts):
            for blk in range(NUM_ENGINE_BLOCKS):
                got = page_bytes_of(dst_kv[name], layout, p, blk)
                if blk in dst_ids:
                    want = page_bytes_of(src_kv[name], layout, p, gpu_ids[dst_ids.index(blk)])
                else:
                    want = torch.zeros_like(got)  # untouched blocks stay untouched
                assert torch.equal(got, want), (name, p, blk)


@pytest.mark.parametrize("page_bytes,word", [(3, torch.uint8), (6, torch.int16), (12, torch.int32),
                                             (24, torch.int64)])
def test_odd_page_sizes_copy_with_a_narrower_word(page_bytes, word):
    gen = torch.Generator().manual_seed(page_bytes)
    src = {f"l{i}": torch.randint(0, 256, (2, NUM_ENGINE_BLOCKS, page_bytes), dtype=torch.uint8,
                                  generator=gen) for i in range(2)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    src_view, dst_view = GpuKvView(src, "kv_first"), GpuKvView(dst, "kv_first")
    pool = make_pool(src_view, 2)
    store, load = GpuToCpuHandler(src_view, pool), CpuToGpuHandler(dst_view, pool)
    assert store.word == word
    with TransferEngine([store, load]) as eng:
        stored = eng.wait([eng.submit(Spec.gpu([5, 2, 9, 0]), cpu(7, 1))], SAFETY)
        results = eng.wait([eng.submit(cpu(7, 1), Spec.gpu([1, 3, 4, 6]))], SAFETY)
    assert stored[0].ok and results[0].ok, (stored[0].error, results[0].error)
    for name in src:
        assert torch.equal(dst[name][:, [1, 3, 4, 6]], src[name][:, [5, 2, 9, 0]])
        assert not dst[name][:, [0, 2, 5, 7, 8, 9, 10, 11]].any()


def test_gpu_cpu_bad_addresses_raise_value_error():
    view = GpuKvView(make_kv("kv_first", fill=True), "kv_first")
    pool = make_pool(view, 2)
    store, load = GpuToCpuHandler(view, pool), CpuToGpuHandler(view, pool)
    bad = [
        (store, Spec.gpu([0, 1, 2]), cpu(0, 1)),  # 3 ids for 2 slots of k=2
        (store, Spec.gpu([0, NUM_ENGINE_BLOCKS]), cpu(0)),  # engine id out of range
        (store, Spec.gpu([0, 1]), cpu(pool.num_slots)),  # slot out of range
        (store, Spec.gpu([0, 1, 2, 3]), cpu(4, 4)),  # same slot written twice
        (load, cpu(0, 1), Spec.gpu([0, 1, 1, 2])),  # same engine block written twice
        (load, cpu(-1), Spec.gpu([0, 1])),
    ]
    for handler, src, dst in bad:
        with pytest.raises(ValueError):
            asyncio.run(handler.run(src, dst))
        handler.close()
    with TransferEngine([store]) as eng:
        [r] = eng.wait([eng.submit(Spec.gpu([0, 1, 2]), cpu(0, 1))], SAFETY)
    assert not r.ok and "ValueError" in r.error


def test_gpu_cpu_geometry_mismatch_rejected():
    view = GpuKvView(make_kv("kv_first", fill=True), "kv_first")
    other = CpuBlockPool(view.geometry(1).__class__(num_layers=NUM_LAYERS + 1, kv_parts=2,
                         engine_blocks_per_block=1, page_bytes=view.page_bytes), 2, pin=False)
    with pytest.raises(ValueError):
        GpuToCpuHandler(view, other)


# ---- disk handlers ----------------------------------------------------------------------------


def test_disk_promote_then_load_with_a_missing_key():
    layout, k = "blocks_first", 2
    src_kv, dst_kv = make_kv(layout, fill=True, seed=3), make_kv(layout, fill=False)
    src_view, dst_view = GpuKvView(src_kv, layout), GpuKvView(dst_kv, layout)
    pool, fs = make_pool(src_view, k), FakeStore()
    keys = [bytes([i]) * 8 for i in range(4)]
    handlers = [GpuToCpuHandler(src_view, pool), CpuToGpuHandler(dst_view, pool),
                CpuToDiskHandler(pool, fs), DiskToCpuHandler(pool, fs), DiskDropHandler(fs)]
    with TransferEngine(handlers) as eng:
        assert eng.wait([eng.submit(Spec.gpu(range(8)), cpu(0, 1, 2, 3))], SAFETY)[0].ok
        r = eng.wait([eng.submit(cpu(0, 1, 2, 3), Spec.disk(keys))], SAFETY)[0]
        assert r.ok and set(fs.data) == set(keys)
        assert r.direction == (Medium.CPU, Medium.DISK)
        for s in range(4):
            pool.slot(s).zero_()  # the blocks now live on disk only
        del fs.data[keys[1]]
        [r] = eng.wait([eng.submit(Spec.disk(keys), cpu(7, 5, 9, 6))], SAFETY)
        assert not r.ok and r.error is None  # the promotion: one block missing
        assert r.failed_keys == (keys[1],) and r.direction == (Medium.DISK, Medium.CPU)
        [r] = eng.wait([eng.submit(cpu(7, 5, 9, 6), Spec.gpu(range(4, 12)))], SAFETY)
        assert r.ok and r.direction == (Medium.CPU, Medium.GPU)  # then the load
        stats = eng.stats()
    for name in src_kv:
        for i in (0, 2, 3):
            for j in range(k):
                for p in range(2):
                    want = page_bytes_of(src_kv[name], layout, p, i * k + j)
                    got = page_bytes_of(dst_kv[name], layout, p, 4 + i * k + j)
                    assert torch.equal(got, want)
    block = pool.geometry.block_bytes
    assert stats["DISK->CPU"].bytes == 3 * block and stats["DISK->CPU"].failed_jobs == 1
    assert stats["CPU->GPU"].bytes == 4 * block and stats["CPU->DISK"].bytes == 4 * block


def test_disk_read_errors_and_misses_are_failed_keys_not_job_failures():
    view = GpuKvView(make_kv("mla", fill=True), "mla")
    pool, fs = make_pool(view, 1), FakeStore()
    keys = [b"k%02d" % i for i in range(10)]
    for i, key in enumerate(keys):
        fs.data[key] = bytes([i]) * pool.geometry.block_bytes
    del fs.data[keys[3]]
    fs.broken.add(keys[8])
    fs.data[keys[5]] = b"short"  # wrong size: the store-side check reports a miss
    with TransferEngine([DiskToCpuHandler(pool, fs, read_threads=4)]) as eng:
        [r] = eng.wait([eng.submit(Spec.disk(keys), cpu(*range(10)))], SAFETY)
    assert r.failed_keys == (keys[3], keys[5], keys[8]) and not r.ok and r.error is None
    assert r.bytes == 7 * pool.geometry.block_bytes
    for i in set(range(10)) - {3, 5, 8}:
        assert bytes(pool.slot(i).numpy()) == bytes([i]) * pool.geometry.block_bytes


def test_disk_write_failure_and_drop():
    view = GpuKvView(make_kv("mla", fill=True), "mla")
    pool, fs = make_pool(view, 1), FakeStore()

    class FullStore(FakeStore):
        def put_many(self, items):
            raise OSError("disk full")

    with TransferEngine([CpuToDiskHandler(pool, FullStore()), DiskDropHandler(fs)]) as eng:
        fs.data.update({b"a": b"1", b"b": b"2", b"c": b"3"})
        r_full, r_drop = eng.wait([eng.submit(cpu(0), Spec.disk([b"x"])),
                                   eng.submit(Spec.disk([b"a", b"c", b"zz"]), Spec.drop([]))], SAFETY)
        [r_bad] = eng.wait([eng.submit(cpu(0, 1), Spec.disk([b"x"]))], SAFETY)  # count mismatch
    assert not r_full.ok and "disk full" in r_full.error
    assert r_drop.ok and set(fs.data) == {b"b"}
    assert not r_bad.ok and "ValueError" in r_bad.error


# ---- engine behaviour ---------------------------------------------------------------------------


def test_failing_job_fails_alone_and_worker_survives():
    h = FakeHandler((Medium.GPU, Medium.CPU))
    with TransferEngine([h]) as eng:
        ids = [eng.submit(Spec.gpu([i]), cpu(i)) for i in (1, 666, 2)]
        results = eng.wait(ids, SAFETY)
        stats = eng.stats()["GPU->CPU"]
    assert [r.ok for r in results] == [True, False, True]
    assert "RuntimeError: boom" in results[1].error and results[1].failed_keys == ()
    assert h.started == [1, 666, 2]
    assert (stats.jobs, stats.failed_jobs, stats.bytes) == (3, 1, 20)


def test_failed_keys_propagate():
    h = FakeHandler((Medium.DISK, Medium.CPU))
    with TransferEngine([h]) as eng:
        [r] = eng.wait([eng.submit(Spec(Medium.DISK, ids=(777,), keys=(b"x", b"y")), cpu(0))], SAFETY)
    assert not r.ok and r.error is None and r.failed_keys == (b"x", b"y")


def test_unknown_route_rejected_at_submit():
    with TransferEngine([FakeHandler((Medium.GPU, Medium.CPU))]) as eng:
        with pytest.raises(ValueError, match="CPU->DISK"):
            eng.submit(cpu(1), Spec.disk([b"k"]))
        with pytest.raises(TypeError):  # a job is a spec pair
            eng.submit((Spec.gpu([1]), cpu(1)), Spec.disk([b"k"]))
        assert eng.pending() == 0 and eng.get_finished() == []
    with pytest.raises(ValueError):
        TransferEngine([FakeHandler((Medium.GPU, Medium.CPU)), FakeHandler((Medium.GPU, Medium.CPU))])


def test_job_ids_explicit_unique_and_auto_skips_them():
    with TransferEngine([FakeHandler((Medium.GPU, Medium.CPU))]) as eng:
        assert eng.submit(Spec.gpu([1]), cpu(1), job_id=1) == 1
        with pytest.raises(ValueError):
            eng.submit(Spec.gpu([1]), cpu(1), job_id=1)
        auto = [eng.submit(Spec.gpu([1]), cpu(1)) for _ in range(3)]
        assert auto == [0, 2, 3]
        assert sorted(r.job_id for r in eng.wait([1, *auto], SAFETY)) == [0, 1, 2, 3]
        assert eng.submit(Spec.gpu([1]), cpu(1), job_id=1) == 1  # collected ids may be reused
        with pytest.raises(ValueError):
            eng.wait([12345])


def test_many_threads_every_job_completes_exactly_once():
    h = FakeHandler((Medium.GPU, Medium.CPU), concurrency=3)
    submitted: list[int] = []
    lock = threading.Lock()
    with TransferEngine([h]) as eng:
        def producer(t):
            mine = [eng.submit(Spec.gpu([t]), cpu(t)) for _ in range(50)]
            with lock:
                submitted.extend(mine)

        threads = [threading.Thread(target=producer, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        seen: list[int] = []
        deadline = time.monotonic() + SAFETY
        while len(seen) < 400 and time.monotonic() < deadline:
            seen.extend(r.job_id for r in eng.get_finished())
            time.sleep(0.001)
        for t in threads:
            t.join()
        assert eng.get_finished() == [] and eng.pending() == 0
    assert len(seen) == 400 and sorted(seen) == sorted(submitted) and len(set(seen)) == 400


def test_get_finished_does_not_block_on_a_slow_job():
    gate = Gate()
    with TransferEngine([FakeHandler((Medium.GPU, Medium.CPU), gate=gate)]) as eng:
        jid = eng.submit(Spec.gpu([888]), cpu(0))
        gate.wait_inside(1)
        assert eng.get_finished() == [] and eng.pending() == 1
        with pytest.raises(TimeoutError):
            eng.wait([jid], timeout=0.05)
        gate.release()
        [r] = eng.wait([jid], SAFETY)  # the timed-out wait left the result collectable
        assert r.ok and eng.get_finished() == []


def test_wait_results_are_not_returned_by_get_finished():
    with TransferEngine([FakeHandler((Medium.GPU, Medium.CPU))]) as eng:
        a = eng.submit(Spec.gpu([1]), cpu(1))
        b = eng.submit(Spec.gpu([2]), cpu(2))
        assert [r.job_id for r in eng.wait([b], SAFETY)] == [b]
        eng.wait([a], SAFETY)
        assert eng.get_finished() == []
        c = eng.submit(Spec.gpu([3]), cpu(3))
        eng.wait([c], SAFETY)
        d = eng.submit(Spec.gpu([3]), cpu(3))
        while eng.pending():
            time.sleep(0.001)
        assert [r.job_id for r in eng.get_finished()] == [d]


def test_get_finished_leaves_results_a_blocked_wait_is_collecting():
    gate = Gate()
    with TransferEngine([FakeHandler((Medium.GPU, Medium.CPU), gate=gate)]) as eng:
        done = eng.submit(Spec.gpu([1]), cpu(1))
        held = eng.submit(Spec.gpu([888]), cpu(2))
        gate.wait_inside(1)  # concurrency 1: ``done`` has finished
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(eng.wait([done, held], SAFETY)))
        waiter.start()
        deadline = time.monotonic() + SAFETY
        while done not in eng._reserved and time.monotonic() < deadline:  # waiter has registered
            time.sleep(0.001)
        assert eng.get_finished() == []
        gate.release()
        waiter.join(SAFETY)
        assert [r.job_id for r in got] == [done, held] and eng.get_finished() == []


def test_a_long_store_does_not_delay_a_load():
    gate = Gate()
    store = FakeHandler((Medium.GPU, Medium.CPU), gate=gate)
    load = FakeHandler((Medium.CPU, Medium.GPU))
    with TransferEngine([store, load]) as eng:
        s = eng.submit(Spec.gpu([888]), cpu(0))
        gate.wait_inside(1)
        [r] = eng.wait([eng.submit(cpu(1), Spec.gpu([1]))], SAFETY)
        assert r.ok and eng.pending() == 1  # the store is still held
        gate.release()
        assert eng.wait([s], SAFETY)[0].ok


def test_concurrency_limit_and_submission_order():
    gate = Gate()
    h = FakeHandler((Medium.DISK, Medium.CPU), concurrency=2, gate=gate)
    with TransferEngine([h]) as eng:
        ids = [eng.submit(Spec(Medium.DISK, ids=(1000 + i,)), cpu(i)) for i in range(5)]
        gate.wait_inside(2)
        assert gate.inside == 2 and h.started == [1000, 1001]  # nothing else runs until one ends
        gate.release()
        assert all(r.ok for r in eng.wait(ids, SAFETY))
    assert h.started == [1000 + i for i in range(5)]


def test_close_drains_then_refuses():
    h = FakeHandler((Medium.GPU, Medium.CPU))
    eng = TransferEngine([h])
    ids = [eng.submit(Spec.gpu([i]), cpu(i)) for i in range(20)]
    eng.close()
    results = eng.get_finished()
    assert sorted(r.job_id for r in results) == ids and all(r.ok for r in results)
    with pytest.raises(RuntimeError):
        eng.submit(Spec.gpu([1]), cpu(1))
    eng.close()  # idempotent


def test_close_timeout_fails_stuck_jobs():
    gate = Gate()
    h = FakeHandler((Medium.GPU, Medium.CPU), gate=gate)
    eng = TransferEngine([h])
    stuck = eng.submit(Spec.gpu([888]), cpu(0))
    queued = eng.submit(Spec.gpu([1]), cpu(1))
    gate.wait_inside(1)
    eng.close(timeout=0.05)
    gate.release()
    results = {r.job_id: r for r in eng.get_finished()}
    assert set(results) == {stuck, queued}
    assert all(not r.ok and "closed" in r.error for r in results.values())


def test_stats_count_bytes_and_busy_time():
    view = GpuKvView(make_kv("kv_first", fill=True), "kv_first")
    pool = make_pool(view, 1)
    with TransferEngine([GpuToCpuHandler(view, pool), CpuToGpuHandler(view, pool)]) as eng:
        ids = [eng.submit(Spec.gpu([i, i + 1]), cpu(i, i + 1)) for i in range(0, 8, 2)]
        eng.wait(ids, SAFETY)
        stats = eng.stats()
    s = stats["GPU->CPU"]
    assert (s.jobs, s.failed_jobs, s.bytes) == (4, 0, 8 * pool.geometry.block_bytes)
    assert s.seconds > 0 and s.gbps == s.bytes / s.seconds / 1e9
    assert stats["CPU->GPU"].to_dict() == {"jobs": 0, "failed_jobs": 0, "bytes": 0,
                                          "seconds": 0.0, "gbps": 0.0}


def test_cpu_disk_round_trip_with_the_real_disk_store(tmp_path):
    store_mod = pytest.importorskip("kvtier.tiers.disk.store")
    view = GpuKvView(make_kv("kv_first", fill=True, seed=9), "kv_first")
    pool = make_pool(view, 1)
    keys = [b"blk-%d" % i for i in range(6)]
    with store_mod.DiskStore(tmp_path / "disk", pool.geometry, fsync=False) as ds:
        handlers = [GpuToCpuHandler(view, pool), CpuToDiskHandler(pool, ds),
                    DiskToCpuHandler(pool, ds), DiskDropHandler(ds)]
        with TransferEngine(handlers) as eng:
            [r] = eng.wait([eng.submit(Spec.gpu(range(6)), cpu(*range(6)))], SAFETY)
            assert r.ok, r.error
            [r] = eng.wait([eng.submit(cpu(*range(6)), Spec.disk(keys))], SAFETY)
            assert r.ok, r.error
            originals = [bytes(pool.slot(s).numpy()) for s in range(6)]
            [r] = eng.wait([eng.submit(Spec.disk([keys[2]]), Spec.drop([]))], SAFETY)
            assert r.ok
            [r] = eng.wait([eng.submit(Spec.disk(keys), cpu(9, 8, 7, 6, 5, 4))], SAFETY)
    assert r.failed_keys == (keys[2],)
    for i, slot in enumerate((9, 8, 7, 6, 5, 4)):
        if i != 2:
            assert bytes(pool.slot(slot).numpy()) == originals[i]
