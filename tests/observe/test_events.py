"""KV-event stream: config, wire format (vLLM-compatible), conversion, publisher, replay, gaps,
drops, the subscriber, the example consumer and ``kvtier events``."""

from __future__ import annotations

import importlib.util
import json
import random
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cli.main import cli
from kvtier.config import ConfigError, load_config
from kvtier.config.schema import EventsConfig, endpoint_problem
from kvtier.observe.events import (
    AllBlocksCleared,
    BlockAccessed,
    BlockMeta,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventPublisher,
    EventSubscriber,
    Gap,
    KvtierEventBatch,
    ManagerFeed,
    MetadataCache,
    decode_batch,
    encode_batch,
    resident_blocks,
)
from kvtier.observe.events.convert import EventConverter
from kvtier.observe.events.replay import ReplayBuffer
from kvtier.observe.events.wire import END_SEQ, DecodeError, ReplayGap, decode_gap, seq_bytes, seq_of
from kvtier.manager import events as mgr
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager

ROOT = Path(__file__).resolve().parents[2]
ANY = "tcp://127.0.0.1:0"


def load_example():
    spec = importlib.util.spec_from_file_location("block_index_consumer",
                                                  ROOT / "examples" / "block_index_consumer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


def cfg(**kw) -> EventsConfig:
    kw.setdefault("endpoint", ANY)
    kw.setdefault("replay_endpoint", ANY)
    return EventsConfig(**kw)


def collect(sub: EventSubscriber, until, timeout: float = 10.0) -> list:
    """Poll until ``until(items)`` holds (a liveness bound, not a timing assertion)."""
    items: list = []
    deadline = time.monotonic() + timeout
    while not until(items):
        assert time.monotonic() < deadline, f"stream stalled after {len(items)} items"
        items += sub.poll(0.1)
    return items


# -- config --------------------------------------------------------------------------------------


def test_events_config_defaults_and_values(tmp_path):
    assert load_config(env={}).events is None
    assert load_config(text="events: null\n", env={}).events is None
    on = load_config(text="events: {}\n", env={}).events
    assert on == EventsConfig() and on.endpoint == "tcp://127.0.0.1:5570" and on.replay_endpoint is None
    text = ("events:\n  endpoint: ipc:///tmp/kv.sock\n  replay_endpoint: tcp://[::1]:5571\n"
            "  topic: kv@pod-1\n  buffer_batches: 50\n")
    c = load_config(text=text, env={}).events
    assert (c.endpoint, c.replay_endpoint, c.topic, c.buffer_batches, c.allow_remote) == (
        "ipc:///tmp/kv.sock", "tcp://[::1]:5571", "kv@pod-1", 50, False)
    remote = load_config(text="events: {endpoint: 'tcp://*:5557', allow_remote: true}\n", env={})
    assert remote.events.endpoint == "tcp://*:5557" and remote.to_dict()["events"]["allow_remote"] is True


def test_events_env_overrides_enable_the_stream():
    c = load_config(env={"KVTIER_EVENTS_ENDPOINT": "tcp://127.0.0.1:7000",
                         "KVTIER_EVENTS_REPLAY_ENDPOINT": "tcp://localhost:7001",
                         "KVTIER_EVENTS_TOPIC": "t", "KVTIER_EVENTS_BUFFER_BATCHES": "9"}).events
    assert (c.endpoint, c.replay_endpoint, c.topic, c.buffer_batches) == (
        "tcp://127.0.0.1:7000", "tcp://localhost:7001", "t", 9)
    c = load_config(env={"KVTIER_EVENTS_ENDPOINT": "tcp://10.0.0.1:1",
                         "KVTIER_EVENTS_ALLOW_REMOTE": "yes"}).events
    assert c.allow_remote and c.endpoint == "tcp://10.0.0.1:1"
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_EVENTS_ENDPOINT": "tcp://10.0.0.1:1"})
    assert info.value.key == "KVTIER_EVENTS_ENDPOINT" and "allow_remote" in str(info.value)


@pytest.mark.parametrize("text, line, key, fragment", [
    ("events:\n  endpoint: tcp://*:5557\n", 2, "events.endpoint", "not a loopback address"),
    ("events:\n  endpoint: tcp://0.0.0.0:5557\n", 2, "events.endpoint", "allow_remote: true"),
    ("events:\n  endpoint: tcp://eth0:5557\n", 2, "events.endpoint", "not a loopback"),
    ("events:\n  endpoint: udp://127.0.0.1:1\n", 2, "events.endpoint", "unsupported endpoint"),
    ("events:\n  endpoint: tcp://127.0.0.1:99999\n", 2, "events.endpoint", "bad port"),
    ("events:\n  endpoint: tcp://127.0.0.1\n", 2, "events.endpoint", "HOST:PORT"),
    ("events:\n  endpoint: 5557\n", 2, "events.endpoint", "must be a string"),
    ("events:\n  endpoint: 'ipc://'\n", 2, "events.endpoint", "no address"),
    ("events:\n  replay_endpoint: tcp://127.0.0.1:5570\n", 2, "events.replay_endpoint", "must differ"),
    ("events:\n  replay_endpoint: tcp://*:1\n", 2, "events.replay_endpoint", "not a loopback"),
    ("events:\n  topic: [a]\n", 2, "events.topic", "must be a string"),
    ("events:\n  buffer_batches: 0\n", 2, "events.buffer_batches", "out of range"),
    ("events:\n  allow_remote: maybe\n", 2, "events.allow_remote", "true or false"),
    ("events:\n  endpont: tcp://127.0.0.1:1\n", 2, "events.endpont", "did you mean 'endpoint'"),
    ("events: 5\n", 1, "events", "must be a mapping"),
])
def test_bad_events_config_cites_line_and_key(tmp_path, text, line, key, fragment):
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    err = info.value
    assert (err.line, err.key) == (line, key) and fragment in str(err), str(err)


@pytest.mark.parametrize("endpoint, remote_ok, local_ok", [
    ("tcp://127.0.0.1:5570", True, True), ("tcp://127.9.9.9:1", True, True),
    ("tcp://localhost:*", True, True), ("tcp://[::1]:0", True, True),
    ("ipc:///run/kv", True, True), ("inproc://x", True, True),
    ("tcp://*:5557", True, False), ("tcp://0.0.0.0:1", True, False), ("tcp://[::]:1", True, False),
    ("tcp://192.168.1.2:1", True, False), ("tcp://example.com:1", True, False),
    ("tcp://127.0.0.1:-1", False, False), ("http://127.0.0.1:1", False, False), ("", False, False),
    ("tcp://127.0.0.1:٣", False, False), ("tcp://127.0.0.1:", False, False),
])
def test_endpoint_problem(endpoint, remote_ok, local_ok):
    assert (endpoint_problem(endpoint, allow_remote=True) is None) == remote_ok
    assert (endpoint_problem(endpoint, allow_remote=False) is None) == local_ok


_SCALARS = (st.none() | st.booleans() | st.integers(-5, 70000) | st.text(max_size=12)
            | st.sampled_from(["tcp://127.0.0.1:0", "tcp://*:1", "ipc:///x", "tcp://[::1]:٣",
                               "tcp://127.0.0.1:5570", "inproc://a"]))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["endpoint", "replay_endpoint", "topic", "buffer_batches",
                                        "allow_remote", "port", "host"]), _SCALARS, max_size=5),
       st.sampled_from(["events", "metrics"]))
