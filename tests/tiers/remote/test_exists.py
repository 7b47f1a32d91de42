"""The presence directory's EXISTS queries (``tiers/remote/exists.py``) against real servers on
127.0.0.1: thousands of keys answered in one pipeline per node, exactly; on a Cluster the keys
of one group may live on different primaries; a dead or hung server costs a bounded wait,
marks the tier degraded, and from then on no socket is touched until a probe."""

from __future__ import annotations

import time

import pytest

from kvtier.tiers.remote.exists import PresenceQueries
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.secrets import RemoteSecrets
from support.remote_blocks import remote_cfg
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures


def _queries(cfg) -> tuple[PresenceQueries, list[str]]:
    errors: list[str] = []
    return PresenceQueries(cfg, RemoteSecrets(), RemoteHealth(60.0), errors.append), errors


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_thousands_of_groups_are_counted_exactly_in_one_call(request, where):
    if where == "cluster":
        nodes = request.getfixturevalue("cluster")
        cfg = remote_cfg(nodes=[n.node for n in nodes])
        clients = [n.client() for n in nodes]
    else:
        server = request.getfixturevalue("valkey")()
        cfg = remote_cfg(url=server.url)
        clients = [server.client()]
    present = {f"k{i}".encode() for i in range(0, 3000, 3)}
    for key in present:  # a Cluster node takes only its own slots: SET through a node's
        for c in clients:  # client, keeping the one that accepts it
            try:
                c.set(key, b"x")
                break
            except Exception:  # noqa: BLE001 - MOVED: another primary's slot
                continue
    assert sum(int(c.dbsize()) for c in clients) == len(present)
    groups = [[f"k{i}".encode(), f"k{i + 1}".encode()] for i in range(0, 3000, 2)]
    q, errors = _queries(cfg)
    try:
        got = q.count_present(groups)
    finally:
        q.close()
    assert got == [sum(k in present for k in g) for g in groups]
    assert errors == [] and not q.health.degraded


def test_a_dead_server_is_absent_degraded_and_then_left_alone(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    q, errors = _queries(cfg)
    server.client().set(b"a", b"1")
    assert q.count_present([[b"a"], [b"b"]]) == [1, 0]
    server.kill()
    t0 = time.monotonic()
    assert q.count_present([[b"a"], [b"b"]]) == [None, None]
    assert time.monotonic() - t0 < cfg.connect_timeout_s + cfg.timeout_s + 0.5
    assert q.health.degraded and errors
    server.start()  # back, but a degraded tier waits for its probe: no socket touched
    n = len(errors)
    assert q.count_present([[b"a"]]) == [None] and len(errors) == n
    q.health.recovered()  # what a successful probe does
    assert q.count_present([[b"a"]]) == [0]  # the restarted server is empty
    q.close()


def test_a_hung_server_costs_a_bounded_wait(valkey):
    server = valkey()
    cfg = remote_cfg(url=server.url)
    q, errors = _queries(cfg)
    assert q.count_present([[b"x"]]) == [0]
    server.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        t0 = time.monotonic()
        assert q.count_present([[b"x"], [b"y"]]) == [None, None]
        assert time.monotonic() - t0 < cfg.timeout_s + 0.5
        assert q.health.degraded and errors
    finally:
        server.resume()
        q.close()
