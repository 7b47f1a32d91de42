"""The shared tier never repeats a secret, whatever the operator wrote or a server echoes.

A URL or node address with credentials is refused without quoting the password (YAML,
``KVTIER_REMOTE_*`` variables, the CLI's stderr); a server that echoes a failed AUTH's
arguments (``ERR unknown command 'AUTH', with args beginning with: 'user' 'password'``) leaves
no password in exceptions, ``last_error``, the stats, or the log; the I/O processes' command
lines carry none; a Cluster slot map naming a node nobody configured sends it nothing. The
servers are fakes on 127.0.0.1 (:mod:`support.fake_resp`) and real Valkey processes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from kvtier.config import ConfigError, load_config
from kvtier.tiers.remote.block_io import RemoteBlockIO
from kvtier.tiers.remote.exists import PresenceQueries
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.wire.resp import Endpoint, ProtocolError, RespConnection
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.store import RemoteStore
from support.fake_resp import FakeResp
from support.remote_blocks import BLOCK, Slots, remote_cfg

PASSWORD = "pw-" + os.urandom(8).hex()
MAC_HEX = os.urandom(32).hex()


def _echo_auth(args, conn):
    """A server without ACLs that quotes what it refuses (as Valkey does)."""
    if args[0].upper() == b"AUTH":
        quoted = " ".join(f"'{a.decode()}'" for a in args[1:])
        return (f"-ERR unknown command 'AUTH', with args beginning with: {quoted}\r\n").encode()
    return b"+PONG\r\n" if args[0].upper() == b"PING" else b"$-1\r\n"


def _secrets(mac: bool = True) -> RemoteSecrets:
    return RemoteSecrets(username="kvtier", password=PASSWORD,
                         mac_key=bytes.fromhex(MAC_HEX) if mac else None)


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text and MAC_HEX not in text, text


# ---- the config -----------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["yaml", "env"])
def test_a_url_with_credentials_is_refused_without_its_password(where):
    url = f"redis://kvtier:{PASSWORD}@127.0.0.1:6379/0"
    with pytest.raises(ConfigError) as err:
        if where == "yaml":
            load_config(text=f"tiers:\n  remote:\n    url: {url}\n", env={})
        else:
            load_config(text="tiers:\n  remote:\n    namespace: x\n",
                        env={"KVTIER_REMOTE_URL": url})
    _no_secret(str(err.value))
    assert "credentials in the URL" in str(err.value) and "kvtier:***@127.0.0.1" in str(err.value)


@pytest.mark.parametrize("where", ["yaml", "env"])
def test_a_node_with_credentials_is_refused_without_its_password(where):
    node = f"kvtier:{PASSWORD}@127.0.0.1:7000"
    with pytest.raises(ConfigError) as err:
        if where == "yaml":
            load_config(data={"tiers": {"remote": {"nodes": ["127.0.0.1:7001", node]}}}, env={})
        else:
            load_config(text="tiers:\n  remote:\n    namespace: x\n",
                        env={"KVTIER_REMOTE_NODES": f"127.0.0.1:7001,{node}"})
    _no_secret(str(err.value))
    assert "credentials in a node address" in str(err.value)


def test_the_cli_prints_a_refused_url_without_its_password(tmp_path):
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"tiers:\n  remote:\n    url: redis://u:{PASSWORD}@127.0.0.1:1\n")
    run = subprocess.run([sys.executable, "-c", "from kvtier.cli.main import main; main()",
                          "bench", "--config", str(config)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert run.returncode != 0
    assert "credentials in the URL" in run.stderr + run.stdout
    _no_secret(run.stderr, run.stdout)


# ---- what a server echoes ---------------------------------------------------------------------

def test_an_echoed_auth_leaves_no_secret_in_errors_stats_or_log(caplog):
    server = FakeResp(_echo_auth)
    caplog.set_level(logging.DEBUG)
    cfg = remote_cfg(url=server.url, username="kvtier", password_env="X")
    io = RemoteBlockIO(cfg, RemoteKeys("ns", "geo"), _secrets(), Slots(2, BLOCK), BLOCK)
    errors: list[str] = []
    queries = PresenceQueries(cfg, _secrets(), RemoteHealth(60.0), errors.append)
    try:
        assert not io.warm_up()
        assert io.fetch([b"a", b"b"], [0, 1]).failed == [0, 1]
        assert queries.count_present([[b"k"]]) == [None]
        with pytest.raises(ConnectionError) as err:  # straight from the connection, too
            RespConnection(Endpoint("127.0.0.1", server.port, "kvtier", PASSWORD))
    finally:
        io.close()
        queries.close()
        server.close()
    assert any(c[0] == b"AUTH" and PASSWORD.encode() in c for c in server.commands)
    stats = json.dumps(io.stats.to_dict())
    assert io.stats.auth_errors >= 1 and "AUTH failed" in io.stats.last_error
    assert queries.auth_errors >= 1 and errors
    _no_secret(stats, str(err.value), *errors, caplog.text,
               *(r.getMessage() for r in caplog.records))


def test_the_store_redacts_what_redis_py_reports(caplog):
    server = FakeResp(_echo_auth)
    caplog.set_level(logging.DEBUG)
    cfg = remote_cfg(url=server.url, username="kvtier", password_env="X")
    store = RemoteStore(cfg, RemoteKeys("ns", "geo"), secrets=_secrets())
    try:
        assert store.run(store.probe()) is False
        store.note_error(f"echoed: {PASSWORD} {MAC_HEX}")
        stats = store.stats().to_dict()
    finally:
        store.close()
        server.close()
    assert stats["errors"] == 1
    _no_secret(json.dumps(stats), store.health.last_error, caplog.text)


def test_the_io_processes_carry_no_secret_on_their_command_lines_or_in_stats(tmp_path, capfd):
    from support.remote_processes import open_io, remote_cfg as proc_cfg

    server = FakeResp(_echo_auth)
    cfg = proc_cfg(tmp_path, url=server.url, username="kvtier", password_env="X")
    pool, io = open_io(cfg, secrets=_secrets())
    try:
        io.warm_up()
        cmdlines = []
        for child in io._children:
            if child.proc is not None:
                with open(f"/proc/{child.proc.pid}/cmdline", "rb") as f:
                    cmdlines.append(f.read().decode(errors="replace"))
        assert cmdlines
        io.fetch_slots([b"a" * 8] * 16, list(range(16)))
        stats = io.stats()
    finally:
        io.close()
        server.close()
    assert stats.auth_errors >= 1 and "AUTH failed" in stats.last_error
    out, err = capfd.readouterr()
    _no_secret(*cmdlines, json.dumps(stats.to_dict()), out, err)


# ---- replies too large to hold ----------------------------------------------------------------

def test_a_flood_of_array_entries_breaks_the_connection_not_the_memory():
    def flood(args, conn):
        conn.sendall(b"*100000000\r\n")  # announced: never allocated
        return b"*3\r\n:0\r\n:1\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n" * 1000

    server = FakeResp(flood)
    try:
        conn = RespConnection(Endpoint("127.0.0.1", server.port))
        with pytest.raises(ProtocolError):
            conn.call("CLUSTER", "SLOTS")
        assert conn.broken
    finally:
        server.close()


# ---- a slot map naming a node nobody configured ------------------------------------------------

@pytest.mark.parametrize("allowed", [False, True])
def test_an_unlisted_node_in_the_slot_map_gets_no_auth_and_no_value(allowed, caplog):
    stranger = FakeResp(lambda args, conn: b"+OK\r\n" if args[0] != b"GET" else b"$-1\r\n")

    def seed_answer(args, conn):
        if args[:2] == [b"CLUSTER", b"SLOTS"]:  # every slot on the stranger
            return (b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
                    % stranger.port)
        return b"+OK\r\n"

    seed = FakeResp(seed_answer)
    caplog.set_level(logging.WARNING)
    cfg = remote_cfg(nodes=[seed.node], username="kvtier", password_env="X",
                     allow_unlisted_nodes=allowed)
    io = RemoteBlockIO(cfg, RemoteKeys("ns", "geo"), _secrets(), Slots(4, BLOCK), BLOCK)
    queries = PresenceQueries(cfg, _secrets(), RemoteHealth(60.0))
    try:
        io.fetch([b"a", b"b"], [0, 1])
        io.put([2, 3], [b"c", b"d"])
        queries.count_present([[b"a"], [b"b"]])
    finally:
        io.close()
        queries.close()
        seed.close()
        stranger.close()
    if allowed:  # the operator said so: the test would see the traffic
        assert stranger.connections > 0
        return
    assert stranger.connections == 0 and stranger.commands == []
    assert io.stats.unlisted_refused == 4 and io.stats.puts == 0
    named = [r for r in caplog.records if "does not list" in r.getMessage()]
    assert len(named) == 1  # the directory's side logs it; the I/O side counts it
    _no_secret(caplog.text)
