"""The disk tier served by a child process (kvtier/tiers/disk/io/process.py).

Real child processes, a real store on disk and the real transfer handlers: the bytes the
child writes come from the worker's pool memory (a memfd both map), the records it writes are
read back by an in-process ``DiskStore`` after it exits, a child that dies turns reads into
transient misses and writes into errors, and a store the child cannot open raises the same
exception ``DiskStore`` raises in this process.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time

import pytest
import torch

from kvtier.config import load_config
from kvtier.config.schema import DiskTierConfig
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.child import wire
from kvtier.tiers.disk.io.process import DiskProcess, DiskProcessGone
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import DiskLayoutMismatch, DiskStore, DiskStoreBusy, DiskWriteError
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.transfer import TransferEngine
from kvtier.transfer.disk_io import CpuToDiskHandler, DiskDropHandler, DiskToCpuHandler

GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                    dtype="uint8", model="disk-process-test")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def fill(pool: CpuBlockPool, slot: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (GEO.block_bytes,), dtype=torch.uint8, generator=g)
    pool.slot(slot).copy_(data)
    return data


@pytest.fixture
def pool():
    return CpuBlockPool(GEO, 32, pin=False, shared=True)


@pytest.fixture
def proc(pool, tmp_path):
    dp = DiskProcess(pool, DiskTierConfig(path=tmp_path / "disk", capacity=1 << 30), GEO,
                     connections=3)
    yield dp
    dp.close()


def run(engine: TransferEngine, src: LoadStoreSpec, dst: LoadStoreSpec):
    job = engine.submit(src, dst)
    results = []
    while not results:
        results = [r for r in engine.get_finished() if r.job_id == job]
    return results[0]


def test_blocks_written_by_the_child_come_back_byte_exact_and_survive_it(pool, proc, tmp_path):
    written = {i: fill(pool, i, seed=i) for i in range(6)}
    with TransferEngine([CpuToDiskHandler(pool, proc), DiskToCpuHandler(pool, proc),
                         DiskDropHandler(proc)]) as eng:
        res = run(eng, LoadStoreSpec(Medium.CPU, ids=tuple(range(6))),
                  LoadStoreSpec(Medium.DISK, keys=tuple(key(i) for i in range(6))))
        assert res.ok, res.error
        # read into other slots, one key that was never written among them
        res = run(eng, LoadStoreSpec(Medium.DISK, keys=tuple(key(i) for i in (0, 3, 5, 99))),
                  LoadStoreSpec(Medium.CPU, ids=(20, 21, 22, 23)))
        assert res.error is None
        assert res.failed_keys == (key(99),)
        assert res.transient_keys == ()
        for slot, i in zip((20, 21, 22), (0, 3, 5)):
            assert torch.equal(pool.slot(slot), written[i]), f"slot {slot} != block {i}"
        res = run(eng, LoadStoreSpec(Medium.DISK, keys=(key(1),)), LoadStoreSpec(Medium.DROP))
        assert res.ok, res.error
    assert proc.keys_by_age() == [key(i) for i in (0, 2, 3, 4, 5)]
    assert proc.stats().num_blocks == 5
    proc.close()
    assert proc._proc.returncode == 0
    with DiskStore(tmp_path / "disk", GEO) as store:  # the directory lock was released
        assert store.get(key(4)) == bytes(written[4].numpy())
        assert store.get(key(1)) is None


def test_a_dead_child_means_transient_misses_and_failed_writes_never_wrong_bytes(pool, proc):
    fill(pool, 0, seed=1)
    proc.put_slots([0], [key(0)])
    before = pool.slot(5).clone()
    os.kill(proc.pid, signal.SIGKILL)
    proc._proc.wait(10)
    failed, transient = proc.fetch_slots([key(0), key(1)], [5, 6])
    assert failed == [0, 1] and transient == [0, 1]
    assert torch.equal(pool.slot(5), before), "a failed read changed the slot"
    with pytest.raises(DiskWriteError, match="gone"):
        proc.put_slots([0], [key(2)])
    with pytest.raises(DiskProcessGone):
        proc.delete_many([key(0)])


def test_the_childs_store_errors_are_raised_here_as_their_own_type(pool, tmp_path):
    path = tmp_path / "disk"
    cfg = DiskTierConfig(path=path, capacity=1 << 30)
    with DiskStore(path, GEO):  # this process holds the directory
        with pytest.raises(DiskStoreBusy):
            DiskProcess(pool, cfg, GEO)
    other = BlockGeometry(num_layers=3, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                          dtype="uint8", model="another")
    with pytest.raises(DiskLayoutMismatch):
        DiskProcess(CpuBlockPool(other, 4, pin=False, shared=True), cfg, other)


def test_bad_requests_are_refused_by_the_child_and_the_connection_stays_usable(pool, proc):
    with pytest.raises(ValueError, match="out of range"):
        proc.put_slots([32], [key(0)])
    with pytest.raises(ValueError, match="bytes"):
        proc.put_slots([0], ["not bytes"])  # type: ignore[list-item]
    fill(pool, 1, seed=2)
    for _ in range(4):  # every connection of the three still answers
        proc.put_slots([1], [key(1)])
    assert proc.keys_by_age() == [key(1)]


def test_a_pool_that_is_not_shared_is_refused(tmp_path):
    plain = CpuBlockPool(GEO, 4, pin=False)
    with pytest.raises(ValueError, match="shared CPU pool"):
        DiskProcess(plain, DiskTierConfig(path=tmp_path / "d", capacity=1 << 30), GEO)


def test_damaged_frames_are_wire_errors_not_wrong_slots():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.encode_request(wire.PUT, [1, 2], [key(1), key(2)])[:-3])
        a.close()
        with pytest.raises(wire.WireError):
            wire.read_request(b)
    with pytest.raises(wire.WireError, match="outside"):
        wire.decode_positions(memoryview(wire.encode_positions([0, 7], [])), 2)
    with pytest.raises(wire.WireError, match="stray"):
        wire.decode_keys(memoryview(wire.encode_keys([key(1)]) + b"x"), 1)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(bytes([99]) + bytes(12))
        with pytest.raises(wire.WireError, match="bad request"):
            wire.read_request(b)


def _runtime(tmp_path, **disk):
    layers = {f"l{i}": torch.zeros(8, 2, 1, 256, dtype=torch.uint8) for i in range(2)}
    view = GpuKvView(layers, "block_pages")
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "1MiB"},
                                      "disk": {"path": str(tmp_path / "disk"),
                                               "capacity": "64MiB", **disk}}})
    return WorkerRuntime.create(cfg, view, view.geometry(1))


def test_the_worker_runtime_serves_its_disk_from_a_child_unless_told_not_to(tmp_path):
    rt = _runtime(tmp_path)
    try:
        assert isinstance(rt.store, DiskProcess) and rt.pool.shared_fd is not None
        assert rt.store.pid != os.getpid()
        assert rt.disk_keys() == []
    finally:
        rt.close()
    assert rt.store._proc.returncode == 0
    rt = _runtime(tmp_path, io_process=False)
    try:
        assert isinstance(rt.store, DiskStore) and rt.pool.shared_fd is None
    finally:
        rt.close()


def test_io_process_is_read_from_yaml_and_environment(tmp_path, monkeypatch):
    cfg = load_config(data={"tiers": {"disk": {"path": str(tmp_path), "io_process": False}}})
    assert cfg.disk.io_process is False
    assert load_config(data={"tiers": {"disk": {"path": str(tmp_path)}}}).disk.io_process
    monkeypatch.setenv("KVTIER_DISK_PATH", str(tmp_path))
    monkeypatch.setenv("KVTIER_DISK_IO_PROCESS", "0")
    assert load_config().disk.io_process is False


def test_callers_waiting_for_a_connection_fail_when_the_child_dies_not_hang(pool, tmp_path):
    """One connection, a stopped child: one call waits for its reply, three wait for the
    connection. When the child is killed, every one of them returns (a miss or an error)."""
    import threading
    import time

    dp = DiskProcess(pool, DiskTierConfig(path=tmp_path / "one", capacity=1 << 30), GEO,
                     connections=1)
    try:
        os.kill(dp.pid, signal.SIGSTOP)
        results: list = []

        def read() -> None:
            results.append(dp.fetch_slots([key(1)], [3]))

        threads = [threading.Thread(target=read, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert results == []  # all four are stuck behind the stopped child
        os.kill(dp.pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a caller hangs on a dead child"
        assert results == [([0], [0])] * 4  # transient misses, nothing read
    finally:
        dp.close()


def test_a_lost_child_is_replaced_and_what_it_indexed_reads_back_byte_exact(pool, tmp_path):
    dp = DiskProcess(pool, DiskTierConfig(path=tmp_path / "disk", capacity=1 << 30), GEO,
                     connections=2, respawn_after_s=0.2)
    try:
        written = {i: fill(pool, i, seed=10 + i) for i in range(4)}
        dp.put_slots(list(range(4)), [key(i) for i in range(4)])
        for round_ in (1, 2):  # lost and replaced twice
            first = dp.pid
            os.kill(first, signal.SIGKILL)
            dp._proc.wait(10)
            # until the wait is over: transient misses and failed writes, as before
            assert dp.fetch_slots([key(0)], [10]) == ([0], [0])
            with pytest.raises(DiskProcessGone, match="until a new one starts"):
                dp.put_slots([0], [key(50)])
            time.sleep(0.3)
            fill(pool, 4, seed=99)
            dp.put_slots([4], [key(100 + round_)])  # this call starts the replacement
            assert dp.respawns == round_ and dp.pid != first
            failed, transient = dp.fetch_slots([key(i) for i in range(4)] + [key(100 + round_)],
                                               [20, 21, 22, 23, 24])
            assert failed == [] and transient == []
            for i in range(4):
                assert torch.equal(pool.slot(20 + i), written[i]), f"block {i} after round {round_}"
            assert torch.equal(pool.slot(24), pool.slot(4))
        assert dp.stats().num_blocks == 6
    finally:
        dp.close()


def test_a_replacement_that_cannot_open_the_store_backs_off_then_recovers(pool, tmp_path):
    path = tmp_path / "disk"
    dp = DiskProcess(pool, DiskTierConfig(path=path, capacity=1 << 30), GEO, connections=1,
                     respawn_after_s=0.2)
    try:
        os.kill(dp.pid, signal.SIGKILL)
        dp._proc.wait(10)
        shutil.rmtree(path)
        path.write_text("not a directory")  # the replacement's store cannot open
        with pytest.raises(DiskProcessGone):
            dp.put_slots([0], [key(1)])  # the loss is noticed here: the wait starts
        time.sleep(0.3)
        with pytest.raises(DiskProcessGone):
            dp.put_slots([0], [key(1)])  # tried to replace it: failed
        assert dp.respawns == 0 and dp._backoff == pytest.approx(0.4)
        with pytest.raises(DiskProcessGone):  # inside the longer wait: not tried again
            dp.put_slots([0], [key(1)])
        path.unlink()
        time.sleep(0.5)
        fill(pool, 0, seed=3)
        dp.put_slots([0], [key(1)])  # a fresh store in the same place
        assert dp.respawns == 1
        assert dp.fetch_slots([key(1)], [9]) == ([], [])
        assert torch.equal(pool.slot(9), pool.slot(0))
    finally:
        dp.close()


def test_without_respawn_a_lost_child_stays_lost(pool, tmp_path):
    dp = DiskProcess(pool, DiskTierConfig(path=tmp_path / "d", capacity=1 << 30), GEO,
                     connections=1, respawn_after_s=None)
    try:
        os.kill(dp.pid, signal.SIGKILL)
        dp._proc.wait(10)
        for _ in range(2):
            with pytest.raises(DiskProcessGone, match="from now on"):
                dp.put_slots([0], [key(1)])
            time.sleep(0.1)
        assert dp.respawns == 0
    finally:
        dp.close()


def test_a_partial_reply_frame_is_refused_where_none_is_expected():
    """PART frames belong to the shared tier's fetches only: on the disk path one is a damaged
    stream, never an answer."""
    from kvtier.tiers.child import wire

    for partial in (False, True):
        a, b = socket.socketpair()
        with a, b:
            wire.send_reply(a, b'{"ready": [0]}', wire.PART)
            if partial:
                assert wire.read_reply(b, partial=True) == (wire.PART, b'{"ready": [0]}')
            else:
                with pytest.raises(wire.WireError):
                    wire.read_reply(b)
