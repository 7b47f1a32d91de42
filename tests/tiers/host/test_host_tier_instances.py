"""Two kvtier instances on one host tier, through the production path (``kvtier bench``'s
replay: the real manager, worker runtime, transfer engine and pool), and a real service
process that the first instance starts: what one stored is a CPU hit for the other, loaded
from the other's slots byte for byte; a block being read is never evicted under its reader;
a dead service leaves each instance its own region."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.bench.replay import Replay, block_key
from kvtier.bench.trace import load_trace
from kvtier.config import load_config
from kvtier.manager.host import QUARANTINE_S
from kvtier.tiers.host import HostAddress, HostClient, HostTierUnavailable
from kvtier.tiers.host.client import observe

BB = 64 << 10


@pytest.fixture(autouse=True)
def stop_services(tmp_path):
    """Each test's service (started by its first instance) is stopped by its PID."""
    yield
    for log in (tmp_path / "host").glob("*.log"):
        for line in log.read_text().splitlines():
            if "pid=" in line:
                pid = int(line.rsplit("pid=", 1)[1].rstrip(")"))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def host_config(tmp_path, cpu="4MiB", host="16MiB"):
    d = tmp_path / "host"
    return load_config(data={"tiers": {"cpu": {"capacity": cpu, "pin": False},
                                       "host": {"capacity": host, "dir": str(d),
                                                "idle_exit_s": 30}}})


def service_stats(cfg, fingerprint) -> dict:
    return observe(HostAddress.from_config(cfg.host, fingerprint, BB).socket_path)


@pytest.fixture
def trace():
    return load_trace(limit=60)


def gpu_blocks(trace):
    return 2 * max(len(r.hash_ids) for r in trace) + 1


@pytest.fixture
def pair(trace):
    """Two instances on ``cfg``'s host tier, closed after the test."""
    made: list[Replay] = []

    def make(cfg):
        made.extend([Replay(cfg, BB, gpu_blocks(trace)), Replay(cfg, BB, gpu_blocks(trace))])
        return made[-2], made[-1]

    yield make
    for r in made:
        r.close()


def test_a_fresh_instance_hits_what_another_stored_byte_for_byte(tmp_path, trace, pair):
    cfg = host_config(tmp_path)
    a, b = pair(cfg)
    a.run(trace)
    a.manager.host.client.flush()  # its last publications are applied
    assert a.result.wrong_blocks == 0
    b.run(trace)
    # b stored nothing before: its CPU hits are a's blocks, loaded from a's slots
    assert b.manager.stats.host_foreign_hit_blocks > 0
    assert b.result.blocks["CPU"] >= b.manager.stats.host_foreign_hit_blocks > 0
    assert b.result.wrong_blocks == 0 and b.result.failed_loads == 0
    # one copy per host: no block is held by both
    assert not set(a.manager.cpu.keys()) & set(b.manager.cpu.keys())
    a.run(trace)  # and a, running the trace again, stores none of b's blocks
    assert not set(a.manager.cpu.keys()) & set(b.manager.cpu.keys())
    b.manager.host.client.flush()  # its releases are applied
    stats = service_stats(cfg, a.geometry.fingerprint())
    by_name = {i["name"]: i for i in stats["instances"]}
    taken = sum(i["hits_taken"] for i in by_name.values())
    assert taken >= b.manager.stats.host_foreign_hit_blocks
    assert stats["pinned_slots"] == 0  # every load released its pins
    regions = sorted((i["base"], i["slots"]) for i in by_name.values() if i["slots"])
    assert regions[0][0] + regions[0][1] <= regions[1][0]  # disjoint regions


def test_a_block_another_instance_is_reading_is_not_evicted_under_it(tmp_path, trace, pair):
    a, b = pair(host_config(tmp_path, cpu="1MiB", host="4MiB"))  # 16 slots each: evictions
    keys = [block_key(h) for h in trace[0].hash_ids[:4]]
    a.run([trace[0]])
    a.manager.host.client.flush()
    held = [k for k, h in zip(keys, b.manager.host.held(keys)) if h]
    assert held, "a published none of its first request's blocks"
    plan = b.manager.prepare_load(held)  # b pins a's blocks, as a load does
    assert len(plan.keys) == len(held)
    slots_a = {k: a.manager.cpu.get(k).slot for k in held}
    assert list(plan.cpu_slots) == [slots_a[k] for k in held]  # a's own slots
    a.run(trace[1:])  # a stores on, evicting its coldest blocks
    for k in held:  # still a's, same slot: nothing rewrote it under b
        assert a.manager.cpu.get(k) is not None and a.manager.cpu.get(k).slot == slots_a[k]
    assert a.manager.stats.host_evictions_held > 0
    b.manager.complete_load(plan.keys)
    assert b.manager.pins() == 0
    a.run(trace[1:])
    assert a.result.wrong_blocks == 0


