"""The shared tier's store against real Valkey/Redis servers on 127.0.0.1 (tests/support/valkey_servers.py):
verified reads, corruption, eviction under maxmemory, a hung server, a dead server, a Cluster
losing a primary. The rule everywhere: a block comes back with its exact bytes or as a miss."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.config import load_config
from kvtier.tiers.remote import RemoteKeys, RemoteStore, RemoteUnavailable, derive_namespace
from kvtier.tiers.remote.blocks import RemoteBlocks
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures

BLOCK = 256 << 10


def remote_cfg(**remote):
    remote.setdefault("timeout_s", 0.2)
    remote.setdefault("connect_timeout_s", 0.2)
    remote.setdefault("probe_interval_s", 0.3)
    return load_config(data={"tiers": {"remote": remote}}, env={}).remote


def open_blocks(cfg, fingerprint="geo-a", namespace=None) -> RemoteBlocks:
    ns = namespace or derive_namespace(fingerprint)
    return RemoteBlocks(RemoteStore(cfg, RemoteKeys(ns, fingerprint)))


def payloads(n: int, seed: int = 0) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def read(blocks: RemoteBlocks, keys) -> tuple[list[bytes], list[int]]:
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    missed = blocks.get_into(keys, outs)
    return [bytes(o) for o in outs], missed


def test_round_trip_is_exact_and_absent_keys_miss(valkey):
    server = valkey()
    for compression in ("none", "zstd"):
        b = open_blocks(remote_cfg(url=server.url, compression=compression))
        keys = [f"k{i}-{compression}".encode() for i in range(4)]
        data = payloads(4)
        data[0] = bytes(BLOCK)  # compresses: stored zstd, read back exact
        assert b.put(keys, [memoryview(d) for d in data]) == [True] * 4
        got, missed = read(b, keys + [b"never-stored"])
        assert missed == [4]
        assert got[:4] == data
        assert b.store.stats().hits == 4 and b.store.stats().rejected == 0
        b.store.close()
    assert server.client().strlen(open_blocks(remote_cfg(url=server.url),
                                              ).server_keys([b"k0-zstd"])[0]) < BLOCK // 2


def test_each_value_is_consumed_on_the_store_loop_as_it_lands(valkey):
    """A promotion verifies and copies each value where it lands (no thread hop per batch):
    ``consume`` sees every position once, on the store's thread, an absent key as None."""
    import threading

    b = open_blocks(remote_cfg(url=valkey().url))
    keys = [b"a", b"b", b"c"]
    data = payloads(2)
    assert b.put(keys[:2], [memoryview(d) for d in data]) == [True, True]
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    seen = []

    def consume(i, value):
        seen.append((i, threading.current_thread() is b.store._thread))
        return b.verify_into(keys[i], value, outs[i])

    verdicts = b.store.run(b.store.get_values(b.server_keys(keys), consume))
    assert verdicts == ["hit", "hit", "absent"]
    assert sorted(seen) == [(0, True), (1, True), (2, True)]
    assert [bytes(o) for o in outs[:2]] == data and b.count(verdicts) == [2]
    assert b.store.stats().hits == 2 and b.store.stats().misses == 1
    b.store.close()


def test_foreign_geometry_under_a_shared_namespace_is_a_miss(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url, namespace="team")
    a, b = open_blocks(cfg, "geo-a", "team"), open_blocks(cfg, "geo-b", "team")
    data = payloads(1)
    assert a.put([b"same"], [memoryview(data[0])]) == [True]
    assert a.server_keys([b"same"]) == b.server_keys([b"same"])  # the operator chose to share
    got, missed = read(b, [b"same"])
    assert missed == [0] and got[0] != data[0]
    assert b.store.stats().rejected == 1
    assert read(a, [b"same"]) == ([data[0]], [])
    # the default namespaces of two geometries never even share a key
    assert open_blocks(cfg, "geo-a").server_keys([b"x"]) != open_blocks(cfg, "geo-b").server_keys([b"x"])


