"""reuse_gate measures whether gating pays (issue 15): the shadow caches must replay what LRU
and the gate would do, switch gating off where refused blocks come back, and keep it where it
saves writes without losing hits."""

from __future__ import annotations

from kvtier.bench.policy_sim import simulate
from kvtier.bench.trace_gen import generate
from kvtier.manager.admission.reuse_gate import ReuseGate
from kvtier.manager.admission.shadow import ShadowCaches


def test_unsampled_admit_all_shadow_counts_exactly_lru_prefix_hits():
    trace = generate("chat", 600, seed=4)
    for c in (200, 1500):
        shadow = ShadowCaches(c, mini_blocks=c, window=1e18)  # no sampling, no decay
        for r in trace:
            shadow.observe(r.hash_ids, len(r.hash_ids))
        assert round(shadow.hits_all) == simulate(trace, c, "lru").hit_blocks
        assert round(shadow.hits_gated) == round(shadow.hits_all)  # nothing refused


def test_sampled_shadow_estimates_the_hit_rate_within_two_points():
    trace = generate("zipf", 1500, seed=2)
    lru = simulate(trace, 3000, "lru").hit_rate
    shadow = ShadowCaches(3000, mini_blocks=750, window=1e18)  # a quarter of the keys
    for r in trace:
        shadow.observe(r.hash_ids, len(r.hash_ids))
    assert shadow.mini_blocks == 750
    assert abs(shadow.hits_all / shadow.looked_up - lru) < 0.02


def test_gating_stops_when_refused_blocks_come_back():
    shadow = ShadowCaches(100, mini_blocks=100)
    for i in range(400):  # the same 50 keys again and again; the gate would refuse them all
        shadow.observe([("hot", j) for j in range(50)], refuse_from=0)
    assert shadow.hits_gated == 0 and shadow.hits_all > 0
    assert not shadow.gating_pays(True) and not shadow.gating_pays(False)


def test_gating_starts_when_refusing_one_offs_keeps_the_hot_set():
    shadow = ShadowCaches(100, mini_blocks=100)
    for i in range(400):  # 80 hot keys, then 40 one-off keys a gate refuses
        keys = [("hot", j) for j in range(80)] + [("once", i, j) for j in range(40)]
        shadow.observe(keys, refuse_from=80)
    assert shadow.hits_gated > shadow.hits_all
    assert shadow.gating_pays(False) and shadow.gating_pays(True)


def test_default_gate_never_falls_below_lru_where_todays_gate_did():
    """Multi-turn conversations with long think times at a capacity that holds most of them:
    the always-on gate (before issue 15) refuses conversation blocks that come back and falls
    well below LRU; the default measures that and admits everything."""
    trace = generate("multiturn", 5000, seed=3)
    c = 8000
    lru = simulate(trace, c, "lru")
    always = simulate(trace, c, "lru", admission=ReuseGate(c, bar=0.3, shadow=False))
    default = simulate(trace, c, "lru+reuse_gate")
    assert always.hit_rate < lru.hit_rate - 0.003
    assert default.hit_rate >= lru.hit_rate - 0.001


def test_default_gate_keeps_its_write_savings_where_gating_pays():
    trace = generate("multiturn", 5000, seed=3)
    c = 1000
    lru = simulate(trace, c, "lru")
    default = simulate(trace, c, "lru+reuse_gate")
    assert default.hit_rate > lru.hit_rate + 0.005
    assert default.written < 0.5 * lru.written