def test_hits_from_another_instance_count_in_the_owners_eviction_order(tmp_path, trace, pair):
    a, b = pair(host_config(tmp_path))
    first, second = trace[0], next(r for r in trace if not set(r.hash_ids) & set(
        trace[0].hash_ids))
    a.run([first, second])  # first's blocks are a's coldest
    a.manager.host.client.flush()
    keys = [block_key(h) for h in first.hash_ids]
    plan = b.manager.prepare_load(keys)  # b reads first's blocks from a's region
    assert plan.keys
    b.manager.complete_load(plan.keys)
    coldest = a.manager.cpu.victims(len(plan.keys))
    assert set(coldest) & set(plan.keys)  # a alone does not know they are hot
    a.manager.prepare_store([])  # the round trip before a store brings b's hits
    coldest = a.manager.cpu.victims(len(plan.keys))
    assert not set(coldest) & set(plan.keys)


def test_instances_go_on_alone_when_the_service_dies(tmp_path, trace, pair):
    cfg = host_config(tmp_path)
    a, b = pair(cfg)
    a.run(trace[:20])
    pid = service_stats(cfg, a.geometry.fingerprint())["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    b.run(trace)  # no hits on a's blocks any more, no wrong ones
    a.run(trace)  # a still hits its own region
    assert b.result.wrong_blocks == 0 and a.result.wrong_blocks == 0
    assert not a.manager.host.up and not b.manager.host.up
    assert a.result.blocks["CPU"] > 0
    # its published blocks stay its own for QUARANTINE_S: another's copy may still read one
    assert a.manager.host.retire([b"x"]) == {b"x"}
    a.manager.host.down_since -= QUARANTINE_S
    assert a.manager.host.retire([b"x"]) == set()


def test_an_instance_refuses_a_host_tier_of_another_geometry(tmp_path):
    cfg = host_config(tmp_path)
    address = HostAddress.from_config(cfg.host, "a" * 32, BB)
    first = HostClient.connect(address, "one")
    try:
        other = HostAddress(address.directory, "b" * 24 + "a" * 8, address.total_slots)
        assert other.socket_path != address.socket_path  # another geometry: its own service
        # the same socket, a different fingerprint (a forged or stale hello): refused
        forged = HostAddress(address.directory, "a" * 24 + "b" * 8, address.total_slots)
        assert forged.socket_path == address.socket_path
        with pytest.raises(HostTierUnavailable, match="serves model geometry"):
            HostClient.connect(forged, "two", start=False)
    finally:
        first.close()


def test_a_directory_others_may_enter_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    address = HostAddress(d, "c" * 32, 16)
    with pytest.raises(HostTierUnavailable, match="mode 755: other users could reach"):
        HostClient.connect(address, "x")
    assert not list(d.iterdir())  # nothing started, nothing created


def test_a_stuck_service_never_holds_a_lookup_and_its_instance_stops_being_read(tmp_path):
    from kvtier.manager.factory import build_manager
    from kvtier.manager.host import HostTier
    from support.stopped import stop

    cfg = host_config(tmp_path)
    address = HostAddress.from_config(cfg.host, "d" * 32, BB)
    a_client = HostClient.connect(address, "a", timeout_s=0.5)
    b_client = HostClient.connect(address, "b")
    pid = observe(address.socket_path)["pid"]
    try:
        a = build_manager(cfg, BB, host=HostTier(a_client, a_client.register(16)))
        b_client.register(16)
        plan = a.prepare_store([b"k1", b"k2"])
        a.complete_store(plan.keys)  # published
        a_client.flush()
        assert b_client.find([b"k1", b"k2"]) == [True, True]
        stop(pid)
        started = time.monotonic()
        found = a.lookup([b"k1", b"k2", b"k3"])  # k3: past a's own blocks, asks the service
        assert time.monotonic() - started < 60  # the 0.5 s timeout, not forever
        assert found.num_hits == 2 and a.stats.host_degraded
        os.kill(pid, signal.SIGCONT)
        # a's connection ended with the timeout: nobody can retire its blocks, none is found
        deadline = time.monotonic() + 120
        while b_client.find([b"k1", b"k2"]) != [False, False]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.kill(pid, signal.SIGCONT)
        a_client.close()
        b_client.close()