def test_schema_shaped_events_and_metrics_give_config_or_config_error(section, name):
    try:
        c = load_config(data={name: section}, env={})
    except ConfigError as err:
        assert err.key and err.key.startswith(name)
    else:
        assert getattr(c, name) is not None


def test_events_config_checks_direct_construction():
    with pytest.raises(ValueError, match="allow_remote"):
        EventsConfig(endpoint="tcp://*:5557")
    with pytest.raises(ValueError, match="differ"):
        EventsConfig(endpoint="ipc:///a", replay_endpoint="ipc:///a")
    EventsConfig(endpoint=ANY, replay_endpoint=ANY)  # two any-port endpoints never clash


# -- wire format ---------------------------------------------------------------------------------


def test_batch_without_access_is_exactly_vllms_three_element_array():
    batch = KvtierEventBatch(1.5, [BlockRemoved([k(1)], "CPU"), AllBlocksCleared()], 3)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [1.5, [{"type": "BlockRemoved", "block_hashes": [k(1)], "medium": "CPU"},
                         {"type": "AllBlocksCleared"}], 3]
    with_access = KvtierEventBatch(1.5, [], None, [BlockAccessed([k(2)], "STORAGE", 512)])
    raw = msgspec.msgpack.decode(encode_batch(with_access))
    assert raw == [1.5, [], None, [{"type": "BlockAccessed", "block_hashes": [k(2)],
                                    "medium": "STORAGE", "num_tokens": 512}]]
    assert decode_batch(encode_batch(with_access)) == with_access
    assert decode_batch(encode_batch(batch)) == batch


