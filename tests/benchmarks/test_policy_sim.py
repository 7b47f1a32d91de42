"""Offline policy simulator, Belady bounds and synthetic traces: the tools that judge policies
must themselves be right (prefix semantics, bounds that really bound, reproducible traces)."""

from __future__ import annotations

import pytest

from policy_sim import compare, format_summary, format_table, infinite, parse_spec, simulate
from trace_gen import SHAPES, generate, write_trace

from kvtier.bench.belady import belady
from kvtier.bench.trace import TraceRequest, load_trace
from kvtier.manager.policies import make_policy


def req(*ids: int, tokens: int | None = None) -> TraceRequest:
    return TraceRequest(0.0, tokens or 512 * len(ids), 1, tuple(ids))


def test_prefix_semantics_hits_only_the_leading_run():
    trace = [req(1, 2, 3), req(1, 2, 4), req(9, 2, 3)]
    r = simulate(trace, 100, "lru")
    assert r.hit_blocks == 2  # [1, 2] of the second request; 2 and 3 of the third are behind a miss
    assert r.written == 3 + 1 + 1  # 4, then 9 (2 and 3 stay resident)
    assert r.blocks == 9


def test_token_hit_rate_counts_a_partial_last_block():
    trace = [req(1, 2, tokens=700), req(1, 2, tokens=700)]
    r = simulate(trace, 10, "lru")
    assert r.hit_blocks == 2 and r.hit_tokens == 700 and r.tokens == 1400


def test_eviction_goes_through_the_policy_and_counts_wasted_writes():
    trace = [req(1), req(2), req(3), req(1)]
    r = simulate(trace, 2, "lru")
    assert r.evicted == 2 and r.wasted == 2  # 1 and 2 were never read before they left
    assert r.hit_blocks == 0


def test_simulator_rejects_a_policy_offering_pinned_keys():
    class Broken(type(make_policy("lru", 1))):
        def victims(self, n, evictable):
            return list(self.keys())[:n]

    trace = [req(1), req(1, 2)]  # block 1 is pinned while 2 is stored
    with pytest.raises(RuntimeError, match="non-evictable"):
        simulate(trace, 1, "x", policy=Broken(1))


def test_parse_spec_and_bad_capacity():
    assert parse_spec("arc") == ("arc", "all")
    assert parse_spec("lru+reuse_gate") == ("lru", "reuse_gate")
    with pytest.raises(ValueError):
        simulate([req(1)], 0, "lru")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        simulate([req(1)], 4, "nope")


@pytest.mark.parametrize("shape", ["zipf", "chat"])
def test_belady_bounds_every_policy(shape):
    trace = generate(shape, 400, seed=5)
    ceiling = infinite(trace)
    for c in (50, 300):
        best = belady(trace, c)
        skip = belady(trace, c, skip_unused=True)
        assert skip.hit_blocks == best.hit_blocks and skip.written <= best.written
        assert best.hit_blocks <= ceiling.hit_blocks
        for spec in ("lru", "arc", "lru+threshold", "lru+reuse_gate"):
            assert simulate(trace, c, spec).hit_blocks <= best.hit_blocks, spec


def test_reuse_gate_saves_writes_without_losing_hits_on_one_off_documents():
    trace = generate("docs", 600, seed=2)
    lru = simulate(trace, 2000, "lru")
    gated = simulate(trace, 2000, "lru+reuse_gate")
    assert gated.hit_blocks >= lru.hit_blocks
    assert gated.written < lru.written / 2


def test_compare_and_tables():
    trace = generate("zipf", 200, seed=1)
    results = compare(trace, [100, 400], ["arc"])
    names = [r.policy for r in results]
    assert names.count("lru") == 2 and names.count("belady-skip") == 2
    table = format_table(results, infinite(trace))
    assert "| 400 | arc |" in table and "infinite" in table
    summary = format_summary(results)
    assert summary.count("\n") == 2 and "arc" in summary


@pytest.mark.parametrize("shape", SHAPES)
def test_generated_traces_are_deterministic_prefix_traces(shape, tmp_path):
    a = generate(shape, 300, seed=3)
    assert a == generate(shape, 300, seed=3)
    assert a != generate(shape, 300, seed=4)
    parent: dict[int, int | None] = {}
    for r in a:
        assert 0 < r.input_length <= 512 * len(r.hash_ids)
        for i, h in enumerate(r.hash_ids):
            p = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(h, p) == p  # an id always has the same prefix
    path = tmp_path / f"{shape}.jsonl"
    write_trace(a, path)
    back = load_trace(path)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in a]
    assert [r.continues for r in back] == [r.continues for r in a]  # what +hints reads
    assert infinite(back).hit_blocks == infinite(a).hit_blocks


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown trace shape"):
        generate("nope", 10)
    with pytest.raises(ValueError):
        generate("zipf", 0)
