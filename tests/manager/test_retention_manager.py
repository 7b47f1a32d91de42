"""Retention hints through the real manager (issue 15): ``set_retention`` by request id, applied
to the blocks that request stores; the connector's helper parses kv_transfer_params leniently."""

from __future__ import annotations

import logging

import policy_sim
from trace_gen import generate

from kvtier.bench import compare
from kvtier.manager.hints import KEEP, PARAM_KEY, RetentionHint
from kvtier.manager.retention import apply_retention_hint
from kvtier.manager.specs import RequestContext
from kvtier.manager.tiered import TieredOffloadingManager


def _store(m: TieredOffloadingManager, keys, request_id: str) -> tuple:
    plan = m.prepare_store(keys, RequestContext(request_id=request_id))
    m.complete_store(plan.keys)
    return plan


def test_a_kept_request_outlives_unhinted_ones_in_the_manager():
    m = TieredOffloadingManager(cpu_blocks=4)
    m.set_retention("chat", RetentionHint(KEEP))
    _store(m, [1, 2], "chat")  # oldest, but the conversation continues
    _store(m, [3, 4], "other")
    plan = _store(m, [5, 6], "new")
    assert set(plan.evicted[next(iter(plan.evicted))]) == {3, 4}
    assert m.lookup([1, 2]).num_hits == 2
    plain = TieredOffloadingManager(cpu_blocks=4)  # the same without the hint: LRU order
    for keys, rid in (([1, 2], "chat"), ([3, 4], "other"), ([5, 6], "new")):
        _store(plain, keys, rid)
    assert plain.lookup([1, 2]).num_hits == 0


def test_connector_helper_parses_hints_and_ignores_bad_ones(caplog):
    m = TieredOffloadingManager(cpu_blocks=8)
    apply_retention_hint(m, "r1", {PARAM_KEY: {"continues": True, "session": "s"}})
    assert m.hints is not None and m.retention.by_request["r1"].session == "s"
    apply_retention_hint(m, "r2", None)  # no hint: nothing changes
    with caplog.at_level(logging.WARNING):
        apply_retention_hint(m, "r3", {PARAM_KEY: {"ttl_s": "forever"}})
    assert "ignoring retention hint of request r3" in caplog.text
    assert set(m.retention.by_request) == {"r1"}


def test_manager_replay_with_hints_matches_the_simulator():
    trace = generate("multiturn", 800, seed=5)
    spec = "lru+reuse_gate+hints"
    a = compare.replay(trace, 1500, spec)
    b = policy_sim.simulate(trace, 1500, spec)
    assert (a.hit_blocks, a.written) == (b.hit_blocks, b.written)
    assert a.hit_blocks > compare.replay(trace, 1500, "lru+reuse_gate").hit_blocks


def _action(kind: str, payload, version: str = "1"):
    from kvtier.connectors.vllm.compat.hints import KvHint  # what the connector hands the manager

    return KvHint(kind, version, "a", payload)


def test_kv_hints_retention_action_maps_to_the_same_hint():
    """vLLM 0.33 ``kv_hints``: a retention action's priority / ttl / session / continues (or
    one_off) give the hint ``kvtier_retention`` would; other actions and fields are ignored."""
    from kvtier.manager.hints import NONE, ONE_OFF

    same = RetentionHint.from_kv_hints([
        _action("prefetch", {"blocks": 3}),
        _action("kvtier_retention", {"continues": True, "ttl": 90, "session_id": "c1", "x": 1})])
    assert same == RetentionHint.parse({PARAM_KEY: {"continues": True, "ttl_s": 90,
                                                    "session": "c1"}})
    assert RetentionHint.from_kv_hints([_action("Retention", {"priority": -2})]).rank == ONE_OFF
    assert RetentionHint.from_kv_hints([_action("retention", {"one_off": True})]).rank == ONE_OFF
    assert RetentionHint.from_kv_hints([_action("retention", {"ttl_seconds": 5})]).rank == NONE
    assert RetentionHint.from_kv_hints([_action("prefetch", {})]) is None
    assert RetentionHint.from_kv_hints(()) is None


def test_kv_hints_feed_the_manager_and_kv_transfer_params_win(caplog):
    m = TieredOffloadingManager(cpu_blocks=4)
    apply_retention_hint(m, "chat", None, [_action("retention", {"continues": True})])
    _store(m, [1, 2], "chat")  # oldest, but the router says the conversation continues
    _store(m, [3, 4], "other")
    plan = _store(m, [5, 6], "new")
    assert set(plan.evicted[next(iter(plan.evicted))]) == {3, 4}
    apply_retention_hint(m, "both", {PARAM_KEY: {"continues": False}},
                         [_action("retention", {"continues": True})])
    assert m.retention.by_request["both"].rank != KEEP
    with caplog.at_level(logging.WARNING):
        apply_retention_hint(m, "bad1", None, [_action("retention", {"ttl": "1h"})])
        apply_retention_hint(m, "bad2", None, [_action("retention", {"priority": 1}, "2")])
        apply_retention_hint(m, "bad3", None, [_action("retention", ["keep"])])
    assert "request bad1" in caplog.text and "action_version" in caplog.text
    assert "payload must be an object" in caplog.text
    assert not {"bad1", "bad2", "bad3"} & set(m.retention.by_request)
