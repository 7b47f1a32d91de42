"""The shared tier in the data path: two kvtier instances (``kvtier bench``'s replay: the real
manager, transfer engine and tiers) sharing one real server. The second serves the first's
blocks as REMOTE hits with exact bytes; a hung, corrupted or partly dead tier costs hits only,
never correctness, and never blocks a lookup."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.bench.replay import Replay
from kvtier.bench.trace import load_trace
from kvtier.config import load_config
from kvtier.observe.events.convert import wire_medium
from kvtier.manager.specs import Medium
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures

BLOCK = 64 << 10
GPU_BLOCKS = 48


def config(tmp_path, remote: dict, disk: bool = False, timeout_s: float = 0.2):
    """``timeout_s``: short where a test stops the server (a hang is found quickly); tests
    that count on every read and write succeeding pass a longer one (a loaded CI machine can
    stall a healthy server's answer past 0.2 s)."""
    tiers = {"cpu": {"capacity": "2MiB"},
             "remote": {"timeout_s": timeout_s, "connect_timeout_s": timeout_s,
                        "probe_interval_s": 0.3, **remote}}
    if disk:
        tiers["disk"] = {"path": str(tmp_path / "disk"), "capacity": "8MiB", "fsync": False}
    return load_config(data={"tiers": tiers}, env={})


def replay(cfg, trace, during=None):
    r = Replay(cfg, BLOCK, GPU_BLOCKS)
    try:
        if during is not None:
            half = len(trace) // 2
            r.run(trace[:half])
            during(r)
            r.run(trace[half:])
        else:
            r.run(trace)
        rep = r.report()
        rep["pins"] = r.manager.pins()
        rep["remote_events"] = sorted({type(e).__name__ for e in r.manager.take_events()
                                       if e.medium is Medium.REMOTE})
        return rep
    finally:
        r.close()


@pytest.fixture(scope="module")
def trace():
    return load_trace(limit=60)


def test_second_instance_serves_the_first_ones_blocks_as_remote_hits(tmp_path, valkey, trace):
    server = valkey()
    cfg = config(tmp_path, {"url": server.url}, timeout_s=2.0)
    first = replay(cfg, trace)
    assert first["manager"]["stored_blocks"]["REMOTE"] > 0
    second = replay(cfg, trace)
    assert second["wrong_blocks"] == 0 and second["failed_loads"] == 0
    # every block the first instance had to compute, the second loads from the shared tier
    assert second["blocks"]["REMOTE"] >= first["blocks"]["MISS"] - 1
    assert second["blocks"]["MISS"] < first["blocks"]["MISS"] // 10
    assert second["manager"]["stored_blocks"]["REMOTE"] <= 1  # held already: not rewritten
    assert second["remote"]["hits"] == second["blocks"]["REMOTE"]
    assert second["transfers"]["REMOTE->CPU"]["failed_jobs"] == 0
    assert second["pins"] == 0 and first["pins"] == 0
    # events carry the medium: stored by the first, hit (accessed) by the second
    assert "BlockStored" in first["remote_events"]
    assert "BlockAccessed" in second["remote_events"]
    assert wire_medium(Medium.REMOTE) == "REMOTE"


def test_values_corrupted_on_the_server_are_recomputed_never_served(tmp_path, valkey, trace):
    server = valkey()
    cfg = config(tmp_path, {"url": server.url}, timeout_s=2.0)
    replay(cfg, trace)
    raw = server.client()
    damaged = 0
    for key in raw.scan_iter(b"kvtier:*"):
        value = raw.get(key)
        raw.setrange(key, len(value) - 7, bytes([value[-7] ^ 0x40]))
        damaged += 1
    assert damaged > 0
    second = replay(cfg, trace)
    assert second["wrong_blocks"] == 0
    assert second["remote"]["rejected"] > 0
    assert second["failed_loads"] == second["remote"]["rejected"]
    assert second["pins"] == 0
    # a rejected block was recomputed, stored and written back: the tier healed itself
    assert second["manager"]["stored_blocks"]["REMOTE"] >= second["remote"]["rejected"]
    third = replay(cfg, trace)
    assert third["wrong_blocks"] == 0
    assert third["remote"]["rejected"] < second["remote"]["rejected"] // 4
    assert third["blocks"]["REMOTE"] > second["blocks"]["REMOTE"]


def test_hung_server_mid_run_local_tiers_keep_serving(tmp_path, valkey, trace):
    server = valkey()
    cfg = config(tmp_path, {"url": server.url}, disk=True)
    replay(cfg, trace)
    t0 = time.monotonic()
    try:
        second = replay(cfg, trace, during=lambda r: server.pause())
    finally:
        server.resume()
    assert time.monotonic() - t0 < 60
    assert second["wrong_blocks"] == 0
    assert second["remote"]["degraded"] or second["remote"]["degradations"] >= 1
    assert second["manager"]["remote_degraded"] or second["manager"]["remote_degradations"] >= 1
    # the first half came from the shared tier; after the hang, local tiers and recompute
    assert second["blocks"]["REMOTE"] > 0
    assert second["blocks"]["GPU"] + second["blocks"]["CPU"] + second["blocks"]["DISK"] > 0
    assert second["pins"] == 0


def test_a_lookup_never_waits_on_the_network(tmp_path, valkey, trace):
    """With the server SIGSTOPped, every manager.lookup returns at once ("pending", then a
    miss once the bounded wait ran out): the scheduler step is never blocked by the tier."""
    server = valkey()
    cfg = config(tmp_path, {"url": server.url})
    r = Replay(cfg, BLOCK, GPU_BLOCKS)
    try:
        keys = [i.to_bytes(8, "little") for i in range(1, 9)]
        server.pause()
        slowest, pending_seen = 0.0, 0
        deadline = time.monotonic() + 10
        while True:
            t0 = time.perf_counter()
            found = r.manager.lookup(keys)
            slowest = max(slowest, time.perf_counter() - t0)
            if not found.pending:
                break
            pending_seen += 1
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert found.num_hits == 0 and pending_seen > 0
        # generous for a loaded 2-core CI box; a blocking call would take the 0.2 s timeout
        assert slowest < 0.05, slowest
        assert r.remote.store.health.degraded  # the presence directory's connection
        t0 = time.perf_counter()
        assert not r.manager.lookup([b"other-k1"]).pending  # degraded: answered locally
        assert time.perf_counter() - t0 < 0.05
    finally:
        server.resume()
        r.close()


def test_cluster_losing_a_primary_mid_run_costs_only_hits(tmp_path, cluster, trace):
    cfg = config(tmp_path, {"nodes": [n.node for n in cluster]})
    first = replay(cfg, trace)
    assert first["manager"]["stored_blocks"]["REMOTE"] > 0
    second = replay(cfg, trace, during=lambda r: cluster[2].kill())
    assert second["wrong_blocks"] == 0
    assert second["blocks"]["REMOTE"] > 0
    assert second["pins"] == 0


def test_replicated_ranks_store_each_block_once_and_all_read_it(tmp_path, valkey):
    """MLA caches are the same bytes on every TP rank: rank 0 writes one value per block,
    rank 1 writes nothing and reads rank 0's value (exact bytes)."""
    import torch

    from kvtier.bench.replay import bench_geometry
    from kvtier.manager.specs import LoadStoreSpec
    from kvtier.runtime.worker import WorkerRuntime
    from kvtier.tiers.gpu_view import GpuKvView
    from kvtier.tiers.layout import BlockGeometry

    server = valkey()
    cfg = config(tmp_path, {"url": server.url})
    base = bench_geometry(BLOCK)

    def rank_geometry(rank: int) -> BlockGeometry:  # as the connector names them per rank
        return BlockGeometry(base.num_layers, base.kv_parts, base.engine_blocks_per_block,
                             base.page_bytes, base.dtype, f"mla;tp={rank}/2")

    runtimes = []
    for rank in (0, 1):
        gpu = {f"layer.{i}": torch.zeros((2, 4, base.page_bytes), dtype=torch.uint8)
               for i in range(base.num_layers)}
        runtimes.append(WorkerRuntime.create(cfg, GpuKvView(gpu, layout="kv_first"),
                                             rank_geometry(rank), rank=rank, world_size=2,
                                             rank0_geometry=rank_geometry(0), replicated=True))
    try:
        keys = [b"mla-0", b"mla-1"]
        data = torch.randint(0, 255, (2, base.block_bytes), dtype=torch.uint8)
        for rt in runtimes:
            for slot in (0, 1):
                rt.pool.slot(slot).copy_(data[slot])
            [res] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu([0, 1]),
                                                     LoadStoreSpec.remote(keys))])
            assert res.ok
        assert len(server.client().keys(b"kvtier:*")) == 2
        # written once, not once per rank
        assert runtimes[0].remote.stats().puts == 2 and runtimes[1].remote.stats().puts == 0
        one = runtimes[1]
        one.pool.slot(2).zero_(), one.pool.slot(3).zero_()
        [res] = one.engine.wait([one.engine.submit(LoadStoreSpec.remote(keys),
                                                   LoadStoreSpec.cpu([2, 3]))])
        assert res.ok and res.failed_keys == ()
        assert torch.equal(one.pool.slot(2), data[0]) and torch.equal(one.pool.slot(3), data[1])
    finally:
        for rt in runtimes:
            rt.close()


