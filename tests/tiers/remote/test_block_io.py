"""What ``RemoteBlockIO`` itself decides, against real Valkey servers: the cap on what one
value may cost, compressed records, MAC tags, and a Cluster slot that moved after the slot map
was read (``MOVED``)."""

from __future__ import annotations

import os
import resource

from kvtier.tiers.remote.block_io import OTHER_VALUE_SLACK
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.wire.slots import SLOTS, key_slot
from support.remote_blocks import BLOCK, open_io, read, remote_cfg, write
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures


def payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS to its current RSS (Linux: clear_refs 5) and return it
    (KiB): without it an earlier, larger peak would hide what the call under test costs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_a_value_over_the_cap_is_a_miss_and_is_never_read_into_memory(valkey):
    """Anyone who can SET on the server can put 64 MiB under a block's key: the read gives up
    the connection instead of allocating for it, the block is rejected, the next call works."""
    server = valkey("--proto-max-bulk-len", "512mb")
    io = open_io(remote_cfg(url=server.url, timeout_s=5))  # a loaded machine: not a timeout
    keys = [b"huge", b"fine"]
    data = payloads(2)
    assert write(io, keys, data).ok == [True, True]
    huge = 64 << 20
    assert huge > BLOCK + OTHER_VALUE_SLACK
    # built on the server (zero-filled up to the offset): this process never holds it
    server.client().setrange(io.keys.server_key(b"huge"), huge - 1, b"x")
    before = _peak_rss_reset()
    _, r = read(io, keys)
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew_kib * 1024 < huge // 2, f"reading the oversized value grew the process {grew_kib} KiB"
    assert 0 in r.failed and 0 not in r.transient, io.stats.last_error  # rejected, not lost
    assert io.stats.rejected == 1 and io.stats.hits <= 1
    # the rest of that pipeline went with the connection: transient misses, never wrong bytes
    assert set(r.failed) - {0} == set(r.transient)
    got, r = read(io, [b"fine"])
    assert got == [data[1]] and r.failed == []


def test_compressed_records_round_trip_and_any_reader_decodes_them(valkey):
    server = valkey()
    keys = [b"zeros", b"text", b"random"]
    data = [bytes(BLOCK), (b"kvtier " * BLOCK)[:BLOCK], os.urandom(BLOCK)]
    writer = open_io(remote_cfg(url=server.url, compression="zstd"))
    assert write(writer, keys, data).ok == [True] * 3
    raw = server.client()
    sizes = [raw.strlen(writer.keys.server_key(k)) for k in keys]
    assert sizes[0] < BLOCK // 100 and sizes[1] < BLOCK // 10  # really stored compressed
    assert sizes[2] > BLOCK  # incompressible: stored raw (header + payload)
    for compression in ("zstd", "none"):  # a reader that does not compress still decodes
        reader = open_io(remote_cfg(url=server.url, compression=compression))
        got, r = read(reader, keys)
        assert got == data and r.failed == []
        assert reader.stats.hits == 3 and reader.stats.rejected == 0


def test_a_compressed_record_that_inflates_to_another_size_is_a_miss(valkey):
    """A peer with another block size compresses too: the raw length is checked before a byte
    is decompressed into the slot."""
    server = valkey()
    writer = open_io(remote_cfg(url=server.url, compression="zstd"), block_bytes=2 * BLOCK)
    assert write(writer, [b"k"], [bytes(2 * BLOCK)]).ok == [True]
    reader = open_io(remote_cfg(url=server.url, compression="zstd"))
    _, r = read(reader, [b"k"])
    assert r.failed == [0] and r.transient == [] and reader.stats.rejected == 1


