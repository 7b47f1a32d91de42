"""A disk I/O child whose worker goes away (its instance exits, or is killed) ends quietly:
status 0 and nothing on stderr, however the socket ends (closed between frames, reset with a
reply left unread, closed inside a frame). A traceback per child at every instance exit is
what a user saw (issue 49)."""

from __future__ import annotations

import select
import socket
import subprocess
from dataclasses import asdict

import pytest

from kvtier.config.schema import DiskTierConfig
from kvtier.tiers.child import wire
from kvtier.tiers.child.process import CHILD_CWD, child_environment, isolated_command
from kvtier.tiers.disk.io.process import store_options
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                    dtype="uint8", model="peer-gone")
WAIT_S = 60  # a bound for a slow machine, never a measurement


def _start(tmp_path, connections: int = 2):
    """The child as ``DiskProcess`` starts it, with its stderr kept for the test."""
    pool = CpuBlockPool(GEO, 8, pin=False, shared=True)
    disk = DiskTierConfig(path=tmp_path / "disk", capacity=1 << 24)
    pairs = [socket.socketpair() for _ in range(connections)]
    spec = {"path": str(tmp_path / "disk"), "geometry": asdict(GEO), "num_slots": 8,
            "store": store_options(disk), "pool_fd": pool.shared_fd,
            "gil_switch_interval_ms": 0.0, "log_level": 30,
            "sockets": [theirs.fileno() for _, theirs in pairs]}
    proc = subprocess.Popen(isolated_command("kvtier.tiers.disk.io.server", spec),
                            pass_fds=[pool.shared_fd, *spec["sockets"]],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=CHILD_CWD,
                            env=child_environment())
    for _, theirs in pairs:
        theirs.close()
    return pool, proc, [mine for mine, _ in pairs]


def _wait_readable(sock: socket.socket) -> None:
    assert select.select([sock], [], [], WAIT_S)[0], "the child never answered"


def _ends_quietly(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=WAIT_S)
    assert "Traceback" not in err, err
    assert err.strip() == "", err
    assert proc.returncode == 0, err


def _reply_left_unread(socks):
    """The instance exits with the child's start-up reply still unread: closing a Unix socket
    with unread data resets it, so the child's next read fails with ECONNRESET."""
    _wait_readable(socks[0])


def _closed_between_frames(socks):
    wire.read_reply(socks[0])  # started; every connection idle


# a whole header and part of its payload: the worker died while writing the request
PART_OF_A_FETCH = wire.encode_request(wire.FETCH, [0], [b"k" * 32])[:-8]


def _closed_inside_a_frame(socks):
    wire.read_reply(socks[0])
    for s in socks:
        s.sendall(PART_OF_A_FETCH)


def _reset_inside_a_frame(socks):
    wire.read_reply(socks[0])
    socks[0].sendall(wire.encode_request(wire.STATS))
    _wait_readable(socks[0])  # its reply sits unread
    socks[0].sendall(PART_OF_A_FETCH)


@pytest.mark.parametrize("how", [_reply_left_unread, _closed_between_frames,
                                 _closed_inside_a_frame, _reset_inside_a_frame],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_child_exits_quietly_when_its_worker_goes_away(tmp_path, how):
    pool, proc, socks = _start(tmp_path)
    try:
        how(socks)
    finally:
        for s in socks:
            s.close()
    _ends_quietly(proc)


def test_a_worker_gone_before_the_child_started_ends_it_quietly(tmp_path):
    """Closed before the child could send its start-up reply: the child's send fails with a
    broken pipe (or its store opens after the worker left); still no traceback."""
    pool, proc, socks = _start(tmp_path)
    for s in socks:
        s.close()
    _ends_quietly(proc)
