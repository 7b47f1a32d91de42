"""A load's copies to the GPU start on the blocks its shared-tier read reports final, before the
read ends (kvtier.transfer.early): every block is copied once, only after it was final, and a
job ends only after its copies, also when the read fails.

The read is a loop hop the test scripts (it reports slots and ends when told); the GPU side is
a device queue the test completes (as in test_transfer_immediate.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from contextlib import contextmanager

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.early import MIN_PIECE_BLOCKS, EarlyCopies
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.handlers import ImmediateHandler, TransferHandler
from kvtier.transfer.jobs import TransferOutcome

PER = 2  # engine blocks per kvtier block


class Device(ImmediateHandler):
    """CPU -> GPU copies that finish when the test says so; remembers which slots were final
    (per the read) when each copy was enqueued."""

    direction = (Medium.CPU, Medium.GPU)

    def __init__(self, read: "ScriptedRead | None" = None) -> None:
        self.read = read
        self.copies: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (slots, gpu ids)
        self.early_unready: list[int] = []  # slots copied before they were final
        self.done: set[int] = set()  # indices into copies
        self.refuse_next = 0

    def start(self, src, dst):
        self.check_media(src, dst)
        if self.refuse_next:
            self.refuse_next -= 1
            raise RuntimeError("no staging buffer")
        if self.read is not None and not self.read.ended:
            self.early_unready += [s for s in src.ids if s in self.read.writes
                                   and s not in self.read.final]
        self.copies.append((tuple(src.ids), tuple(dst.ids)))
        return len(self.copies) - 1

    def poll(self, pending):
        if pending not in self.done:
            return None
        return TransferOutcome(bytes=len(self.copies[pending][0]), seconds=0.25)

    def fence(self, pending):
        pass

    def finish(self, pending):
        self.done.add(pending)
        return self.poll(pending)

    def finish_all(self):
        self.done.update(range(len(self.copies)))


class ScriptedRead(TransferHandler):
    """REMOTE -> CPU on the loop: reports the slots the test makes final, ends when told."""

    direction = (Medium.REMOTE, Medium.CPU)
    reports_ready = True

    def __init__(self) -> None:
        self.writes: set[int] = set()
        self.final: set[int] = set()
        self.to_report: list[list[int]] = []
        self.lock = threading.Lock()
        self.end = threading.Event()
        self.ended = False
        self.fail = False

    def make_final(self, slots):
        with self.lock:
            self.final.update(slots)
            self.to_report.append(list(slots))

    async def run(self, src, dst):
        raise AssertionError("the engine must ask for reports")

    async def run_reporting(self, src, dst, ready):
        self.writes = set(dst.ids)
        while True:
            with self.lock:
                batches, self.to_report = self.to_report, []
            for b in batches:
                ready(b)
            if self.end.is_set():
                break
            await asyncio.sleep(0.001)
        self.ended = True
        if self.fail:
            raise ConnectionError("server gone")
        return TransferOutcome(bytes=len(dst.ids))


def load(read_slots, cpu_slots):
    """A shared-tier load: read ``read_slots`` into the CPU, then copy ``cpu_slots`` (the read
    ones and CPU hits) to the GPU, two engine blocks per slot."""
    gpu = [b for s in cpu_slots for b in (1000 + PER * s, 1001 + PER * s)]
    return [(LoadStoreSpec.remote([f"k{s}".encode() for s in read_slots]),
             LoadStoreSpec.cpu(read_slots)),
            (LoadStoreSpec.cpu(cpu_slots), LoadStoreSpec.gpu(gpu, whole=True))]


@contextmanager
def running_load(n: int, refuse: int = 0):
    """A scripted read of ``n`` blocks chained with their copies to the device, submitted:
    (read, device, engine, job id); the engine closes on the way out."""
    read = ScriptedRead()
    dev = Device(read)
    dev.refuse_next = refuse
    with TransferEngine([dev, read]) as engine:
        yield read, dev, engine, engine.submit_chain(load(list(range(n)), list(range(n))))


def poll_until(engine, cond, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    out = []
    while not cond():
        out += engine.get_finished()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return out


def copied_once(dev, cpu_slots):
    slots = Counter(s for src, _ in dev.copies for s in src)
    ids = Counter(b for _, dst in dev.copies for b in dst)
    want_ids = {b for s in cpu_slots for b in (1000 + PER * s, 1001 + PER * s)}
    return set(slots) == set(cpu_slots) and set(slots.values()) == {1} and \
        set(ids) == want_ids and set(ids.values()) == {1}


def test_copies_start_on_final_blocks_before_the_read_ends_and_each_block_is_copied_once():
    read = ScriptedRead()
    dev = Device(read)
    hits = list(range(100, 100 + MIN_PIECE_BLOCKS))  # in CPU slots already: final at once
    promoted = list(range(48))
    with TransferEngine([dev, read]) as engine:
        job = engine.submit_chain(load(promoted, promoted + hits))
        # the CPU hits are copied as soon as the read starts, before it reports anything
        poll_until(engine, lambda: len(dev.copies) == 1)
        assert set(dev.copies[0][0]) == set(hits)
        read.make_final(range(0, MIN_PIECE_BLOCKS // 2))  # too few for a piece of their own
        read.make_final(range(MIN_PIECE_BLOCKS // 2, MIN_PIECE_BLOCKS))
        poll_until(engine, lambda: len(dev.copies) == 2)
        assert set(dev.copies[1][0]) == set(range(MIN_PIECE_BLOCKS))
        assert not read.ended and engine.pending() == 1
        read.make_final(range(MIN_PIECE_BLOCKS, MIN_PIECE_BLOCKS + 3))  # left to the rest
        read.end.set()
        poll_until(engine, lambda: len(dev.copies) == 3)
        assert engine.get_finished() == []  # the rest is still on the device
        dev.finish_all()
        (r,) = engine.wait([job], timeout=10)
    assert r.ok and r.error is None
    assert copied_once(dev, promoted + hits)
    assert dev.early_unready == []  # nothing was copied before the read made it final
    # one CPU -> GPU hop for the cost model: the pieces' bytes and device seconds add up
    assert r.hops[-1] == ((Medium.CPU, Medium.GPU), len(promoted + hits), 0.75)
    assert engine.stats()["CPU->GPU"].jobs == 1


def test_a_failed_read_ends_the_job_only_after_the_copies_it_let_start():
    with running_load(40) as (read, dev, engine, job):
        read.make_final(range(MIN_PIECE_BLOCKS))
        poll_until(engine, lambda: len(dev.copies) == 1)
        read.fail = True
        read.end.set()
        for _ in range(50):  # the read failed, but a piece still writes engine blocks
            assert engine.get_finished() == []
            threading.Event().wait(0.002)
        dev.finish_all()
        (r,) = engine.wait([job], timeout=10)
    assert not r.ok and "server gone" in r.error
    assert len(dev.copies) == 1  # nothing more is copied after the read failed


def test_a_failed_read_without_early_copies_ends_at_once():
    with running_load(4) as (read, dev, engine, job):
        read.fail = True
        read.end.set()
        (r,) = engine.wait([job], timeout=10)
    assert not r.ok and dev.copies == []


def test_a_piece_the_device_refuses_is_copied_with_the_rest():
    with running_load(32, refuse=1) as (read, dev, engine, job):
        read.make_final(range(MIN_PIECE_BLOCKS))
        for _ in range(20):
            engine.get_finished()
            threading.Event().wait(0.002)
        assert dev.refuse_next == 0 and dev.copies == []  # refused, and no more pieces
        read.make_final(range(MIN_PIECE_BLOCKS, 32))
        read.end.set()
        poll_until(engine, lambda: len(dev.copies) == 1)
        dev.finish_all()
        (r,) = engine.wait([job], timeout=10)
    assert r.ok and copied_once(dev, list(range(32)))


def test_a_hop_that_reports_nothing_is_copied_whole_after_it():
    with running_load(64) as (read, dev, engine, job):
        read.end.set()
        poll_until(engine, lambda: len(dev.copies) == 1)
        dev.finish_all()
        (r,) = engine.wait([job], timeout=10)
    assert r.ok and len(dev.copies) == 1 and copied_once(dev, list(range(64)))


def test_early_copies_take_pieces_of_at_least_an_eighth_and_leave_the_rest():
    slots = list(range(256))
    hop = (LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu([b for s in slots for b in (2 * s, 2 * s + 1)]))
    early = EarlyCopies(hop, written=slots, handler=Device())
    assert early.min_blocks == 32 and early.take() is None
    early.add_ready(range(31))
    assert early.take() is None
    early.add_ready([31, 5, 999])  # a repeat and a slot outside the hop change nothing
    indices, (src, dst) = early.take()
    assert list(src.ids) == list(range(32)) and list(dst.ids) == list(range(64))
    early.started(indices, "handle")
    early.add_ready([0])  # copied already: never again
    assert early.take() is None
    src, dst = early.rest()
    assert list(src.ids) == list(range(32, 256)) and early.pieces == ["handle"]
    assert early.take() is None  # closed


def test_only_hops_with_whole_slots_are_taken_apart():
    assert EarlyCopies.fits((LoadStoreSpec.cpu([1, 2]), LoadStoreSpec.gpu([1, 2, 3, 4])))
    assert not EarlyCopies.fits((LoadStoreSpec.cpu([1, 2]), LoadStoreSpec.gpu([1, 2, 3])))
    assert not EarlyCopies.fits((LoadStoreSpec.cpu([]), LoadStoreSpec.gpu([])))


def test_a_caller_waiting_for_the_load_starts_its_copies_while_the_read_goes_on():
    with running_load(32) as (read, dev, engine, job):
        got = []
        waiter = threading.Thread(target=lambda: got.extend(engine.wait([job], timeout=10)))
        waiter.start()
        read.make_final(range(MIN_PIECE_BLOCKS))
        for _ in range(2000):  # the waiting thread, not this one, starts the piece
            if dev.copies:
                break
            threading.Event().wait(0.002)
        assert len(dev.copies) == 1 and not read.ended
        dev.done.add(0)
        read.end.set()
        for _ in range(2000):
            if len(dev.copies) == 2:
                break
            threading.Event().wait(0.002)
        dev.done.add(1)
        waiter.join(10)
    assert got and got[0].ok and copied_once(dev, list(range(32)))