def test_stored_field_order_and_omitted_defaults():
    ev = BlockStored([k(1), 7], k(0), [1, 2, 3], 16, None, "GPU", None)
    raw = msgspec.msgpack.decode(encode_batch(KvtierEventBatch(0.0, [ev])))[1][0]
    assert list(raw) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "lora_id", "medium", "lora_name"]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_decoding_garbage_raises_only_decode_errors(data):
    try:
        assert isinstance(decode_batch(data), KvtierEventBatch)
    except DecodeError:
        pass
    try:
        assert isinstance(decode_gap(data), ReplayGap)
    except DecodeError:
        pass


def test_seq_frames():
    assert seq_of(seq_bytes(5)) == 5 and seq_of(seq_bytes(END_SEQ)) == -1
    assert seq_bytes(1) == (1).to_bytes(8, "big")  # what vLLM sends
    with pytest.raises(ValueError):
        seq_of(b"\0" * 7)


# -- conversion ----------------------------------------------------------------------------------


def test_converter_groups_chains_and_falls_back_to_placeholders():
    cache = MetadataCache(100)
    cache.remember(k(1), [1, 2, 3, 4], parent=k(0))
    cache.remember(k(2), [5, 6, 7, 8], parent=k(1))
    cache.remember(k(3), [9, 10], parent=k(2))  # partial: ends its chain
    cache.remember(k(4), [11, 12, 13, 14], parent=k(3))
    cache.remember(k(6), [1, 1, 1, 1], parent=None, lora_name="a")
    cache.remember(k(7), [2, 2, 2, 2], parent=k(6), lora_name="b")  # LoRA change: new event
    conv = EventConverter(4, cache)
    out = conv.stored(Medium.DISK, [k(1), k(2), k(3), k(4), k(8), k(9), k(6), k(7)])
    shape = [(e.block_hashes, e.parent_block_hash, e.token_ids, e.lora_name) for e in out]
    assert shape == [
        ([k(1), k(2), k(3)], k(0), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None),
        ([k(4)], k(3), [11, 12, 13, 14], None),
        ([k(8), k(9)], None, [], None),  # unknown: hash-only placeholder
        ([k(6)], None, [1, 1, 1, 1], "a"),
        ([k(7)], k(6), [2, 2, 2, 2], "b"),
    ]
    assert all(e.medium == "STORAGE" and e.block_size == 4 for e in out)
    acc = conv.accessed(Medium.CPU, [k(3), k(8)])
    assert (acc.medium, acc.num_tokens) == ("CPU", 2 + 4)


def test_shared_tier_events_say_locality_remote_and_local_tiers_stay_unchanged():
    """kvtier's stream: the shared tier's events carry vLLM's ``locality="REMOTE"``; this
    host's tiers leave it unset (their bytes are what vLLM's own events would be)."""
    cache = MetadataCache(10)
    cache.remember(k(1), [1, 2, 3, 4], parent=k(0))
    conv = EventConverter(4, cache)
    remote = conv.stored(Medium.REMOTE, [k(1), k(5)])  # a full event and a placeholder
    assert [(e.medium, e.locality) for e in remote] == [("REMOTE", "REMOTE")] * 2
    assert conv.removed(Medium.REMOTE, [k(1)]).locality == "REMOTE"
    assert conv.removed(Medium.CPU, [k(1)]).locality is None
    assert [e.locality for e in conv.stored(Medium.DISK, [k(1), k(5)])] == [None, None]
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(conv.stored(Medium.REMOTE, [k(5)])[0]))
    assert raw["locality"] == "REMOTE"


def test_converter_survives_bad_metadata():
    def lookup(key):
        if key == k(1):
            raise RuntimeError("boom")
        if key == k(2):
            return BlockMeta(list(range(99)))  # more tokens than a block holds
        return "not metadata"

    conv = EventConverter(16, lookup, wire_hash=lambda key: int.from_bytes(key, "little"))
    out = conv.stored(Medium.CPU, [k(1), k(2), k(3)])
    assert [(e.block_hashes, e.token_ids) for e in out] == [([1, 2, 3], [])]
    assert conv.metadata_errors == 3
    state, access = conv.convert([mgr.BlockRemoved(Medium.CPU, (k(5),)),
                                  mgr.BlockAccessed(Medium.DISK, (k(5),)),
                                  mgr.BlockStored(Medium.CPU, ())])
    assert state == [BlockRemoved([5], "CPU")] and access == [BlockAccessed([5], "STORAGE", 16)]


