"""pytest fixtures: a standalone server and a 3-primary Cluster, torn down by PID."""

from __future__ import annotations

import pytest

from support.valkey_servers import Server, start_cluster


@pytest.fixture
def valkey(tmp_path):
    """``valkey(*args)``: a started standalone server (extra server args allowed)."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        started.append(Server(tmp_path, *args))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def cluster(tmp_path):
    nodes = start_cluster(tmp_path, 3)
    yield nodes
    for n in nodes:
        n.stop()
