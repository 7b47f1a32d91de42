"""The TP-1 fast path (kvtier/connectors/vllm/fast_path.py): one module, one switch."""

from __future__ import annotations

import threading

import pytest

from kvtier.connectors.vllm.fast_path import FastPath, WorkerHandoff
from kvtier.connectors.vllm.settings import ConnectorSetupError, same_thread_fast_path
from kvtier.manager.tiered import TieredOffloadingManager


class Worker:
    """A colocated worker that records what the scheduler side asked of it."""

    def __init__(self, least: int | None = 1) -> None:
        self.hook_thread = threading.get_ident()
        self.least = least
        self.calls: list[tuple] = []

    def submit_ahead(self, job, flush):
        self.calls.append(("submit", job, flush))

    def prefetch_min_bytes(self):
        return self.least

    def prefetch_load(self, slots, whole=False):
        self.calls.append(("prefetch", tuple(slots), whole))
        return True

    def drop_prefetch(self):
        self.calls.append(("drop",))


def _manager_with(keys):
    m = TieredOffloadingManager(cpu_blocks=8)
    plan = m.prepare_store(keys)
    m.complete_store(plan.keys)
    return m, plan.cpu_slots


def test_the_lookup_prefetches_the_hits_slots_and_a_later_pass_drops_it_unused():
    keys = [b"a", b"b", b"c"]
    m, slots = _manager_with(keys)
    handoff, worker = WorkerHandoff(), Worker()
    handoff.attach(worker)
    fast = FastPath(handoff)
    assert fast.prefetch(m, keys, nbytes=3, whole=True)
    assert worker.calls == [("prefetch", tuple(slots), True)]
    assert m.pins() == 0  # a hint pins nothing
    fast.drop()
    fast.drop()  # dropped once only
    assert worker.calls[1:] == [("drop",)]
    assert fast.submit("job", (7,)) and worker.calls[-1] == ("submit", "job", (7,))


def test_no_prefetch_below_the_workers_size_or_for_blocks_not_ready():
    keys = [b"a", b"b"]
    m, _ = _manager_with(keys)
    handoff, worker = WorkerHandoff(), Worker(least=100)
    handoff.attach(worker)
    fast = FastPath(handoff)
    assert not fast.prefetch(m, keys, nbytes=99)
    worker.least = 1
    assert not fast.prefetch(m, keys + [b"absent"], nbytes=300)  # not every key READY
    assert worker.calls == []


def test_the_switch_off_or_another_thread_never_calls_the_worker():
    keys = [b"a"]
    m, _ = _manager_with(keys)
    handoff, worker = WorkerHandoff(), Worker()
    handoff.attach(worker)
    off = FastPath(handoff, enabled=False)
    assert not off.prefetch(m, keys, nbytes=10) and not off.submit("job", ())
    on = FastPath(handoff)
    out = []
    t = threading.Thread(target=lambda: out.append((on.prefetch(m, keys, 10),
                                                    on.submit("job", ()))))
    t.start()
    t.join()
    assert out == [(False, False)] and worker.calls == []


def test_the_switch_is_a_boolean_extra_config_key():
    assert same_thread_fast_path(None) is True
    assert same_thread_fast_path({"same_thread_fast_path": False}) is False
    with pytest.raises(ConnectorSetupError, match="same_thread_fast_path must be true or false"):
        same_thread_fast_path({"same_thread_fast_path": "no"})
