"""A load issued while the shared tier stores: it goes between the store's rounds (real
Valkey, the real I/O processes)."""

from __future__ import annotations

import threading
import time

import torch

from kvtier.runtime import disk_wire as wire
from support.remote_processes import BLOCK, fill, keys_of, open_io, remote_cfg
from support.valkey_fixtures import valkey  # noqa: F401 - pytest fixture


def test_a_load_goes_between_the_rounds_of_a_store(tmp_path, valkey, monkeypatch):
    """A child serves one request at a time: a load issued while a large store runs waited
    for the whole store (in vLLM: a 24 MiB hit took 150 ms behind its instance's 1 GiB
    stores, and the cost model shunned the tier). A store now goes in rounds, and a round
    starts only once no load is waiting."""
    pool, io = open_io(remote_cfg(tmp_path, url=valkey().url, timeout_s=5.0),
                       put_round_bytes=2 * BLOCK)
    try:
        assert io.warm_up() == 2
        want = fill(pool, range(8))
        assert io.put_slots(list(range(8)), keys_of(8, "old")) == [True] * 8
        fill(pool, range(8, 40), seed=1)
        ops: list[int] = []
        got: dict = {}
        loader = threading.Thread(
            target=lambda: got.update(r=io.fetch_slots(keys_of(8, "old"), list(range(40, 48)))))
        run = io._run

        def recording(op, slots, keys, ready=None, **kw):
            ops.append(("start", op))
            if op == wire.PUT and ops.count(("start", wire.PUT)) == 1:  # a load comes
                loader.start()
                deadline = time.monotonic() + 5
                while not io._reads_waiting and time.monotonic() < deadline:
                    time.sleep(0.001)
            try:
                return run(op, slots, keys, ready, **kw)
            finally:
                ops.append(("end", op))

        monkeypatch.setattr(io, "_run", recording)
        assert io.put_slots(list(range(8, 40)), keys_of(32, "new")) == [True] * 32
        loader.join(10)
        assert ops.count(("start", wire.PUT)) == 8  # 32 blocks, 2 per child a round
        # the load ended before the store's second round started
        assert ops.index(("end", wire.FETCH)) < [i for i, o in enumerate(ops)
                                                 if o == ("start", wire.PUT)][1]
        assert got["r"].failed == []
        assert all(torch.equal(pool.slot(40 + k), want[k]) for k in range(8))
    finally:
        io.close()


def test_a_round_is_a_byte_budget_and_at_least_one_block(tmp_path, valkey, monkeypatch):
    """The round is bytes per child, so a model with large blocks stores few blocks a round
    (a load waits at most one round); a budget under one block still stores a block a round."""
    pool, io = open_io(remote_cfg(tmp_path, url=valkey().url, timeout_s=5.0),
                       put_round_bytes=BLOCK // 2)
    try:
        assert io.warm_up() == 2
        want = fill(pool, range(6))
        run = io._run
        sizes: list[int] = []

        def recording(op, slots, keys, ready=None, **kw):
            out = run(op, slots, keys, ready, **kw)
            sizes.append([len(share) for share, _ in out])
            return out

        monkeypatch.setattr(io, "_run", recording)
        assert io.put_slots(list(range(6)), keys_of(6, "r")) == [True] * 6
        # one block per child per round, and a round goes to every child (not only to as
        # many as a load's minimum share per child allows)
        assert sizes == [[1, 1], [1, 1], [1, 1]]
        monkeypatch.setattr(io, "_run", run)
        assert io.fetch_slots(keys_of(6, "r"), list(range(10, 16))).failed == []
        assert all(torch.equal(pool.slot(10 + k), want[k]) for k in range(6))
    finally:
        io.close()