def test_metadata_cache_is_bounded_lru():
    cache = MetadataCache(2)
    cache.remember(k(1), [1])
    cache.remember(k(2), [2])
    assert list(cache(k(1)).token_ids) == [1]  # touch k(1): k(2) is now the oldest
    cache.remember(k(3), [3])
    assert cache(k(2)) is None and cache(k(1)) is not None and len(cache) == 2


def test_replay_buffer_bounds_and_gaps():
    buf = ReplayBuffer(max_batches=3, max_bytes=10)
    assert buf.get(0) is None and buf.first_seq == -1
    for seq in range(5):
        buf.append(seq, b"xx")
    assert (buf.first_seq, buf.last_seq, len(buf)) == (2, 4, 3)
    # evicted, held, not yet published (the gap notices: test_event_stream_parts.py)
    assert [buf.get(seq) for seq in range(6)] == [None, None, b"xx", b"xx", b"xx", None]
    buf.append(5, b"0123456789")  # the byte bound keeps at least the newest batch
    assert (len(buf), buf.first_seq) == (1, 5)
    with pytest.raises(ValueError):
        buf.append(5, b"")


# -- publisher and subscriber --------------------------------------------------------------------


class Workload:
    """A random manager workload with background transfers settled at random (some fail)."""

    def __init__(self, seed: int, cpu: int = 12, disk: int = 30, keys: int = 80) -> None:
        self.rng = random.Random(seed)
        self.m = TieredOffloadingManager(cpu_blocks=cpu, disk_blocks=disk, flush_reserve=4)
        self.keys = [k(i) for i in range(keys)]
        self.bg: list = []

    def step(self) -> None:
        m, rng = self.m, self.rng
        start = rng.randrange(len(self.keys) - 6)
        prompt = self.keys[start:start + rng.randint(1, 6)]
        hits = m.lookup(prompt).num_hits
        if hits:
            plan = m.prepare_load(prompt[:hits])
            failed = [key for key in plan.keys if rng.random() < 0.05]
            m.complete_load(plan.keys, failed)
        plan = m.prepare_store(prompt[hits:])
        if plan.keys:
            m.complete_store(plan.keys, success=rng.random() > 0.05)
        self.bg += m.take_background_transfers()
        while self.bg and rng.random() < 0.7:  # out of order; 10% of demotions fail
            t = self.bg.pop(rng.randrange(len(self.bg)))
            m.complete_background(t.id, success=t.dst.medium is Medium.DROP or rng.random() > 0.1)

    def settle(self) -> None:
        while True:
            self.bg += self.m.take_background_transfers()
            if not self.bg:
                return
            for t in self.bg:
                self.m.complete_background(t.id, True)
            self.bg = []


def as_wire_sets(manager) -> dict[str, set]:
    names = {Medium.CPU: "CPU", Medium.DISK: "STORAGE"}
    return {names[m]: set(keys) for m, keys in resident_blocks(manager).items() if keys}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_consumer_rebuilds_tier_sets_across_a_reconnect(seed):
    example = load_example()
    w = Workload(seed)
    with EventPublisher(cfg(), block_tokens=16) as pub:
        feed = ManagerFeed(w.m, pub)
        index = example.BlockIndex()
        sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        for _ in range(150):
            w.step()
            feed.pump()
            for item in sub.poll(0):
                index.apply(item)
        pub.flush()
        for item in sub.sync():
            index.apply(item)
        assert not index.stale and index.sets() == as_wire_sets(w.m)
        sub.close()  # the consumer goes away mid-stream; the workload goes on
        for _ in range(150):
            w.step()
            feed.pump()
        sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=index.last_seq + 1)
        for _ in range(100):
            w.step()
            feed.pump()
            for item in sub.poll(0):
                index.apply(item)
        w.settle()
        feed.pump()
        pub.flush()
        for item in sub.sync():
            index.apply(item)
        sub.close()
        stats = pub.stats()
    assert not index.stale and stats.dropped_events == 0 and stats.replay_gaps == 0
    assert index.last_seq == stats.last_seq
    assert index.sets() == as_wire_sets(w.m)
    assert sum(index.hits.values()) > 0 and set(index.sets()) <= {"CPU", "STORAGE"}


