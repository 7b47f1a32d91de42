"""A load issued while the shared tier stores: it goes between the store's rounds (real
Valkey, the real I/O processes)."""

from __future__ import annotations

import threading
import time

import torch

from kvtier.tiers.child import wire
from support.remote_processes import BLOCK, fill, keys_of, open_io, remote_cfg
from support.valkey_fixtures import valkey  # noqa: F401 - pytest fixture


def record_requests(monkeypatch, on_request=None) -> list[tuple[int, int]]:
    """(op, blocks) of every request sent to an I/O process, in order."""
    sent: list[tuple[int, int]] = []
    encode = wire.encode_request

    def recording(op, slots, keys):
        sent.append((op, len(keys)))
        if on_request is not None:
            on_request(op)
        return encode(op, slots, keys)

    monkeypatch.setattr(wire, "encode_request", recording)
    return sent


def test_a_load_goes_between_the_rounds_of_a_store(tmp_path, valkey, monkeypatch):
    """A child serves one request at a time: a load issued while a large store runs waited
    for the whole store (in vLLM: a 24 MiB hit took 150 ms behind its instance's 1 GiB
    stores, and the cost model shunned the tier). A store now streams each child's share in
    rounds, and a child sends no further round while a load waits."""
    pool, io = open_io(remote_cfg(tmp_path, url=valkey().url, timeout_s=5.0),
                       put_round_bytes=2 * BLOCK)
    try:
        assert io.warm_up() == 2
        want = fill(pool, range(8))
        assert io.put_slots(list(range(8)), keys_of(8, "old")) == [True] * 8
        fill(pool, range(8, 40), seed=1)
        got: dict = {}
        loader = threading.Thread(
            target=lambda: got.update(r=io.fetch_slots(keys_of(8, "old"), list(range(40, 48)))))

        def on_request(op):
            if op == wire.PUT and not loader.is_alive() and "r" not in got:  # a load comes
                loader.start()
                deadline = time.monotonic() + 5
                while not io._reads_waiting and time.monotonic() < deadline:
                    time.sleep(0.001)

        sent = record_requests(monkeypatch, on_request)
        assert io.put_slots(list(range(8, 40)), keys_of(32, "new")) == [True] * 32
        loader.join(10)
        puts = [i for i, (op, _) in enumerate(sent) if op == wire.PUT]
        assert [sent[i][1] for i in puts] == [2] * 16  # 32 blocks, 2 per child a round
        fetch = [i for i, (op, _) in enumerate(sent) if op == wire.FETCH]
        # the load went out after each child's first round, before any further one
        assert len(fetch) == 1 and sum(1 for i in puts if i < fetch[0]) == 2
        assert got["r"].failed == []
        assert all(torch.equal(pool.slot(40 + k), want[k]) for k in range(8))
    finally:
        io.close()


def test_a_round_is_a_byte_budget_and_at_least_one_block(tmp_path, valkey, monkeypatch):
    """The round is bytes per child, so a model with large blocks stores few blocks a round
    (a load waits at most one round); a budget under one block still stores a block a round,
    and a store goes to every child, not only to as many as a load's minimum share allows."""
    pool, io = open_io(remote_cfg(tmp_path, url=valkey().url, timeout_s=5.0),
                       put_round_bytes=BLOCK // 2)
    try:
        assert io.warm_up() == 2
        want = fill(pool, range(6))
        fan_out = io._fan_out
        widths: list[int] = []

        def recording(children, *args, **kw):
            widths.append(len(children))
            return fan_out(children, *args, **kw)

        monkeypatch.setattr(io, "_fan_out", recording)
        sent = record_requests(monkeypatch)
        assert io.put_slots(list(range(6)), keys_of(6, "r")) == [True] * 6
        assert sent == [(wire.PUT, 1)] * 6 and widths == [2]
        assert io.fetch_slots(keys_of(6, "r"), list(range(10, 16))).failed == []
        assert all(torch.equal(pool.slot(10 + k), want[k]) for k in range(6))
    finally:
        io.close()


def test_a_child_lost_in_the_middle_of_a_store_loses_its_rounds_only(tmp_path, valkey,
                                                                      monkeypatch):
    """A child killed between two of its rounds: its unsent blocks read not stored, the other
    child's are stored, and nothing waits for a dead child's deadline."""
    pool, io = open_io(remote_cfg(tmp_path, url=valkey().url, timeout_s=5.0),
                       put_round_bytes=BLOCK, respawn_after_s=60.0)
    try:
        assert io.warm_up() == 2
        fill(pool, range(8))
        victim = io._children[(io._next + 1) % 2]  # the child the store's first share goes to
        count = [0]

        def on_request(op):
            count[0] += 1
            if count[0] == 3:  # after each child's first round: kill the first child
                victim.proc.kill()
                victim.proc.wait()

        record_requests(monkeypatch, on_request)
        t = time.monotonic()
        ok = io.put_slots(list(range(8)), keys_of(8, "k"))
        assert time.monotonic() - t < 5.0
        assert sum(ok) >= 4 and not all(ok)  # the other child's share, and the first round
        assert ok[4:] == [True] * 4 or ok[:4] == [True] * 4
    finally:
        io.close()