def test_with_a_mac_key_only_records_tagged_with_that_key_are_loaded(valkey):
    server = valkey()
    key = os.urandom(32)
    for compression in ("none", "zstd"):
        cfg = remote_cfg(url=server.url, compression=compression)
        ours = open_io(cfg, secrets=RemoteSecrets(mac_key=key))
        forger = open_io(cfg, secrets=RemoteSecrets(mac_key=os.urandom(32)))
        untagged = open_io(cfg)
        data = [bytes(BLOCK // 2) + os.urandom(BLOCK // 2) for _ in range(3)]
        keys = [f"{compression}-{w}".encode() for w in ("ours", "forged", "untagged")]
        assert write(ours, keys[:1], data[:1]).ok == [True]
        assert write(forger, keys[1:2], data[1:2]).ok == [True]
        assert write(untagged, keys[2:], data[2:]).ok == [True]
        got, r = read(ours, keys)
        assert got[0] == data[0] and r.failed == [1, 2] and r.transient == []
        assert ours.stats.hits == 1 and ours.stats.rejected == 2
        before = ours.stats.unauthenticated
        assert read(ours, keys[1:2])[1].failed == [0]
        assert ours.stats.unauthenticated == before + 1  # the forged tag is counted as such
        # a tag moved to another key does not verify there (it covers the identity)
        raw = server.client()
        raw.set(ours.keys.server_key(keys[1]), raw.get(ours.keys.server_key(keys[0])))
        _, r = read(ours, [keys[1]])
        assert r.failed == [0] and ours.stats.rejected == 4 and ours.stats.hits == 1


def _node_of_slot(nodes, slot: int):
    step = SLOTS // len(nodes)
    return min(slot // step, len(nodes) - 1)


def _move_empty_slot(nodes, server_key: bytes) -> int:
    """Give ``server_key``'s (empty) slot to the next primary, on every node; its index."""
    slot = key_slot(server_key)
    old = _node_of_slot(nodes, slot)
    assert nodes[old].client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    new = (old + 1) % len(nodes)
    new_id = nodes[new].client().execute_command("CLUSTER", "MYID")
    for i in [new, old] + [i for i in range(len(nodes)) if i not in (new, old)]:
        nodes[i].client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", new_id)
    return new


def test_a_slot_moved_after_the_map_was_read_costs_only_its_key_once(cluster):
    """``MOVED`` for one key fails that key only (a refusal on a put, a transient miss on a
    fetch: the connection stays); the next call reads the slot map again and reaches it."""
    cfg = remote_cfg(nodes=[n.node for n in cluster])
    io = open_io(cfg)
    keys = [f"m{i}".encode() for i in range(8)]
    data = payloads(8)
    assert write(io, keys[2:], data[2:]).ok == [True] * 6  # the slot map is read here
    server_keys = [io.keys.server_key(k) for k in keys]
    assert len({key_slot(k) for k in server_keys}) == 8

    new = _move_empty_slot(cluster, server_keys[0])
    p = write(io, keys[:1] + keys[2:], data[:1] + data[2:])  # keys[1] stays unwritten
    assert p.ok == [False] + [True] * 6 and p.lost == []
    assert io.stats.errors == 1 and "MOVED" in io.stats.last_error
    assert write(io, keys[:1], data[:1]).ok == [True]  # map read again: the new owner
    assert cluster[new].client().strlen(server_keys[0]) > BLOCK

    new = _move_empty_slot(cluster, server_keys[1])
    assert write(open_io(cfg), keys[1:2], data[1:2]).ok == [True]  # a fresh map's writer
    got, r = read(io, keys)  # io's map still sends keys[1] to its old owner
    assert r.failed == [1] and r.transient == [1]
    assert all(got[i] == data[i] for i in range(8) if i != 1)
    got, r = read(io, keys)
    assert got == data and r.failed == []
    assert cluster[new].client().exists(server_keys[1]) == 1


def test_a_standalone_config_on_a_cluster_node_misses_only_other_nodes_keys(cluster):
    """A misconfigured ``url`` naming one Cluster node: that node's keys work, every other key
    is answered ``MOVED`` and fails alone, never stored or read anywhere else."""
    io = open_io(remote_cfg(url=cluster[0].url))
    keys = [f"s{i}".encode() for i in range(12)]
    data = payloads(12)
    here = [i for i, k in enumerate(keys)
            if _node_of_slot(cluster, key_slot(io.keys.server_key(k))) == 0]
    assert 0 < len(here) < 12
    p = write(io, keys, data)
    assert p.ok == [i in here for i in range(12)] and p.lost == []
    got, r = read(io, keys)
    assert r.failed == [i for i in range(12) if i not in here]
    assert all(got[i] == data[i] for i in here)
    assert io.stats.rejected == 0 and io.stats.hits == len(here)


def test_a_put_keeps_a_bounded_window_of_sets_unanswered(valkey, monkeypatch):
    """The server runs one event loop for all its clients: a put that queued its whole share
    of SETs at once made the scheduler's presence lookups wait behind them. At most
    ``WRITE_WINDOW_BYTES`` (and at least one block) go out unanswered; every block lands."""
    from kvtier.tiers.remote import block_io as block_io_mod
    from kvtier.tiers.remote.wire.resp import RespConnection

    monkeypatch.setattr(block_io_mod, "WRITE_WINDOW_BYTES", 3 * BLOCK)
    in_flight, peak = [0], [0]
    send, read_reply = RespConnection.send, RespConnection.read_reply

    def counted_send(self, commands):
        in_flight[0] += sum(1 for c in commands if bytes(memoryview(c[2]))[:3] == b"SET")
        peak[0] = max(peak[0], in_flight[0])
        return send(self, commands)

    def counted_reply(self):
        in_flight[0] -= 1
        return read_reply(self)

    io = open_io(remote_cfg(url=valkey().url, connections=2), slots=40)
    data = payloads(40)
    try:
        monkeypatch.setattr(RespConnection, "send", counted_send)
        monkeypatch.setattr(RespConnection, "read_reply", counted_reply)
        assert write(io, [b"w%d" % i for i in range(40)], data).ok == [True] * 40
        monkeypatch.undo()
        got, r = read(io, [b"w%d" % i for i in range(40)])
    finally:
        io.close()
    assert peak[0] == 3 and in_flight[0] == 0
    assert r.failed == [] and got == data
