"""Write-back skips a block another instance wrote after this one's lookup found it absent.

Round-robin serving across instances makes this common: the next turn lands on the other
instance while the first still writes the previous turn, the lookup finds the tail absent, the
instance recomputes it and queues it for writing too. Where the store is the limit (the writes
wait in a backlog) the same bytes were sent twice. The manager asks the server again about
the blocks whose write starts next, and skips those found held. The real manager on a real
server; "another instance" is a plain client writing under the same server keys."""

from __future__ import annotations

import time

import pytest

from kvtier.config import load_config
from kvtier.manager.factory import build_manager
from kvtier.tiers.record import data_checksum, encode_head
from kvtier.tiers.layout import LAYOUT_VERSION
from kvtier.tiers.remote import RemoteKeys, RemoteStore
from kvtier.tiers.remote.directory import RemoteDirectory
from support.valkey_fixtures import valkey  # noqa: F401 - a pytest fixture

BLOCK = 64 << 10
WAIT_S = 10.0


def settled_lookup(manager, keys):
    """The manager's lookup once the shared tier's answer has landed (it never waits)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = manager.lookup(keys)
        if not found.pending or time.monotonic() > deadline:
            return found
        time.sleep(0.005)


def record(names: RemoteKeys, block_key: bytes, payload: bytes = b"v" * 64) -> bytes:
    """A valid record for ``block_key``, as another instance (no MAC key) writes it."""
    rk = names.record_key(names.server_key(block_key))
    return encode_head(rk, codec=0, layout_version=LAYOUT_VERSION, seq=0, raw_len=len(payload),
                       stored_len=len(payload), checksum=data_checksum(rk, payload)) + payload


def answered(directory) -> None:
    deadline = time.monotonic() + WAIT_S
    while directory.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert directory.pending() == 0


@pytest.fixture
def shared(valkey):
    """``make(namespace, timeout_s)``: the real manager on one real server with two writes in
    flight (its store and presence directory closed after the test); the server too."""
    server = valkey()
    opened: list = []

    def make(namespace: str, timeout_s: float = 1.0):
        cfg = load_config(data={"tiers": {"cpu": {"capacity": "2MiB"},
                                          "remote": {"url": server.url, "max_writes_in_flight": 2,
                                                     "timeout_s": timeout_s}}}, env={})
        names = RemoteKeys(namespace, "geo")
        store = RemoteStore(cfg.remote, names)
        directory = RemoteDirectory(store)
        opened.append((directory, store))
        return build_manager(cfg, BLOCK, remote=directory), directory, names

    yield server, make
    for directory, store in opened:
        directory.close()
        store.close()


def test_a_block_written_by_another_instance_since_the_lookup_is_not_written_again(shared):
    server, make = shared
    manager, directory, names = make("ns-dedup")
    raw = server.client()
    keys = [b"blk-%d" % i for i in range(8)]
    assert settled_lookup(manager, keys).num_hits == 0  # "absent" cached for lookup_ttl_s
    for k in keys[2:4]:  # the instance that computed them first wrote them meanwhile
        raw.set(names.server_key(k), record(names, k))
    plan = manager.prepare_store(keys)
    assert plan.keys == tuple(keys)
    manager.complete_store(keys)
    [first] = manager.take_background_transfers()
    assert list(first.keys) == keys[:2]  # two in flight; the rest wait their turn
    answered(directory)  # asked again about the next two while those were written
    manager.complete_background(first.id, True)
    later = manager.take_background_transfers()
    assert [list(t.keys) for t in later] == [keys[4:6]]  # 2 and 3 held: not written
    manager.complete_background(later[0].id, True)
    [last] = manager.take_background_transfers()
    assert list(last.keys) == keys[6:8]
    manager.complete_background(last.id, True)
    m = manager.stats.snapshot()
    assert m["remote_writes_already_held"] == 2
    assert m["stored_blocks"]["REMOTE"] == 6 and m["remote_writes_skipped"] == 0
    assert manager.pins() == 0  # nothing left pinned by a write that never ran
    # the other instance's values were not overwritten
    assert raw.get(names.server_key(keys[2])) == record(names, keys[2])


def test_junk_under_a_key_is_not_held_and_is_overwritten(shared):
    """A client without the MAC key (or a corrupt, truncated or foreign value) planted junk
    under the keys: EXISTS finds them, but write-back skips a key only when its value is a
    record for it, so the honest writer replaces the junk (before, the junk stayed and every
    later read of those blocks missed)."""
    server, make = shared
    manager, directory, names = make("ns-junk")
    other = RemoteKeys("ns-junk", "other-geometry")  # a record, but not for this geometry
    raw = server.client()
    keys = [b"blk-%d" % i for i in range(8)]
    assert settled_lookup(manager, keys).num_hits == 0
    raw.set(names.server_key(keys[2]), b"junk from a keyless client")
    raw.set(names.server_key(keys[3]), record(names, keys[3])[:-10])  # truncated
    wrong = record(other, keys[4])
    raw.set(names.server_key(keys[4]), wrong)  # another geometry's identity
    raw.set(names.server_key(keys[5]), record(names, keys[5]))  # a valid record: held
    manager.prepare_store(keys)
    manager.complete_store(keys)
    written = []
    for _ in range(8):
        answered(directory)
        batch = manager.take_background_transfers()
        if not batch:
            break
        for t in batch:
            written += list(t.keys)
            manager.complete_background(t.id, True)
    assert written == keys[:5] + keys[6:]
    assert manager.stats.snapshot()["remote_writes_already_held"] == 1
    assert manager.pins() == 0


def test_a_write_is_never_held_back_waiting_for_the_answer(shared):
    """The second look is a hint, not a gate: with the server paused (answers pending), the
    backlog's next writes still start as room frees up."""
    server, make = shared
    manager, directory, _ = make("ns-dedup-2", timeout_s=5.0)
    keys = [b"blk-%d" % i for i in range(4)]
    assert settled_lookup(manager, keys).num_hits == 0
    server.pause()
    try:
        manager.prepare_store(keys)
        manager.complete_store(keys)
        [first] = manager.take_background_transfers()
        assert directory.pending() > 0  # the second look is on its way
        manager.complete_background(first.id, True)
        [second] = manager.take_background_transfers()
        assert list(second.keys) == keys[2:4]
        manager.complete_background(second.id, True)
    finally:
        server.resume()
    assert manager.stats.snapshot()["stored_blocks"]["REMOTE"] == 4
    assert manager.pins() == 0
