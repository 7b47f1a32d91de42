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


def test_one_key_per_group_is_answered_per_key(valkey):
    """The common case (no tensor-parallel shards): each answer is its own key's."""
    server = valkey()
    client = server.client()
    keys = [f"solo{i}".encode() for i in range(2500)]
    for k in keys[::7]:
        client.set(k, b"x")
    q, errors = _queries(remote_cfg(url=server.url))
    try:
        got = q.count_present([[k] for k in keys])
    finally:
        q.close()
    assert got == [int(i % 7 == 0) for i in range(len(keys))] and errors == []


def test_integer_replies_in_bulk_keep_errors_in_step_and_refuse_other_types(valkey):
    """``read_integers`` parses a pipeline's replies a buffer at a time: an error reply is
    that command's answer (the next ones stay in step); a reply of another type means the
    stream is not what was asked for: the connection is given up."""
    from kvtier.tiers.remote.wire.resp import (Endpoint, ProtocolError, RespConnection, RespError,
                                          command, key_commands)

    server = valkey()
    server.client().set(b"here", b"x")
    conn = RespConnection(Endpoint("127.0.0.1", server.port))
    try:
        many = [b"here" if i % 2 else b"gone%d" % i for i in range(6000)]  # > one read buffer
        conn.send([[key_commands(b"EXISTS", many[:3000])], command("NOSUCHCOMMAND"),
                   [key_commands(b"EXISTS", many[3000:])]])
        got = conn.read_integers(6001)
        assert isinstance(got[3000], RespError)
        assert got[:3000] + got[3001:] == [i % 2 for i in range(6000)]
        conn.send([command("GET", "here")])
        with pytest.raises(ProtocolError):
            conn.read_integers(1)
        assert conn.broken
    finally:
        conn.close()


def test_a_pipeline_of_thousands_of_small_commands_goes_out_whole(valkey):
    """Small pieces are joined before sending (thousands of commands, far over one
    ``sendmsg``'s 512 buffers), values sent from their own buffers; every command lands."""
    from kvtier.tiers.remote.wire.resp import Endpoint, RespConnection, command, command_with_value

    server = valkey()
    conn = RespConnection(Endpoint("127.0.0.1", server.port))
    value = memoryview(bytearray(range(256)) * 1024)  # 256 KiB, sent in place
    try:
        cmds = [command("SET", f"s{i}", "v") for i in range(4000)]
        cmds.append(command_with_value([b"SET", b"big"], [b"head", value, b"tail"]))
        conn.send(cmds)
        assert [conn.read_reply() for _ in cmds] == ["OK"] * len(cmds)
        assert conn.call("DBSIZE") == 4001
        assert conn.call("GET", "big") == b"head" + bytes(value) + b"tail"
    finally:
        conn.close()
