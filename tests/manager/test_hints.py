"""Retention hints (issue 15): parsed strictly from kv_transfer_params, bounded, expiring, and a
hinted block outranks an unhinted one in eviction and admission without ever being required."""

from __future__ import annotations

import pytest

from policy_sim import parse_spec, simulate
from trace_gen import generate
from kvtier.manager.hints import KEEP, NONE, ONE_OFF, PARAM_KEY, HintBook, RetentionHint
from kvtier.manager.policies import make_policy
from kvtier.manager.policies.hinted import HintedEviction


def test_parse_hint_from_kv_transfer_params():
    assert RetentionHint.parse(None) is None and RetentionHint.parse({"other": 1}) is None
    h = RetentionHint.parse({PARAM_KEY: {"continues": True, "ttl_s": 60, "session": "s1"}})
    assert (h.rank, h.ttl_s, h.session) == (KEEP, 60.0, "s1")
    assert RetentionHint.parse({PARAM_KEY: {"continues": False}}).rank == ONE_OFF
    assert RetentionHint.parse({PARAM_KEY: {"priority": 3}}).rank == KEEP
    assert RetentionHint.parse({PARAM_KEY: {"priority": -1}}).rank == ONE_OFF
    assert RetentionHint.parse({PARAM_KEY: {}}).rank == NONE


@pytest.mark.parametrize("raw, field", [
    ("keep", "must be an object"), ({"continues": "yes"}, "continues"),
    ({"priority": True}, "priority"), ({"ttl_s": -5}, "ttl_s"), ({"ttl_s": "1h"}, "ttl_s"),
    ({"sesion": "x"}, "unknown field"), ({"session": [1]}, "session"),
])
def test_malformed_hint_is_a_clear_error(raw, field):
    with pytest.raises(ValueError, match=field):
        RetentionHint.parse({PARAM_KEY: raw})


def test_hint_book_expires_and_stays_bounded():
    now = [0.0]
    book = HintBook(4, clock=lambda: now[0])
    book.note(["a", "b"], RetentionHint(KEEP, ttl_s=10))
    book.note(["x"], RetentionHint(ONE_OFF))
    assert book.rank("a") == KEEP and book.rank("x") == ONE_OFF and book.rank("z") == NONE
    for i in range(50):  # one-off marks never push kept blocks out
        book.note([("once", i)], RetentionHint(ONE_OFF))
    assert book.rank("b") == KEEP and len(book) == 2
    book.note(["c", "d", "e"], RetentionHint(KEEP, ttl_s=10))  # bounded: "a" dropped
    assert book.rank("a") == NONE and len(book) == 4
    now[0] = 11.0
    assert book.rank("e") == NONE  # expired


def test_kept_blocks_are_evicted_after_unhinted_ones_and_only_then():
    book = HintBook(100, clock=lambda: 0.0)
    policy = HintedEviction(make_policy("lru", 10), book)
    for key in range(6):
        policy.insert(key)
    book.note([0, 1], RetentionHint(KEEP))
    assert policy.victims(3, lambda k: True) == [2, 3, 4]  # LRU alone: [0, 1, 2]
    for key in (2, 3, 4):
        policy.remove(key)
    assert sorted(policy.victims(3, lambda k: True)) == [0, 1, 5]  # nothing unhinted left
    assert sorted(policy.victims(2, lambda k: k != 5)) == [0, 1]


def test_a_router_hint_source_buys_hits_on_multi_turn_traffic():
    """The multiturn trace knows which conversations continue (what a router knows): with those
    hints the default gains hits and writes no more than without."""
    assert parse_spec("lru+reuse_gate+hints") == ("lru", "reuse_gate")
    trace = generate("multiturn", 3000, seed=3)
    plain = simulate(trace, 4000, "lru+reuse_gate")
    hinted = simulate(trace, 4000, "lru+reuse_gate+hints")
    assert hinted.hit_rate > plain.hit_rate + 0.01
    lru_hinted = simulate(trace, 4000, "lru+hints")
    assert lru_hinted.hit_rate > simulate(trace, 4000, "lru").hit_rate