def test_gap_is_reported_then_a_resync_restores_the_state():
    example = load_example()
    w = Workload(7)
    with EventPublisher(cfg(buffer_batches=3), block_tokens=16, min_resync_interval_s=0) as pub:
        feed = ManagerFeed(w.m, pub)
        for _ in range(60):  # one batch per step at least: far more than 3 are buffered
            w.step()
            feed.pump()
            pub.flush()
        index = example.BlockIndex()
        sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0)
        items = sub.sync()
        gaps = [i for i in items if isinstance(i, Gap)]
        assert gaps and gaps[0].expected == 0 and gaps[0].resumed_at > 0
        assert "no longer holds" in gaps[0].reason
        for item in items:
            index.apply(item)
        assert index.stale  # told, not silently given a partial history
        assert pub.wants_resync
        feed.pump()  # the owner's next pump resyncs: AllBlocksCleared + every resident block
        pub.flush()
        for item in sub.sync():
            index.apply(item)
        sub.close()
        assert pub.stats().replay_gaps >= 1 and pub.stats().resyncs == 2
    assert not index.stale and index.sets() == as_wire_sets(w.m)


def test_full_queue_drops_without_blocking_and_resyncs():
    example = load_example()
    gate = threading.Event()
    entered = threading.Event()

    def slow_lookup(key):  # holds the publisher thread inside a conversion
        entered.set()
        gate.wait(30)
        return None

    w = Workload(11)
    pub = EventPublisher(cfg(), block_tokens=16, metadata=slow_lookup, max_queue_events=5)
    try:
        feed = ManagerFeed(w.m, pub)
        sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        while not entered.is_set():  # wait until the thread is stuck in a lookup
            w.step()
            feed.pump()
            time.sleep(0.01)
        for _ in range(100):  # publish() keeps returning while the thread is stuck
            w.step()
            feed.pump()
        assert pub.stats().dropped_events > 0 and pub.wants_resync
        gate.set()
        w.settle()
        feed.pump()  # repairs the stream: AllBlocksCleared + resident blocks
        while pub.wants_resync:  # (a resync still queued when the thread was stuck is redone)
            assert pub.flush()
            feed.pump()
        assert pub.flush()
        index = example.BlockIndex()
        for item in sub.sync():
            index.apply(item)
        sub.close()
    finally:
        gate.set()
        pub.close()
    assert pub.stats().resyncs >= 2 and not pub.wants_resync
    assert index.sets() == as_wire_sets(w.m)


def test_manager_bus_drops_mark_the_stream_lost():
    m = TieredOffloadingManager(cpu_blocks=4)
    with EventPublisher(cfg(), block_tokens=16) as pub:
        feed = ManagerFeed(m, pub)
        pub.flush()  # the initial resync has gone out
        feed.pump()
        assert pub.stats().resyncs == 1 and not pub.wants_resync
        m.events.dropped += 1  # as if the bus overflowed between two pumps
        feed.pump()
        assert pub.stats().resyncs == 2


def test_without_resident_source_a_loss_clears_consumers():
    with EventPublisher(cfg(), block_tokens=16, max_queue_events=1) as pub:
        sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        pub.publish([mgr.BlockStored(Medium.CPU, (k(1), k(2)))])  # 1 event: fits
        pub.flush()
        pub.mark_lost()
        pub.publish([mgr.BlockStored(Medium.CPU, (k(3),))])
        pub.flush()
        items = sub.sync()
        sub.close()
    events = [type(e).__name__ for d in items for e in d.batch.events]
    assert events == ["BlockStored", "AllBlocksCleared", "BlockStored"]


