"""The host tier's index (regions, publication, readers' pins), without processes."""

from __future__ import annotations

import pytest

from kvtier.tiers.host.directory import HostDirectory, HostTierError


def test_regions_are_disjoint_and_come_back_when_their_instance_is_gone():
    d = HostDirectory(100)
    a, b = d.connect("a"), d.connect("b")
    assert d.register(a, 40) == 0
    assert d.register(b, 40) == 40
    c = d.connect("c")
    with pytest.raises(HostTierError, match="no room for 30 slots.*20 of 100 are free"):
        d.register(c, 30)
    d.disconnect(a)
    assert d.register(c, 30) == 0  # a's region, free again
    assert "a" not in d.instances


def test_a_published_block_is_read_from_its_owners_slot_and_pinned_until_released():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    base = d.register(a, 5)
    d.register(b, 5)
    d.publish(a, [b"k1", b"k2"], [base, base + 1])
    assert d.find([b"k1", b"k3", b"k2"]) == [True, False, True]
    assert d.acquire(b, [b"k1", b"k3"]) == [base, -1]
    assert d.retire(a, [b"k1", b"k2"]) == [b"k1"]  # being read: stays; k2 goes
    assert d.find([b"k1", b"k2"]) == [True, False]
    assert d.release(b, [base]) == 0
    assert d.retire(a, [b"k1"]) == []
    assert d.find([b"k1"]) == [False] and d.pins() == 0
    assert d.instances["a"].hits_given == 1 and d.instances["b"].hits_taken == 1


def test_publishing_outside_the_own_region_is_refused():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.register(b, 5)
    with pytest.raises(HostTierError, match=r"outside instance 'a'"):
        d.publish(a, [b"k"], [7])
    assert d.find([b"k"]) == [False]


def test_the_first_copy_published_stays_and_the_second_is_counted():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.register(b, 5)
    d.publish(a, [b"k"], [0])
    assert d.publish(b, [b"k"], [5]) == 0
    assert d.acquire(b, [b"k"]) == [0] and d.duplicates == 1
    assert d.retire(b, [b"k"]) == []  # not b's to retire: a's copy stays published
    assert d.find([b"k"]) == [True]


def test_a_gone_owners_block_being_read_frees_its_region_only_after_the_last_reader():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.register(b, 5)
    d.publish(a, [b"k1", b"k2"], [0, 1])
    assert d.acquire(b, [b"k1"]) == [0]
    d.disconnect(a)  # killed mid-read of one of its blocks
    assert d.find([b"k1", b"k2"]) == [False, False]  # nobody new may read it
    c = d.connect("c")
    with pytest.raises(HostTierError, match="no room"):
        d.register(c, 5)  # a's region is still read by b
    d.release(b, [0])
    assert d.register(c, 5) == 0
    assert d.pins() == 0


def test_a_reader_that_dies_releases_its_pins():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.publish(a, [b"k"], [0])
    assert d.acquire(b, [b"k", b"k"]) == [0, 0]
    assert d.retire(a, [b"k"]) == [b"k"]
    d.disconnect(b)
    assert d.pins() == 0
    assert d.retire(a, [b"k"]) == []


def test_an_instances_blocks_go_with_its_scheduler_and_its_region_with_its_last_worker():
    d = HostDirectory(8)
    sched, worker = d.connect("a"), d.connect("a")
    d.register(sched, 8)
    d.publish(sched, [b"k"], [0])
    d.disconnect(sched)  # nobody can retire its blocks any more: none is found
    assert d.find([b"k"]) == [False]
    other = d.connect("b")
    with pytest.raises(HostTierError, match="no room"):
        d.register(other, 8)  # its worker may still write the region
    d.disconnect(worker)
    assert "a" not in d.instances
    assert d.register(other, 8) == 0


def test_releasing_a_pin_never_taken_is_counted_not_applied():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.publish(a, [b"k"], [0])
    d.acquire(b, [b"k"])
    assert d.release(a, [0]) == 1  # a holds no pin on it
    assert d.retire(a, [b"k"]) == [b"k"]


def test_an_owner_learns_the_hits_others_took_on_its_blocks_once():
    d = HostDirectory(10)
    a, b = d.connect("a"), d.connect("b")
    d.register(a, 5)
    d.publish(a, [b"k1", b"k2"], [0, 1])
    d.acquire(b, [b"k2", b"k1"])
    d.acquire(a, [b"k1"])  # its own read is its own business
    assert d.touched(a) == [b"k2", b"k1"]
    assert d.touched(a) == []


def test_an_idle_service_exits_and_removes_its_socket(tmp_path):
    import threading
    import time

    from kvtier.tiers.host.client import HostTierUnavailable, observe
    from kvtier.tiers.host.service import HostService

    sock = tmp_path / "s.sock"
    service = HostService(str(sock), total_slots=4, fingerprint="f", idle_exit_s=0.3)
    service.bind()
    t = threading.Thread(target=service.serve, daemon=True)
    t.start()
    looks = 0
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:  # looks do not keep it alive
        try:
            observe(sock)
            looks += 1
        except HostTierUnavailable:
            pass
        time.sleep(0.05)
    t.join(30)
    assert not t.is_alive() and looks > 0
    assert not sock.exists()
