"""``kvtier bench --compare``: the real manager replays a trace exactly as the policy simulator
does (same plug-ins, same conventions), and the CLI prints / emits the comparison."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from policy_sim import simulate
from trace_gen import generate

from kvtier.bench.compare import build, check_specs, compare, replay
from kvtier.bench.trace import TraceRequest
from kvtier.cli.main import cli
from kvtier.manager.admission import make_admission
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager

FIELDS = ("blocks", "tokens", "hit_blocks", "hit_tokens", "written", "wasted", "evicted")


def req(*ids: int) -> TraceRequest:
    return TraceRequest(0.0, 512 * len(ids), 1, tuple(ids))


@pytest.mark.parametrize("shape", ["chat", "mixed"])
def test_manager_replay_equals_policy_sim(shape):
    trace = generate(shape, 400, seed=7)
    for c in (150, 800):
        for spec in ("lru", "arc", "lru+threshold", "lru+reuse_gate", "arc+reuse_gate"):
            real, sim = replay(trace, c, spec), simulate(trace, c, spec)
            assert real.hit_blocks > 0 and real.written > 0
            assert {f: getattr(real, f) for f in FIELDS} == {f: getattr(sim, f) for f in FIELDS}, \
                (shape, c, spec)


def test_replay_counts_prefix_hits_and_wasted_writes():
    trace = [req(1, 2, 3), req(1, 2, 4), req(9, 2, 3), req(5), req(6), req(1)]
    r = replay(trace, 5, "lru")
    assert r.hit_blocks == 2  # [1, 2] once; 2 and 3 of the third request sit behind a miss
    # LRU order after each request (oldest first): 1 2 3 | 3 2 1 4 (hits touched last-to-first)
    # | 1 4 2 3 9 (2 and 3 touched behind the gap) | 4 2 3 9 5 (1 goes, it had a hit)
    # | 2 3 9 5 6 (4 goes unread: wasted) | 3 9 5 6 1 (1 is written again, 2 goes)
    assert r.written == 3 + 1 + 1 + 1 + 1 + 1
    assert r.evicted == 3 and r.wasted == 1


def test_hits_are_touched_last_to_first():
    m = TieredOffloadingManager(cpu_blocks=4)
    for keys in ([1, 2, 3], [4]):
        m.complete_store(m.prepare_store(keys).keys)
    load = m.prepare_load([1, 2, 3])
    m.complete_load(load.keys)
    plan = m.prepare_store([5, 6])
    # LRU order after the load: 4, 3, 2, 1 (the prefix's first block is the youngest)
    assert plan.evicted[Medium.CPU] == (4, 3)


def test_resident_block_behind_a_gap_is_kept_young():
    m = TieredOffloadingManager(cpu_blocks=3)
    for keys in ([2], [7], [8]):
        m.complete_store(m.prepare_store(keys).keys)
    plan = m.prepare_store([1, 2])  # 1 is new, 2 resident behind it: 2 is touched
    assert plan.evicted[Medium.CPU] == (7,)


def test_store_stops_at_the_first_refused_block():
    adm = make_admission("threshold", threshold=2, capacity_blocks=16)
    m = TieredOffloadingManager(cpu_blocks=8, cpu_admission=adm)
    m.lookup([1, 2, 3])
    m.lookup([1, 3])  # 1 and 3 seen twice, 2 once
    plan = m.prepare_store([1, 2, 3])
    assert plan.keys == (1,)  # 3 is admissible but unreachable behind the refused 2
    assert m.stats.admission_rejected["CPU"] == 1


def test_compare_runs_lru_first_and_belady_bounds():
    trace = generate("zipf", 300, seed=2)
    results = compare(trace, [100], ["arc", "lru+reuse_gate"])
    names = [r.policy for r in results]
    assert names == ["lru", "arc", "lru+reuse_gate", "belady", "belady-skip"]
    best = results[3]
    assert all(r.hit_blocks <= best.hit_blocks for r in results)


def test_check_specs_names_what_is_allowed():
    assert check_specs(["lru", " arc+reuse_gate ", ""]) == ["lru", "arc+reuse_gate"]
    with pytest.raises(ValueError, match="allowed: .*arc.*lru"):
        check_specs(["lfu"])
    with pytest.raises(ValueError, match="allowed: .*reuse_gate"):
        check_specs(["lru+nope"])
    with pytest.raises(ValueError):
        build(0, "lru")


def run(*args):
    return CliRunner().invoke(cli, ["bench", *args])


def test_cli_compare_json_and_table(generated_trace):
    args = ["--compare", "--trace", generated_trace("zipf", 200), "--capacity-blocks", "60,300"]
    out = run(*args, "--json", "--policies", "arc")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    rows = {(r["capacity"], r["policy"]): r for r in doc["rows"]}
    assert set(rows) == {(c, p) for c in (60, 300) for p in ("lru", "arc", "belady", "belady-skip")}
    lru, bel = rows[(60, "lru")], rows[(60, "belady")]
    assert lru["gap_closed"] == 0 and bel["gap_closed"] == pytest.approx(1.0)
    assert lru["writes_vs_lru"] == 1 and bel["hit_rate"] > lru["hit_rate"]
    assert doc["infinite"]["hit_blocks"] >= bel["hit_blocks"] and doc["requests"] == 200
    table = run(*args, "--policies", "lru+reuse_gate")
    assert table.exit_code == 0
    assert "| 300 | lru+reuse_gate |" in table.output and "| inf | infinite |" in table.output


def test_cli_hints_come_from_the_trace_files_continues_flags(generated_trace):
    path = generated_trace("multiturn", 800, seed=5)
    out = run("--compare", "--trace", path, "--capacity-blocks", "1500", "--policies",
              "lru+hints", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["policy"]: r for r in json.loads(out.stdout)["rows"]}
    in_memory = replay(generate("multiturn", 800, seed=5), 1500, "lru+hints")
    assert rows["lru+hints"]["hit_blocks"] == in_memory.hit_blocks
    assert rows["lru+hints"]["hit_blocks"] > rows["lru"]["hit_blocks"]  # the flags were read


def test_cli_compare_rejects_bad_input(generated_trace):
    bad = run("--compare", "--trace", generated_trace("zipf", 20), "--policies", "lfu")
    assert bad.exit_code == 2 and "allowed" in bad.output
    assert run("--compare", "--capacity-blocks", "0").exit_code == 2
    assert run("--compare", "--gpu-blocks", "64").exit_code == 2
    assert run("--shape", "zipf").exit_code == 2  # generated traces are files now


def test_threshold_wrapper_stops_at_the_first_refused_block():
    from kvtier.manager.admission.wrappers import StoreThresholdAdmission

    inner = TieredOffloadingManager(cpu_blocks=8)
    inner.complete_store(inner.prepare_store([5]).keys)
    m = StoreThresholdAdmission(inner, threshold=2, max_tracked=100)
    m.lookup([1, 2, 3, 5, 6])
    m.lookup([1, 3, 6])  # 1, 3 and 6 seen twice; 2 and 5 once
    assert m.prepare_store([1, 2, 3]).keys == (1,)  # 3 sits behind the refused 2
    assert m.prepare_store([5, 6]).keys == (6,)  # 5 is refused but resident: 6 is reachable
    assert m.rejected == 2 + 1