@pytest.mark.parametrize("damage", ["payload_bit", "header_byte", "truncate", "garbage", "empty"])
def test_value_corrupted_in_place_is_a_miss_never_wrong_bytes(valkey, damage):
    server = valkey()
    b = open_blocks(remote_cfg(url=server.url))
    data = payloads(1)
    b.put([b"victim"], [memoryview(data[0])])
    key = b.server_keys([b"victim"])[0]
    raw = server.client()
    value = raw.get(key)
    if damage == "payload_bit":
        raw.setrange(key, len(value) - 100, bytes([value[-100] ^ 0x01]))
    elif damage == "header_byte":
        raw.setrange(key, 20, bytes([value[20] ^ 0xFF]))
    elif damage == "truncate":
        raw.set(key, value[: len(value) // 2])
    elif damage == "garbage":
        raw.set(key, os.urandom(len(value)))
    else:
        raw.set(key, b"")
    got, missed = read(b, [b"victim"])
    assert missed == [0]
    assert got[0] == bytes(BLOCK)  # the output buffer was left as it was: nothing served
    assert b.store.stats().rejected == 1


def test_maxmemory_eviction_reads_as_misses_with_exact_survivors(valkey):
    server = valkey("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    b = open_blocks(remote_cfg(url=server.url))
    keys = [f"e{i}".encode() for i in range(40)]  # 10 MiB into a 3 MiB server
    data = payloads(40)
    for i in range(0, 40, 4):
        assert all(b.put(keys[i:i + 4], [memoryview(d) for d in data[i:i + 4]]))
    got, missed = read(b, keys)
    assert 0 < len(missed) < 40
    assert all(got[i] == data[i] for i in range(40) if i not in missed)
    assert not b.store.health.degraded  # eviction is a miss, not a failure


def test_full_server_refusing_writes_fails_those_writes_only(valkey):
    server = valkey("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    b = open_blocks(remote_cfg(url=server.url))
    oks = []
    for i in range(16):
        oks += b.put([f"f{i}".encode()], [memoryview(os.urandom(BLOCK))])
    assert True in oks and False in oks  # OOM refusals once full
    assert not b.store.health.degraded
    assert b.store.stats().failed_puts == oks.count(False)


def test_hung_server_costs_a_bounded_wait_then_nothing_until_a_probe_succeeds(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    b = open_blocks(cfg)
    data = payloads(2)
    keys = [b"h0", b"h1"]
    b.put(keys, [memoryview(d) for d in data])
    server.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        t0 = time.monotonic()
        _, missed = read(b, keys)
        first = time.monotonic() - t0
        assert missed == [0, 1]
        assert first < b.store.deadline_s + 0.5
        assert b.store.health.degraded
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            b.store.run(b.store.get_values(b.server_keys(keys)))
        assert time.monotonic() - t0 < 0.05  # degraded: no socket touched
    finally:
        server.resume()
    time.sleep(cfg.probe_interval_s + 0.05)
    assert read(b, keys) == (data, [])  # the due probe found it back
    assert not b.store.health.degraded and b.store.stats().degradations == 1


def test_dead_server_degrades_and_a_restart_recovers(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    b = open_blocks(cfg)
    data = payloads(1)
    b.put([b"d"], [memoryview(data[0])])
    server.kill()
    t0 = time.monotonic()
    assert b.put([b"d2"], [memoryview(data[0])]) == [False]
    assert time.monotonic() - t0 < b.store.deadline_s + 0.5
    assert b.store.health.degraded
    server.start()  # same port, empty (nothing persisted): a miss, not an error
    time.sleep(cfg.probe_interval_s + 0.05)
    assert read(b, [b"d"])[1] == [0]
    assert not b.store.health.degraded
    assert b.put([b"d"], [memoryview(data[0])]) == [True]
    assert read(b, [b"d"]) == (data, [])


def _owner(nodes, key: bytes):
    slot = nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key)
    step = 16384 // len(nodes)
    return nodes[min(slot // step, len(nodes) - 1)]


def test_cluster_round_trip_and_a_killed_primary_costs_only_its_keys(cluster):
    cfg = remote_cfg(nodes=[n.node for n in cluster])
    b = open_blocks(cfg)
    keys = [f"c{i}".encode() for i in range(24)]
    data = payloads(24)
    assert b.put(keys, [memoryview(d) for d in data]) == [True] * 24
    assert read(b, keys) == (data, [])
    owners = [_owner(cluster, k) for k in b.server_keys(keys)]
    assert len({o.port for o in owners}) == 3  # the keys really spread over the primaries
    dead = cluster[1]
    dead.kill()
    t0 = time.monotonic()
    got, missed = read(b, keys)
    assert time.monotonic() - t0 < 3 * b.store.deadline_s + 1
    lost = {i for i, o in enumerate(owners) if o is dead}
    assert set(missed) == lost
    assert all(got[i] == data[i] for i in range(24) if i not in lost)
    assert not b.store.health.degraded  # the live primaries keep serving


def _answers(directory, keys, wait_s: float = 10.0):
    """The directory's answers once none is pending (it never waits itself: poll)."""
    deadline = time.monotonic() + wait_s
    while True:
        got = directory.query(keys)
        if None not in got or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_with_tensor_parallelism_a_block_is_held_only_if_every_rank_shard_is(request, where):
    """Each rank stores its own shard: the scheduler's presence check asks for all of them, so
    a block whose rank-1 shard is missing (evicted) is not promised to the workers. On a
    Cluster the shards' keys live in different slots (the client splits the EXISTS)."""
    from kvtier.tiers.remote.directory import RemoteDirectory

    if where == "cluster":
        cfg = remote_cfg(nodes=[n.node for n in request.getfixturevalue("cluster")])
    else:
        cfg = remote_cfg(url=request.getfixturevalue("valkey")().url)
    ns = derive_namespace("geo-tp", world_size=2)
    ranks = [RemoteBlocks(RemoteStore(cfg, RemoteKeys(ns, "geo-tp", rank=r))) for r in range(2)]
    both, rank0_only = b"both", b"rank0-only"
    data = [memoryview(d) for d in payloads(1)]
    assert ranks[0].put([both], data) == [True] and ranks[1].put([both], data) == [True]
    assert ranks[0].put([rank0_only], data) == [True]
    every = RemoteDirectory(ranks[0].store, shards=2)
    rank0 = RemoteDirectory(ranks[0].store, shards=1)  # what the scheduler asked before
    try:
        assert _answers(every, [both, rank0_only, b"neither"]) == [True, False, False]
        assert _answers(rank0, [both, rank0_only]) == [True, True]
    finally:
        every.close(), rank0.close()
        for b in ranks:
            b.store.close()
    replicated = RemoteKeys(ns, "geo-tp", rank=1, replicated=True)
    assert replicated.shard_server_keys(both, 2) == [replicated.server_key(both)]


@pytest.mark.parametrize("replicated", [False, True])
def test_scheduler_directory_checks_the_shards_its_workers_write(valkey, replicated):
    """The connector's directory and its workers agree: with TP 2 the workers each write their
    rank's shard (one shared one when replicated), and the scheduler asks for exactly those."""
    from kvtier.tiers.remote.presence import open_remote_directory
    from kvtier.connectors.vllm.settings import ConnectorSettings
    from kvtier.tiers.remote.connect import connect_remote

    url = valkey().url
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "1MiB"}, "remote": {"url": url}}},
                      env={})
    settings = ConnectorSettings(config=cfg, block_size=16, hash_block_size=16, block_tokens=16,
                                 layer_names=("l0",), page_bytes=1024, sliding_window=None,
                                 world_size=2, tp_size=2, kv_dtype="uint8", identity="tp-remote",
                                 replicated_kv=replicated)
    workers = [RemoteBlocks(connect_remote(cfg.remote, settings.geometry(r), rank=r,
                                           world_size=2, replicated=replicated))
               for r in range(2)]
    payload = [memoryview(bytes(settings.geometry(0).block_bytes))]
    assert workers[0].put([b"blk"], payload) == [True]  # rank 1 has not written its shard
    directory = open_remote_directory(cfg.remote, settings.geometry(0), settings.world_size,
                                      settings.replicated)
    try:
        assert directory.shards == (1 if replicated else 2)
        assert _answers(directory, [b"blk"]) == [replicated]
    finally:
        directory.close(), directory.store.close()
        for w in workers:
            w.store.close()


def test_write_buffers_are_reused_once_acknowledged_and_values_stay_exact(valkey):
    """Uncompressed records are built in reused buffers (no fresh allocation per SET): a
    buffer goes back only after the server acknowledged its SET, and reuse never changes what
    an earlier write stored."""
    from kvtier.tiers.remote.buffers import RecordBuffers

    b = open_blocks(remote_cfg(url=valkey().url))
    first, second = payloads(3), payloads(3)
    assert b.put([b"f0", b"f1", b"f2"], [memoryview(d) for d in first]) == [True] * 3
    idle = b.buffers.idle_bytes
    assert idle >= 3 * BLOCK  # all three came back
    assert b.put([b"s0", b"s1", b"s2"], [memoryview(d) for d in second]) == [True] * 3
    assert b.buffers.idle_bytes == idle  # the same buffers, taken and given back
    got, missed = read(b, [b"f0", b"f1", b"f2", b"s0", b"s1", b"s2"])
    assert missed == [] and got == first + second
    b.store.close()
    pool = RecordBuffers(max_bytes=2 * BLOCK)
    views = [pool.take(BLOCK) for _ in range(3)]
    pool.give(views + [b"not a buffer"])
    assert pool.idle_bytes == 2 * BLOCK  # bounded; bytes objects ignored
    taken = pool.take(BLOCK)
    assert pool.idle_bytes == BLOCK and any(taken.obj is v.obj for v in views)
