"""Model checking of the tiered manager: random operations against a reference model.

tests/manager/test_manager.py has a small state machine over a byte model; this one scales it up and
adds what it lacks: exact pin accounting after every step, events vs. tier contents, disk
health (failing disk, cool-down, probes), double completions, and restarts from the disk
index. CI runs ~20k operations (hypothesis, shrinking on failure) plus 40k seeded random
ones; ``--runslow`` runs a million. Mutation tests at the end prove the checks bite.
"""

from __future__ import annotations

import logging
import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from reliability.model import ManagerModel, run_random

from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.eviction import CpuEviction
from kvtier.manager.index.tier_index import TierIndex
from kvtier.manager.tiered import TieredOffloadingManager

KEYS = st.lists(st.integers(0, 23), min_size=1, max_size=4, unique=True)
PICK = st.integers(0, 63)
TOTAL = {"ops": 0}


@pytest.fixture(autouse=True)
def quiet_logs():
    logging.disable(logging.WARNING)  # degraded-disk episodes log on purpose, thousands of times
    yield
    logging.disable(logging.NOTSET)


class ModelMachine(RuleBasedStateMachine):
    model: ManagerModel | None = None

    @initialize(policy=st.sampled_from(["lru", "arc"]))
    def boot(self, policy):
        self.model = ManagerModel(policy)

    def _ready(self):
        return self.model is not None

    @precondition(_ready)
    @rule(idx=KEYS)
    def store(self, idx):
        self.model.store(idx)

    @precondition(_ready)
    @rule(pick=PICK, ok=st.booleans())
    def complete_store(self, pick, ok):
        self.model.complete_store(pick, ok)

    @precondition(_ready)
    @rule(idx=KEYS)
    def load(self, idx):
        self.model.load(idx)

    @precondition(_ready)
    @rule(pick=PICK)
    def complete_load(self, pick):
        self.model.complete_load(pick)

    @precondition(_ready)
    @rule(pick=PICK, ok=st.booleans(), corrupt=st.booleans())
    def background(self, pick, ok, corrupt):
        self.model.background(pick, ok, corrupt)

    @precondition(_ready)
    @rule(idx=KEYS)
    def touch(self, idx):
        self.model.touch(idx)

    @precondition(_ready)
    @rule(failing=st.booleans())
    def disk_failing(self, failing):
        self.model.set_disk_failing(failing)

    @precondition(_ready)
    @rule(seconds=st.floats(0, 30))
    def tick(self, seconds):
        self.model.tick(seconds)

    @precondition(_ready)
    @rule()
    def complete_twice(self):
        self.model.complete_twice()

    @precondition(_ready)
    @rule()
    def reset(self):
        self.model.reset()

    @invariant()
    def invariants(self):
        if self.model is not None:
            self.model.check()

    def teardown(self):
        if self.model is not None:
            self.model.finish()
            TOTAL["ops"] += self.model.counts.ops


def test_state_machine_against_reference_model():
    TOTAL["ops"] = 0
    run_state_machine_as_test(ModelMachine, settings=settings(
        # 120: some complete_load steps find nothing in flight; the op total below keeps
        # its margin
        max_examples=120, stateful_step_count=200, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert TOTAL["ops"] >= 10_000, TOTAL  # hypothesis may end runs early; most run to the end


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_seeded_random_operations(policy):
    model = ManagerModel(policy)
    run_random(model, random.Random(policy), 20_000)
    c = model.counts
    assert c.ops >= 20_000 and c.pins_checked >= 20_000
    # the run reached every corner it is meant to
    assert min(c.cpu_hits, c.disk_hits, c.pending_lookups, c.promotions, c.failed_promotions,
               c.demotions, c.drops, c.resets, c.degradations) > 0, c


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_million_operations(policy):
    model = ManagerModel(policy)
    run_random(model, random.Random(f"long-{policy}"), 500_000)
    assert model.counts.ops >= 500_000


@pytest.mark.slow
def test_state_machine_long():
    run_state_machine_as_test(ModelMachine, settings=settings(
        max_examples=1000, stateful_step_count=500, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# -- the model catches broken managers --------------------------------------------------------

def _leak_disk_reader(self, key, bad):
    pass  # never releases the disk pin of a promotion


def _drop_cpu_silently(self, keys):
    for key in keys:
        self.cpu.remove(key)  # evicts without BlockRemoved


def _ready_while_writing(self, key):
    return self.entries.get(key)  # WRITING blocks become readable


def _admit_everything(self, n):
    return n  # ignores degradation


@pytest.mark.parametrize("target, name, broken, message", [
    (TieredOffloadingManager, "_release_disk_reader", _leak_disk_reader, "pins"),
    (CpuEviction, "_drop", _drop_cpu_silently, "events disagree"),
    (TierIndex, "ready", _ready_while_writing, "while being"),
    (DiskHealth, "admit", _admit_everything, "probe"),
], ids=["pin-leak", "missing-event", "readable-while-writing", "degraded-ignored"])
def test_model_catches_broken_manager(monkeypatch, target, name, broken, message):
    monkeypatch.setattr(target, name, broken)
    with pytest.raises(AssertionError, match=message):
        run_random(ManagerModel("lru"), random.Random(3), 20_000)