def test_access_events_and_full_payload_over_the_wire():
    cache = MetadataCache(10)
    cache.remember(k(1), list(range(16)), parent=k(0))
    cache.remember(k(2), list(range(16, 24)), parent=k(1))
    with EventPublisher(cfg(topic="kv@a", replay_endpoint=None), block_tokens=16, metadata=cache,
                        data_parallel_rank=2) as pub:
        sub = EventSubscriber(pub.endpoint, topic="kv@a", start_seq=None)
        # slow joiner: keep publishing until the subscription is live, then one real batch
        probe = 0
        items: list = []
        while not items:
            pub.publish([mgr.BlockRemoved(Medium.CPU, (k(100 + probe),))])
            probe += 1
            items = sub.poll(0.05)
        pub.publish([mgr.BlockStored(Medium.DISK, (k(1), k(2))), mgr.BlockAccessed(Medium.CPU, (k(1), k(2)))])
        got = collect(sub, lambda it: any(isinstance(d, Delivery) and d.batch.access for d in it))
        sub.close()
    batch = next(d.batch for d in got if isinstance(d, Delivery) and d.batch.access)
    assert batch.data_parallel_rank == 2
    assert batch.events == [BlockStored([k(1), k(2)], k(0), list(range(24)), 16, None, "STORAGE", None)]
    assert batch.access == [BlockAccessed([k(1), k(2)], "CPU", 24)]


def test_subscriber_reports_undecodable_frames_and_holes_without_replay():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", start_seq=None, context=ctx)
    good = encode_batch(KvtierEventBatch(1.0, [AllBlocksCleared()]))
    try:
        items: list = []
        while not items:  # slow joiner
            pub.send_multipart((b"", seq_bytes(0), good))
            items = sub.poll(0.05)
        pub.send_multipart((b"", seq_bytes(1), b"\xc1garbage"))
        # prefix match, other topic: ignored. Sent before seq 4, whose delivery ends the
        # collection (frames arrive in order), so it is always counted by then
        pub.send_multipart((b"other", seq_bytes(9), good))
        for seq in (3, 4):
            pub.send_multipart((b"", seq_bytes(seq), good))
        items = collect(sub, lambda it: any(getattr(d, "seq", None) == 4 for d in it))
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()
    shape = [(type(i).__name__, getattr(i, "seq", getattr(i, "expected", None))) for i in items]
    assert shape == [("Gap", 1), ("Gap", 2), ("Delivery", 3), ("Delivery", 4)]
    assert items[0].reason == "undecodable batch" and items[1].reason == "no replay endpoint"
    assert sub.bad_frames == 1 and sub.foreign_frames == 1


def test_replay_framing_is_vllms():
    """A DEALER sends ``[b"", start]``; the answer is ``[b"", topic, seq, payload]`` per batch
    from ``start`` on, then ``[b"", b"", -1, b""]``; a malformed request gets the end marker."""
    with EventPublisher(cfg(topic="t"), block_tokens=16) as pub:
        for i in range(3):
            pub.publish([mgr.BlockStored(Medium.CPU, (k(i),))])
            pub.flush()
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        frames = []
        try:
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            while not frames or seq_of(frames[-1][2]) != END_SEQ:
                assert dealer.poll(10_000), "no replay answer"
                frames.append(dealer.recv_multipart())
            dealer.send_multipart((b"", b"bad"))
            assert dealer.poll(10_000)
            bad = dealer.recv_multipart()
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert pub.stats().bad_requests == 1
    got = [(f[0], f[1], seq_of(f[2]), decode_batch(f[3]).events[0].block_hashes) for f in frames[:-1]]
    assert got == [(b"", b"t", 1, [k(1)]), (b"", b"t", 2, [k(2)])]
    assert frames[-1] == [b"", b"", seq_bytes(END_SEQ), b""] and bad == frames[-1]


def test_ipc_endpoint_and_remote_opt_in(tmp_path):
    ep = f"ipc://{tmp_path}/events.sock"
    with EventPublisher(EventsConfig(endpoint=ep, replay_endpoint=f"ipc://{tmp_path}/replay.sock"),
                        block_tokens=16) as pub:
        assert pub.endpoint == ep
        pub.publish([mgr.BlockStored(Medium.CPU, (k(1),))])
        pub.flush()
        with EventSubscriber(ep, replay_endpoint=pub.replay_endpoint) as sub:
            items = sub.sync()
        assert [d.batch.events[0].block_hashes for d in items] == [[k(1)]]
    with pytest.raises(ValueError, match="allow_remote"):
        EventsConfig(endpoint="tcp://0.0.0.0:0")
    with EventPublisher(EventsConfig(endpoint="tcp://0.0.0.0:0", allow_remote=True),
                        block_tokens=16) as pub:  # explicitly allowed: binds every interface
        assert pub.endpoint.startswith("tcp://0.0.0.0:") and pub.replay_endpoint is None


# -- vLLM's own decoder --------------------------------------------------------------------------


