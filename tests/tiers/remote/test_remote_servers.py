"""The test servers' start-up: a port taken by another process between ``free_port`` and the
server's bind (a CI failure: the client's handshake met a foreign listener's reply) leads to
another port, and a test never talks to a process that is not the server it started."""

from __future__ import annotations

import socket

import pytest

from support import valkey_servers as servers
from support.valkey_servers import PortTaken, Server


def _listener() -> socket.socket:
    """A foreign process's listening socket on a loopback port (not a Redis server)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_a_port_taken_before_the_server_binds_it_moves_to_another(tmp_path, monkeypatch):
    foreign = _listener()
    taken = foreign.getsockname()[1]
    real = servers.free_port
    ports = iter([taken])  # the first "free" port is taken by the time the server binds
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())
    server = Server(tmp_path)
    try:
        assert server.port != taken
        c = server.client()
        assert c.ping() and int(c.info("server")["process_id"]) == server.proc.pid
        assert "Address already in use" in (tmp_path / f"server-{taken}" / "server.log").read_text()
    finally:
        server.stop()
        foreign.close()


def test_an_explicit_port_that_is_taken_is_a_clear_error(tmp_path):
    foreign = _listener()
    try:
        with pytest.raises(PortTaken, match="did not start"):
            Server(tmp_path, port=foreign.getsockname()[1])
    finally:
        foreign.close()
