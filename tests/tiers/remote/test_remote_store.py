"""The shared tier's data path (``RemoteBlockIO``, what each I/O process runs) against real
Valkey/Redis servers on 127.0.0.1 (see tests/support/valkey_servers.py): verified reads,
corruption, eviction under maxmemory, a hung server, a dead server, a Cluster losing a primary,
tensor-parallel shards. The rule everywhere: a block comes back with its exact bytes or as a
miss, and a miss that a connection caused is told apart (``transient``) from one the server's
contents caused."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.config import load_config
from kvtier.tiers.record import HEADER_BYTES
from kvtier.tiers.remote import RemoteKeys, RemoteStore, derive_namespace
from kvtier.tiers.remote.wire.connect import remote_keys
from support.remote_blocks import BLOCK, open_io, read, remote_cfg, write
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures


def payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def test_round_trip_is_exact_and_absent_keys_miss(valkey):
    server = valkey()
    io = open_io(remote_cfg(url=server.url))
    keys = [f"k{i}".encode() for i in range(4)]
    data = payloads(4)
    assert write(io, keys, data).ok == [True] * 4
    got, r = read(io, keys + [b"never-stored"])
    assert got[:4] == data
    assert r.failed == [4] and r.transient == []  # absent: a miss, not a connection loss
    assert (io.stats.hits, io.stats.misses, io.stats.rejected) == (4, 1, 0)
    assert io.stats.puts == 4 and io.stats.errors == 0
    io.close()


def test_foreign_geometry_under_a_shared_namespace_is_a_miss(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url, namespace="team")
    a, b = open_io(cfg, "geo-a", "team"), open_io(cfg, "geo-b", "team")
    data = payloads(1)
    assert write(a, [b"same"], data).ok == [True]
    assert a.keys.server_key(b"same") == b.keys.server_key(b"same")  # the operator chose to share
    _, r = read(b, [b"same"])
    assert r.failed == [0] and r.transient == []
    assert b.stats.rejected == 1 and b.stats.hits == 0
    assert read(a, [b"same"])[0] == data
    # the default namespaces of two geometries never even share a key
    assert (RemoteKeys(derive_namespace("geo-a"), "geo-a").server_key(b"x")
            != RemoteKeys(derive_namespace("geo-b"), "geo-b").server_key(b"x"))


def test_a_record_of_another_block_size_is_a_miss(valkey):
    """Same key, same fingerprint, other slot size (a misconfigured peer): never loaded."""
    cfg = remote_cfg(url=valkey().url)
    small = open_io(cfg, block_bytes=BLOCK // 2)
    assert write(small, [b"k"], [os.urandom(BLOCK // 2)]).ok == [True]
    io = open_io(cfg)
    _, r = read(io, [b"k"])
    assert r.failed == [0] and r.transient == []
    assert io.stats.rejected == 1 and io.stats.hits == 0


DAMAGES = ["payload_bit", "header_byte", "key_byte", "truncate", "extend", "garbage", "empty"]


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_value_corrupted_in_place_is_a_miss_never_loaded(valkey, damage, compression):
    """A value of the exact record size lands in the slot before it is verified (the slot is
    the load's own until it completes): what matters is that it is not reported loaded."""
    server = valkey()
    io = open_io(remote_cfg(url=server.url, compression=compression))
    data = [bytes(BLOCK // 2) + os.urandom(BLOCK // 2)]  # half zeros: zstd stores it smaller
    assert write(io, [b"victim"], data).ok == [True]
    key = io.keys.server_key(b"victim")
    raw = server.client()
    value = raw.get(key)
    assert (len(value) < BLOCK) == (compression == "zstd")
    if damage == "payload_bit":
        raw.setrange(key, len(value) - 100, bytes([value[-100] ^ 0x01]))
    elif damage == "header_byte":
        raw.setrange(key, 20, bytes([value[20] ^ 0xFF]))
    elif damage == "key_byte":  # the stored identity, just after the header
        raw.setrange(key, HEADER_BYTES + 3, bytes([value[HEADER_BYTES + 3] ^ 0x01]))
    elif damage == "truncate":
        raw.set(key, value[: len(value) // 2])
    elif damage == "extend":
        raw.append(key, b"\0" * 16)
    elif damage == "garbage":
        raw.set(key, os.urandom(len(value)))
    else:
        raw.set(key, b"")
    _, r = read(io, [b"victim"])
    assert r.failed == [0] and r.transient == []
    assert io.stats.rejected == 1 and io.stats.hits == 0
    raw.delete(key)
    assert write(io, [b"victim"], data).ok == [True]  # the connection is still good
    got, r = read(io, [b"victim"])
    assert got == data and r.failed == [] and io.stats.hits == 1


def test_maxmemory_eviction_reads_as_misses_with_exact_survivors(valkey):
    server = valkey("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    io = open_io(remote_cfg(url=server.url))
    keys = [f"e{i}".encode() for i in range(40)]  # 10 MiB into a 3 MiB server
    data = payloads(40)
    for i in range(0, 40, 4):
        assert write(io, keys[i:i + 4], data[i:i + 4]).ok == [True] * 4
    got, r = read(io, keys)
    assert 0 < len(r.failed) < 40
    assert r.transient == []  # eviction is a miss, not a failure
    assert all(got[i] == data[i] for i in range(40) if i not in r.failed)
    assert io.stats.misses == len(r.failed) and io.stats.rejected == 0


def test_full_server_refusing_writes_fails_those_writes_only(valkey):
    server = valkey("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    io = open_io(remote_cfg(url=server.url))
    keys = [f"f{i}".encode() for i in range(16)]
    data = payloads(16)
    oks = []
    for i in range(0, 16, 2):  # two SETs per pipeline: a refusal must not cost its neighbour
        r = write(io, keys[i:i + 2], data[i:i + 2])
        assert r.lost == []  # an OOM refusal is not a lost connection
        oks += r.ok
    assert True in oks and False in oks
    assert io.stats.failed_puts == oks.count(False) and io.stats.puts == oks.count(True)
    stored = [i for i, good in enumerate(oks) if good]
    got, r = read(io, [keys[i] for i in stored])
    assert r.failed == [] and got == [data[i] for i in stored]


def test_hung_server_costs_a_bounded_wait_per_call_then_recovers(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    io = open_io(cfg)
    keys = [b"h0", b"h1"]
    data = payloads(2)
    assert write(io, keys, data).ok == [True, True]
    bound = cfg.connect_timeout_s + cfg.timeout_s + 0.3
    server.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        for _ in range(2):  # the second call reconnects to the hung server: bounded too
            t0 = time.monotonic()
            _, r = read(io, keys)
            assert time.monotonic() - t0 < bound
            assert r.failed == [0, 1] and r.transient == [0, 1]
        t0 = time.monotonic()
        p = write(io, [b"h2"], payloads(1))
        assert time.monotonic() - t0 < bound
        assert p.ok == [False] and p.lost == [0]
        assert io.stats.errors >= 3 and io.stats.hits == 0
    finally:
        server.resume()
    assert read(io, keys)[0] == data  # a fresh connection, no stale reply read as a value
    assert io.stats.hits == 2


def test_dead_server_fails_fast_and_a_restart_recovers(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    io = open_io(cfg)
    data = payloads(1)
    assert write(io, [b"d"], data).ok == [True]
    server.kill()
    t0 = time.monotonic()
    p = write(io, [b"d2"], data)
    assert p.ok == [False] and p.lost == [0]
    _, r = read(io, [b"d"])
    assert r.failed == [0] and r.transient == [0]
    assert time.monotonic() - t0 < 2 * (cfg.connect_timeout_s + cfg.timeout_s) + 0.5
    server.start()  # same port, empty (nothing persisted): a miss, not an error
    _, r = read(io, [b"d"])
    assert r.failed == [0] and r.transient == []
    assert write(io, [b"d"], data).ok == [True]
    assert read(io, [b"d"])[0] == data


def _owner(nodes, key: bytes):
    slot = nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key)
    step = 16384 // len(nodes)
    return nodes[min(slot // step, len(nodes) - 1)]


def test_cluster_round_trip_and_a_killed_primary_costs_only_its_keys(cluster):
    cfg = remote_cfg(nodes=[n.node for n in cluster])
    io = open_io(cfg)
    keys = [f"c{i}".encode() for i in range(24)]
    data = payloads(24)
    assert write(io, keys, data).ok == [True] * 24
    got, r = read(io, keys)
    assert got == data and r.failed == []
    owners = [_owner(cluster, io.keys.server_key(k)) for k in keys]
    assert len({o.port for o in owners}) == 3  # the keys really spread over the primaries
    dead = cluster[1]
    dead.kill()
    lost = [i for i, o in enumerate(owners) if o is dead]
    t0 = time.monotonic()
    got, r = read(io, keys)
    assert time.monotonic() - t0 < cfg.connect_timeout_s + cfg.timeout_s + 0.5
    assert r.failed == lost and r.transient == lost
    assert all(got[i] == data[i] for i in range(24) if i not in lost)
    fresh = payloads(24)
    p = write(io, keys, fresh)  # writes too: only the dead primary's keys fail
    assert p.lost == lost
    assert p.ok == [i not in lost for i in range(24)]
    got, r = read(io, keys)
    assert r.failed == lost and all(got[i] == fresh[i] for i in range(24) if i not in lost)


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
    ranks = [open_io(cfg, keys=RemoteKeys(ns, "geo-tp", rank=r)) for r in range(2)]
    both, rank0_only = b"both", b"rank0-only"
    data = payloads(1)
    assert write(ranks[0], [both], data).ok == [True]
    assert write(ranks[1], [both], data).ok == [True]
    assert write(ranks[0], [rank0_only], data).ok == [True]
    store = RemoteStore(cfg, ranks[0].keys)
    every = RemoteDirectory(store, shards=2)
    rank0 = RemoteDirectory(store, shards=1)  # what the scheduler asked before
    try:
        assert _answers(every, [both, rank0_only, b"neither"]) == [True, False, False]
        assert _answers(rank0, [both, rank0_only]) == [True, True]
    finally:
        every.close(), rank0.close(), store.close()
        for io in ranks:
            io.close()
    replicated = RemoteKeys(ns, "geo-tp", rank=1, replicated=True)
    assert replicated.shard_server_keys(both, 2) == [replicated.server_key(both)]


@pytest.mark.parametrize("replicated", [False, True])
def test_scheduler_directory_checks_the_shards_its_workers_write(valkey, replicated):
    """The connector's directory and its workers agree: with TP 2 the workers each write their
    rank's shard (one shared one when replicated), and the scheduler asks for exactly those."""
    from kvtier.tiers.remote.presence import open_remote_directory
    from kvtier.connectors.vllm.settings import ConnectorSettings

    url = valkey().url
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "1MiB"}, "remote": {"url": url}}},
                      env={})
    settings = ConnectorSettings(config=cfg, block_size=16, hash_block_size=16, block_tokens=16,
                                 layer_names=("l0",), page_bytes=1024, sliding_window=None,
                                 world_size=2, tp_size=2, kv_dtype="uint8", identity="tp-remote",
                                 replicated_kv=replicated)
    block_bytes = settings.geometry(0).block_bytes
    worker0 = open_io(cfg.remote, block_bytes=block_bytes, slots=1,
                      keys=remote_keys(cfg.remote, settings.geometry(0), rank=0, world_size=2,
                                       replicated=replicated))
    assert write(worker0, [b"blk"], [bytes(block_bytes)]).ok == [True]  # rank 1 has not
    directory = open_remote_directory(cfg.remote, settings.geometry(0), settings.world_size,
                                      settings.replicated)
    try:
        assert directory.shards == (1 if replicated else 2)
        assert _answers(directory, [b"blk"]) == [replicated]
    finally:
        directory.close(), directory.store.close()
        worker0.close()