def test_server_evicting_under_maxmemory_costs_hits_only(tmp_path, valkey, trace):
    """A server smaller than the blocks written: allkeys-lru evicts as the instances write. The
    next instance hits what survived (exact bytes); a key evicted between the presence answer
    and the read is a failed load, recomputed; nothing is an error."""
    server = valkey("--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru")
    cfg = config(tmp_path, {"url": server.url}, timeout_s=2.0)
    first = replay(cfg, trace)
    written = first["manager"]["stored_blocks"]["REMOTE"]
    assert written * BLOCK > 14 << 20  # more than the server keeps
    second = replay(cfg, trace)
    assert second["wrong_blocks"] == 0 and second["pins"] == 0
    assert 0 < second["blocks"]["REMOTE"] < written
    assert second["blocks"]["MISS"] > 0
    r = second["remote"]
    # every failed load comes from a key the server evicted after answering "present": the
    # blocks of a prefix after such a key are recomputed too (they cannot be used without it)
    assert r["rejected"] == 0 and (second["failed_loads"] > 0) == (r["misses"] > 0)
    assert second["failed_loads"] >= r["misses"]
    assert not r["degraded"] and r["errors"] == 0


def test_stores_beyond_max_writes_in_flight_wait_their_turn_and_are_all_shared(tmp_path, valkey,
                                                                                trace):
    """A prompt longer than ``max_writes_in_flight`` blocks used to be shared only up to that
    many blocks (the rest were skipped); now they wait in a backlog and are all written."""
    server = valkey()
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "64MiB"},
                                      "remote": {"url": server.url, "max_writes_in_flight": 4,
                                                 "timeout_s": 5.0}}}, env={})
    first = replay(cfg, trace)
    m = first["manager"]
    counters = {k: m[k] for k in ("stored_blocks", "failed_stores", "remote_writes_skipped",
                                  "remote_writes_already_held", "admission_rejected")}
    # every block the CPU tier stored had its write: none skipped, none found held. A write
    # the server did not answer in time (a stalled test machine) is a failed store, counted
    written, failed = m["stored_blocks"]["REMOTE"], m["failed_stores"]["REMOTE"]
    assert m["remote_writes_skipped"] == 0 and m["remote_writes_already_held"] == 0, counters
    assert written + failed == m["stored_blocks"]["CPU"] > 8, counters
    assert written > 8 * failed, counters  # without the backlog: 4 blocks a prompt at most
    assert written <= server.client().dbsize() <= written + failed
    second = replay(cfg, trace)
    assert second["wrong_blocks"] == 0
    assert second["blocks"]["MISS"] < first["blocks"]["MISS"] // 10


def test_writes_falling_behind_the_cpu_tier_are_counted_and_logged(tmp_path, valkey, trace,
                                                                     caplog):
    """One write at a time and a CPU tier that turns over faster: blocks leave the CPU tier
    before their write. They are counted and the operator gets a line saying so (a counter
    alone did not say why sharing stopped paying)."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvtier.manager.remote.lag")
    cfg = config(tmp_path, {"url": valkey().url, "max_writes_in_flight": 1})
    first = replay(cfg, trace)
    skipped = first["manager"]["remote_writes_skipped"]
    assert skipped > 0 and first["wrong_blocks"] == 0
    lines = [r.getMessage() for r in caplog.records if "writes are behind" in r.getMessage()]
    assert len(lines) == 1  # once per minute at most
    assert lines[0].startswith("kvtier: the shared tier's writes are behind: ")