def test_vllm_decoder_reads_kvtier_frames_unchanged():
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vllm is not installed")
    cache = MetadataCache(10)
    cache.remember(k(1), list(range(16)), parent=k(0))
    cache.remember(k(2), list(range(16, 32)), parent=k(1))
    with EventPublisher(cfg(topic="kv@x"), block_tokens=16, metadata=cache,
                        data_parallel_rank=1) as pub:
        pub.publish([mgr.BlockStored(Medium.CPU, (k(1), k(2))),
                     mgr.BlockAccessed(Medium.CPU, (k(1),)),
                     mgr.BlockStored(Medium.DISK, (k(3),)),
                     mgr.BlockRemoved(Medium.DISK, (k(3),))])
        pub.flush()
        pub.publish([mgr.BlockRemoved(Medium.CPU, (k(1),))])
        pub.flush()
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        frames = []
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                frames.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)
            ctx.term()
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    batches = [(topic, seq, decoder.decode(payload)) for topic, seq, payload in frames]
    assert [(t, s) for t, s, _ in batches] == [(b"kv@x", 0), (b"kv@x", 1)]
    first = batches[0][2]
    assert isinstance(first, kv_events.KVEventBatch) and first.data_parallel_rank == 1
    stored, placeholder, removed = first.events
    assert isinstance(stored, kv_events.BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size,
            stored.medium, stored.lora_id, stored.lora_name) == (
        [k(1), k(2)], k(0), list(range(32)), 16, kv_events.MEDIUM_CPU, None, None)
    assert (placeholder.block_hashes, placeholder.token_ids, placeholder.medium) == (
        [k(3)], [], kv_events.MEDIUM_STORAGE)
    assert isinstance(removed, kv_events.BlockRemoved) and removed.medium == "STORAGE"
    last = batches[1][2].events
    assert len(last) == 1 and last[0].block_hashes == [k(1)] and last[0].medium == "CPU"
    # and the other way: vLLM's own encoding reads back with kvtier's decoder
    theirs = kv_events.KVEventBatch(ts=2.0, events=[
        kv_events.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1], block_size=1,
                              lora_id=None, medium="GPU", lora_name=None),
        kv_events.AllBlocksCleared()], data_parallel_rank=0)
    ours = decode_batch(msgspec.msgpack.encode(theirs))
    assert ours.events == [BlockStored([5], None, [1], 1, None, "GPU", None), AllBlocksCleared()]


# -- CLI -----------------------------------------------------------------------------------------


def test_events_cli_tails_json_and_text():
    with EventPublisher(cfg(), block_tokens=16) as pub:
        pub.publish([mgr.BlockStored(Medium.CPU, (k(1), k(2))), mgr.BlockAccessed(Medium.DISK, (k(2),))])
        pub.flush()
        pub.publish([mgr.BlockRemoved(Medium.CPU, (k(1),))])
        pub.flush()
        args = ["events", "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
                "--from-seq", "0", "--count", "2"]
        out = CliRunner().invoke(cli, args + ["--json"], catch_exceptions=False)
        text = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert out.exit_code == 0 and text.exit_code == 0
    lines = [json.loads(line) for line in out.output.splitlines()]
    assert [x["seq"] for x in lines] == [0, 1] and all(x["replayed"] for x in lines)
    ev = lines[0]["events"][0]
    assert ev == {"type": "BlockStored", "medium": "CPU", "block_hashes": [k(1).hex(), k(2).hex()],
                  "parent_block_hash": None, "block_size": 16, "token_ids": [], "lora_name": None}
    assert lines[0]["access"] == [{"type": "BlockAccessed", "medium": "STORAGE",
                                   "block_hashes": [k(2).hex()], "num_tokens": 16}]
    assert lines[1]["events"][0]["type"] == "BlockRemoved"
    assert "stored  CPU" in text.output and "hit     STORAGE" in text.output
    assert "removed CPU" in text.output


def test_events_cli_errors():
    runner = CliRunner()
    assert runner.invoke(cli, ["events"]).exit_code == 2
    bad = runner.invoke(cli, ["events", "--endpoint", "nonsense"])
    assert bad.exit_code == 2 and "cannot connect" in bad.output
    res = runner.invoke(cli, ["events", "--endpoint", ANY, "--from-seq", "3"])
    assert res.exit_code == 2 and "--replay-endpoint" in res.output
