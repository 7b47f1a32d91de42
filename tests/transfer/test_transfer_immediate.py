"""TransferEngine's immediate routes: hops enqueued on the caller's thread, polled by the caller.

The CUDA copy handlers are immediate; these tests drive the engine's side of that contract on
any machine with a scripted device queue (a hop "runs" until the test completes it), plus one
real loop route (CPU<->DISK stand-in) to cover chains that cross between the two.
"""

from __future__ import annotations

import threading

import pytest

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.handlers import ImmediateHandler, TransferHandler
from kvtier.transfer.jobs import TransferOutcome


class ScriptedDevice(ImmediateHandler):
    """CPU -> GPU hops that finish when the test says so; records who called what, where."""

    direction = (Medium.CPU, Medium.GPU)

    def __init__(self) -> None:
        self.started: list[tuple[tuple[int, ...], str]] = []  # (dst ids, thread name)
        self.fenced: list[tuple[int, ...]] = []
        self.done: set[tuple[int, ...]] = set()
        self.refuse = False

    def start(self, src, dst):
        self.check_media(src, dst)
        if self.refuse:
            raise ValueError("engine block out of range")
        ids = tuple(dst.ids)
        self.started.append((ids, threading.current_thread().name))
        return ids

    def poll(self, pending):
        return TransferOutcome(bytes=len(pending), seconds=0.5) if pending in self.done else None

    def fence(self, pending):
        self.fenced.append(pending)

    def finish(self, pending):
        self.done.add(pending)
        return self.poll(pending)


class SlowLoopHop(TransferHandler):
    """DISK -> CPU on the event loop, released by the test."""

    direction = (Medium.DISK, Medium.CPU)

    def __init__(self) -> None:
        self.gate = threading.Event()

    async def run(self, src, dst):
        import asyncio

        while not self.gate.is_set():
            await asyncio.sleep(0.001)
        return TransferOutcome(bytes=7)


def cpu_to_gpu(slots, ids):
    return LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(ids)


def test_an_immediate_hop_starts_on_the_submitting_thread_and_finishes_when_polled():
    dev = ScriptedDevice()
    with TransferEngine([dev]) as engine:
        job = engine.submit(*cpu_to_gpu([0, 1], [5, 6]))
        assert dev.started == [((5, 6), threading.current_thread().name)]
        assert engine.get_finished() == [] and engine.pending() == 1
        dev.done.add((5, 6))
        (r,) = engine.get_finished()
    assert r.job_id == job and r.ok and r.bytes == 2
    assert r.seconds == 0.5  # the device's own timing, not the wall time
    assert r.direction == (Medium.CPU, Medium.GPU)
    assert engine.stats()["CPU->GPU"].jobs == 1


def test_a_refused_immediate_hop_is_a_failed_job_not_an_exception():
    dev = ScriptedDevice()
    dev.refuse = True
    with TransferEngine([dev]) as engine:
        job = engine.submit(*cpu_to_gpu([0], [99]))
        (r,) = engine.get_finished()
    assert r.job_id == job and not r.ok and "out of range" in r.error
    assert engine.stats()["CPU->GPU"].failed_jobs == 1


def test_fence_waits_on_the_device_not_on_the_host():
    dev = ScriptedDevice()
    with TransferEngine([dev]) as engine:
        job = engine.submit(*cpu_to_gpu([0], [3]))
        engine.fence([job])  # returns although the hop is still running
        assert dev.fenced == [(3,)]
        assert engine.pending() == 1
        dev.done.add((3,))
        assert [r.job_id for r in engine.get_finished()] == [job]
        engine.fence([job])  # collected: nothing to order any more
    assert dev.fenced == [(3,)]


def test_a_loop_job_and_a_device_job_run_side_by_side():
    """A loop job (a disk read) waiting on its handler holds up no device job: each is one
    spec pair on its own route."""
    dev, disk = ScriptedDevice(), SlowLoopHop()
    with TransferEngine([dev, disk]) as engine:
        read = engine.submit(LoadStoreSpec.disk([b"k"]), LoadStoreSpec.cpu([0]))
        load = engine.submit(*cpu_to_gpu([1], [9]))
        assert dev.started == [((9,), threading.current_thread().name)]
        dev.done.add((9,))
        (r,) = engine.wait([load], timeout=10)
        assert r.ok and engine.pending() == 1  # the read still runs
        disk.gate.set()
        (r,) = engine.wait([read], timeout=10)
    assert r.ok and r.bytes == 7 and r.direction == (Medium.DISK, Medium.CPU)


def test_fence_on_a_loop_job_waits_on_the_host_and_leaves_the_result_collectable():
    dev, disk = ScriptedDevice(), SlowLoopHop()
    with TransferEngine([dev, disk]) as engine:
        job = engine.submit(LoadStoreSpec.disk([b"k"]), LoadStoreSpec.cpu([0]))
        threading.Timer(0.05, disk.gate.set).start()
        engine.fence([job])  # host-waits for the disk job: nothing of it is on a device
        assert dev.fenced == [] and engine.pending() == 0
        assert [r.job_id for r in engine.get_finished()] == [job]


def test_close_finishes_running_immediate_hops():
    dev = ScriptedDevice()
    engine = TransferEngine([dev])
    job = engine.submit(*cpu_to_gpu([0], [1]))
    engine.close(timeout=5)
    assert engine.pending() == 0
    assert [r.job_id for r in engine.get_finished()] == [job]


def test_run_on_an_immediate_handler_awaits_the_device():
    import asyncio

    dev = ScriptedDevice()
    threading.Timer(0.02, lambda: dev.done.add((2,))).start()
    out = asyncio.run(dev.run(*cpu_to_gpu([0], [2])))
    assert out.bytes == 1


def test_wait_rejects_unknown_ids_with_immediate_routes_too():
    with TransferEngine([ScriptedDevice()]) as engine:
        with pytest.raises(ValueError):
            engine.wait([12345])
