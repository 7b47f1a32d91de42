"""The manager against a reference model, one operation at a time, invariants after each.

``ManagerModel`` drives a real TieredOffloadingManager the way the connector does (a lookup that
finds disk blocks starts their promotion into CPU memory, a background transfer, and answers
"not yet"; a load is planned with ``prepare_load`` over READY CPU blocks only; every plan is
later completed once; background transfers are taken after every call) and simulates the
worker side with plain dictionaries: which key's bytes sit in which CPU slot, which keys have a
record on disk. After every operation ``check()`` proves:

* capacity: no tier over capacity; CPU slots unique, in range, and free + used == capacity;
* pins: ``manager.pins()`` equals exactly what the outstanding operations should hold, so a
  leaked (or double-released) pin fails at the step that caused it, not at teardown;
* nothing readable while being written: a key with a store, promotion or demotion in flight is
  not READY in the tier being written, and a CPU hit's slot holds exactly that key's bytes;
* events: the READY sets of both tiers equal what BlockStored / BlockRemoved events said;
* disk health: while degraded, at most one one-block probe demotion is in flight.

``finish()`` completes everything still outstanding and checks that nothing is left: no pin,
no background transfer, no pending drop, and no protocol error beyond the ones provoked.
Operations are plain methods so hypothesis rules and a seeded random driver share them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.events import BlockRemoved, BlockStored
from kvtier.manager.specs import Medium
from kvtier.manager.index.tier_index import BlockState
from kvtier.manager.tiered import TieredOffloadingManager

GARBAGE = b"<garbage>"


def mk(i: int) -> bytes:
    return f"key-{i}".encode()


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class ModelCounts:
    ops: int = 0
    by_op: dict = field(default_factory=dict)
    resets: int = 0
    degradations: int = 0
    pins_checked: int = 0
    cpu_hits: int = 0
    disk_hits: int = 0  # loads of blocks promoted from disk
    pending_lookups: int = 0  # lookups answered "not yet" (a promotion in flight)
    promotions: int = 0
    failed_promotions: int = 0
    demotions: int = 0
    drops: int = 0


class ManagerModel:
    def __init__(self, policy: str = "lru", cpu: int = 6, disk: int = 10, flush_reserve: int = 3,
                 keyspace: int = 24) -> None:
        self.policy, self.cpu_cap, self.disk_cap = policy, cpu, disk
        self.flush_reserve = flush_reserve
        self.keyspace = keyspace
        self.clock = _Clock()
        self.disk_data: dict[bytes, bytes] = {}  # survives resets; insertion order = age
        self.disk_failing = False
        self.expected_protocol_errors = 0
        self.counts = ModelCounts()
        self._boot([])

    def _boot(self, initial: list[bytes]) -> None:
        self.health = DiskHealth(fail_threshold=2, retry_after_s=5.0, max_retry_after_s=20.0,
                                 clock=self.clock)
        self.m = TieredOffloadingManager(
            cpu_blocks=self.cpu_cap, disk_blocks=self.disk_cap, cpu_eviction=self.policy,
            disk_eviction=self.policy, flush_reserve=self.flush_reserve,
            initial_disk_keys=initial, disk_health=self.health)
        self.slot_data: dict[int, bytes] = {}
        self.stores: dict[int, object] = {}
        self.loads: dict[int, object] = {}
        self.bg: dict[int, object] = {}
        self.probes: set[int] = set()
        self._next = 0
        self.cpu_view: set[bytes] = set()
        self.disk_view: set[bytes] = set(initial[max(0, len(initial) - self.disk_cap):])
        self.protocol_base = 0
        self._after_call(degraded_before=False)

    # -- plumbing ---------------------------------------------------------------------------
    def _id(self) -> int:
        self._next += 1
        return self._next

    def _count(self, name: str) -> None:
        self.counts.ops += 1
        self.counts.by_op[name] = self.counts.by_op.get(name, 0) + 1

    def _after_call(self, degraded_before: bool) -> None:
        """Take new background transfers (as the connector does each step) and events."""
        for t in self.m.take_background_transfers():
            self.bg[t.id] = t
            if t.dst.medium is Medium.CPU:  # a promotion reads a record the disk holds
                for key in t.keys:
                    assert key in self.disk_data, "promotion of a key with no record on disk"
            if t.dst.medium is Medium.DISK:
                for key, slot in zip(t.keys, t.src.ids):
                    assert self.slot_data.get(slot) == key, "demotion reads a slot not holding its key"
                if degraded_before:
                    assert len(t.keys) <= self.health.probe_blocks and not self.probes, \
                        "degraded disk got more than one small probe demotion"
                    self.probes.add(t.id)
        for ev in self.m.take_events():
            view = {Medium.CPU: self.cpu_view, Medium.DISK: self.disk_view}.get(ev.medium)
            if view is None:
                continue
            if isinstance(ev, BlockStored):
                view.update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                view.difference_update(ev.keys)
        if self.m.stats.disk_degraded and not degraded_before:
            self.counts.degradations += 1

    def _call(self, name: str, fn, *args):
        degraded = self.m.stats.disk_degraded
        self._count(name)
        out = fn(*args)
        self._after_call(degraded)
        return out

    # -- operations -------------------------------------------------------------------------
    def store(self, idx: list[int]) -> None:
        keys = [mk(i) for i in idx]
        plan = self._call("prepare_store", self.m.prepare_store, keys)
        assert len(set(plan.keys)) == len(plan.keys) and set(plan.keys) <= set(keys)
        busy = {s for p in self.stores.values() for s in p.cpu_slots}
        busy |= {s for p in self.loads.values() for s in p.cpu_slots}
        busy |= {s for t in self.bg.values() if t.src.medium is Medium.CPU for s in t.src.ids}
        assert not set(plan.cpu_slots) & busy, "a slot in use by an in-flight op was handed out"
        if plan.keys:
            self.stores[self._id()] = plan

    def complete_store(self, pick: int, ok: bool) -> None:
        if not self.stores:
            return
        op = sorted(self.stores)[pick % len(self.stores)]
        plan = self.stores.pop(op)
        for key, slot in zip(plan.keys, plan.cpu_slots):
            self.slot_data[slot] = key if ok else GARBAGE
        self._call("complete_store", self.m.complete_store, plan.keys, ok)

    def _promoting(self) -> set[bytes]:
        return {k for t in self.bg.values() if t.dst.medium is Medium.CPU for k in t.keys}

    def load(self, idx: list[int]) -> None:
        keys = [mk(i) for i in idx]
        found = self._call("lookup", self.m.lookup, keys)
        if found.pending:  # a promotion is on its way: the request asks again later
            self.counts.pending_lookups += 1
            assert self._promoting() & set(keys), "pending with no promotion of its keys"
            return
        plan = self._call("prepare_load", self.m.prepare_load, keys[:found.num_hits])
        assert plan.keys == tuple(keys[: len(plan.keys)])
        writing = {k for p in self.stores.values() for k in p.keys}
        promoting = self._promoting()
        for key, slot in zip(plan.keys, plan.cpu_slots):
            assert key not in writing, "a block being written was handed out for reading"
            assert key not in promoting, "a block being promoted was handed out for reading"
            assert self.slot_data.get(slot) == key, "CPU hit points at another block's bytes"
        if plan.keys:
            self.loads[self._id()] = plan
            disk = sum(1 for m in plan.sources if m is Medium.DISK)
            self.counts.disk_hits += disk
            self.counts.cpu_hits += len(plan.keys) - disk

    def complete_load(self, pick: int, corrupt: bool = False) -> None:
        """Settle a load (a CPU -> GPU copy: it reads its slots, which stay what they were)."""
        if not self.loads:
            return
        op = sorted(self.loads)[pick % len(self.loads)]
        plan = self.loads.pop(op)
        for key, slot in zip(plan.keys, plan.cpu_slots):
            assert self.slot_data.get(slot) == key, "slot changed under a pinned CPU hit"
        self._call("complete_load", self.m.complete_load, plan.keys)

    def background(self, pick: int, ok: bool, corrupt: bool = False) -> None:
        """Settle a background transfer; ``corrupt``: a promotion finds its first record bad."""
        if not self.bg:
            return
        tid = sorted(self.bg)[pick % len(self.bg)]
        t = self.bg.pop(tid)
        self.probes.discard(tid)
        failed: list[bytes] = []
        if t.dst.medium is Medium.CPU:  # a promotion from disk into CPU memory
            self.counts.promotions += 1
            for i, (key, slot) in enumerate(zip(t.keys, t.dst.ids)):
                assert self.disk_data.get(key) == key, "disk record gone under a promotion"
                if not ok or (corrupt and i == 0):
                    self.slot_data[slot] = GARBAGE
                    if ok:  # the store drops a record that fails to verify
                        failed.append(key)
                        self.disk_data.pop(key, None)
                else:
                    self.slot_data[slot] = key
            self.counts.failed_promotions += bool(failed) or not ok
            self._call("complete_background", self.m.complete_background, tid, ok, failed)
            return
        if t.dst.medium is Medium.DISK:
            ok = ok and not self.disk_failing
            self.counts.demotions += ok
            for key, slot in zip(t.keys, t.src.ids):
                assert self.slot_data.get(slot) == key, "slot changed under a running demotion"
                if ok:
                    self.disk_data.pop(key, None)
                    self.disk_data[key] = key
        elif ok:  # DROP
            self.counts.drops += 1
            for key in t.keys:
                self.disk_data.pop(key, None)
        self._call("complete_background", self.m.complete_background, tid, ok)

    def complete_twice(self) -> None:
        """Complete a background transfer id that is not outstanding: counted, ignored."""
        pins = self.m.pins()
        self._call("complete_twice", self.m.complete_background, 10**9 + self._id(), True)
        self.expected_protocol_errors += 1
        assert self.m.pins() == pins

    def touch(self, idx: list[int]) -> None:
        self._call("touch", self.m.touch, [mk(i) for i in idx])

    def set_disk_failing(self, failing: bool) -> None:
        self._count("disk_failing")
        self.disk_failing = failing

    def tick(self, seconds: float) -> None:
        self._count("tick")
        self.clock.t += seconds

    def reset(self) -> None:
        """The process restarts: in-flight work vanishes (demotions not persisted, deletions not
        run), CPU memory is lost, and the disk index comes back oldest first."""
        self._count("reset")
        self.counts.resets += 1
        self.expected_protocol_errors = 0
        self._boot(list(self.disk_data))

    # -- invariants -------------------------------------------------------------------------
    def expected_pins(self) -> int:
        n = sum(len(p.keys) for p in self.stores.values())
        n += sum(len(p.keys) for p in self.loads.values())
        # a demotion pins its CPU slots and the disk entries it writes; a promotion the disk
        # entries it reads and the CPU slots it writes; every transfer counts once more
        n += sum(2 * len(t.keys) + 1 if Medium.CPU in (t.src.medium, t.dst.medium) else 1
                 for t in self.bg.values())
        return n

    def check(self) -> None:
        m = self.m
        cpu, disk = m.cpu, m.disk
        assert len(cpu) <= cpu.capacity and len(disk) <= disk.capacity
        slots = [e.slot for e in cpu.entries.values()]
        assert len(slots) == len(set(slots)) and all(0 <= s < cpu.capacity for s in slots)
        assert len(slots) + len(cpu.free_handles()) == cpu.capacity
        assert not set(slots) & set(cpu.free_handles())
        assert len(cpu.policy) == len(cpu) and len(disk.policy) == len(disk)
        pins, want = m.pins(), self.expected_pins()
        assert pins == want, f"manager holds {pins} pins, outstanding operations account for {want}"
        self.counts.pins_checked += 1
        for p in self.stores.values():
            for key in p.keys:
                assert cpu.ready(key) is None, "block readable in CPU while being stored"
        for p in self.loads.values():
            for key in p.keys:
                assert cpu.ready(key) is not None, "block with an in-flight load was evicted"
        for key in self._promoting():
            assert cpu.ready(key) is None, "promotion readable before it completed"
        for t in self.bg.values():
            if t.dst.medium is Medium.DISK:
                for key in t.keys:
                    assert disk.ready(key) is None, "demotion readable on disk before it completed"
        ready_cpu = {k for k, e in cpu.entries.items() if e.state is BlockState.READY}
        ready_disk = {k for k, e in disk.entries.items() if e.state is BlockState.READY}
        assert ready_cpu == self.cpu_view, "CPU events disagree with the CPU tier"
        assert ready_disk == self.disk_view, "DISK events disagree with the disk tier"
        assert ready_disk <= set(self.disk_data), "manager lists a disk block with no record"
        assert m.stats.protocol_errors == self.expected_protocol_errors

    def finish(self) -> None:
        """Complete every outstanding operation; nothing may be left behind."""
        while self.stores or self.loads or self.bg:
            for op in list(self.stores):
                self.complete_store(0, False)
            for op in list(self.loads):
                self.complete_load(0, False)
            for tid in list(self.bg):
                self.background(0, True)
        self.check()
        m = self.m
        assert m.pins() == 0, "pin leak"
        assert not m.background.pending and not m.background.ready and not m.writeback.pending_drops
        assert not m._promotions
        assert all(e.state is BlockState.READY and not e.flushing and e.readers == 0
                   for tier in (m.cpu, m.disk) for e in tier.entries.values())


def run_random(model: ManagerModel, rng: random.Random, n_ops: int, check_every: int = 1) -> None:
    """Seeded random operations (the long variant: no hypothesis overhead)."""
    ks = model.keyspace

    def keys() -> list[int]:
        return rng.sample(range(ks), rng.randint(1, 4))

    start = model.counts.ops
    while model.counts.ops - start < n_ops:
        r = rng.random()
        if r < 0.22:
            model.store(keys())
        elif r < 0.40:
            model.complete_store(rng.randrange(64), rng.random() < 0.9)
        elif r < 0.56:
            model.load(keys())
        elif r < 0.70:
            model.complete_load(rng.randrange(64))
        elif r < 0.88:
            model.background(rng.randrange(64), rng.random() < 0.9, rng.random() < 0.1)
        elif r < 0.93:
            model.touch(keys())
        elif r < 0.96:
            model.tick(rng.uniform(0, 8))
        elif r < 0.985:
            model.set_disk_failing(rng.random() < 0.3)
        elif r < 0.995:
            model.complete_twice()
        else:
            model.reset()
        if model.counts.ops % check_every == 0:
            model.check()
    model.finish()
