"""A shared-tier I/O child whose worker goes away (its instance exits) ends quietly: status 0
and nothing on stderr, however the socket ends: before the start-up frame, reset with the
child's start-up reply unread (what every instance exit of examples/shared_tier.py did, one
traceback per child: issue 49), closed between frames, or inside one."""

from __future__ import annotations

import json
import select
import socket
import subprocess
from dataclasses import asdict

import pytest

pytest.importorskip("redis", reason="the shared tier needs kvtier's remote extra")

from kvtier.tiers.child import wire  # noqa: E402
from kvtier.tiers.child.process import (  # noqa: E402
    CHILD_CWD,
    child_environment,
    isolated_command,
)
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.remote.wire.connect import remote_keys  # noqa: E402
from kvtier.tiers.remote.secrets import RemoteSecrets  # noqa: E402
from support.remote_processes import SLOTS, geometry, remote_cfg  # noqa: E402
from support.valkey_fixtures import valkey  # noqa: E402,F401 - the fixture

WAIT_S = 60  # a bound for a slow machine, never a measurement
# a whole header and part of its payload: the worker died while writing the request
PART_OF_A_FETCH = wire.encode_request(wire.FETCH, [0], [b"k" * 32])[:-8]


def _start(tmp_path, url: str):
    """The child as ``RemoteIOProcesses`` starts it, with its stderr kept for the test."""
    cfg = remote_cfg(tmp_path, url=url)
    geo = geometry()
    pool = CpuBlockPool(geo, SLOTS, pin=False, shared=True)
    keys = remote_keys(cfg, geo)
    mine, theirs = socket.socketpair()
    spec = {"config": asdict(cfg), "num_slots": SLOTS, "block_bytes": geo.block_bytes,
            "pool_fd": pool.shared_fd, "socket": theirs.fileno(), "log_level": 30,
            "keys": {"namespace": keys.namespace, "rank": keys.rank,
                     "geometry_fingerprint": keys.fingerprint, "replicated": keys.replicated}}
    proc = subprocess.Popen(isolated_command("kvtier.tiers.remote.io.server", spec),
                            pass_fds=[pool.shared_fd, theirs.fileno()],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=CHILD_CWD,
                            env=child_environment())
    theirs.close()
    secrets = json.dumps(RemoteSecrets.load(cfg).to_wire()).encode()
    return pool, proc, mine, secrets


def _wait_readable(sock: socket.socket) -> None:
    assert select.select([sock], [], [], WAIT_S)[0], "the child never answered"


def _before_the_start_up_frame(sock, secrets):
    pass


def _start_up_reply_left_unread(sock, secrets):
    wire.send_reply(sock, secrets)
    _wait_readable(sock)  # closing with it unread resets the socket: ECONNRESET in the child


def _closed_between_frames(sock, secrets):
    wire.send_reply(sock, secrets)
    wire.read_reply(sock)


def _closed_inside_a_frame(sock, secrets):
    wire.send_reply(sock, secrets)
    wire.read_reply(sock)
    sock.sendall(PART_OF_A_FETCH)


def _reset_inside_a_frame(sock, secrets):
    wire.send_reply(sock, secrets)
    wire.read_reply(sock)
    sock.sendall(wire.encode_request(wire.STATS))
    _wait_readable(sock)  # its reply sits unread
    sock.sendall(PART_OF_A_FETCH)


@pytest.mark.parametrize("how", [_before_the_start_up_frame, _start_up_reply_left_unread,
                                 _closed_between_frames, _closed_inside_a_frame,
                                 _reset_inside_a_frame],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_child_exits_quietly_when_its_worker_goes_away(tmp_path, valkey, how):  # noqa: F811
    pool, proc, sock, secrets = _start(tmp_path, valkey().url)
    try:
        how(sock, secrets)
    finally:
        sock.close()
    _, err = proc.communicate(timeout=WAIT_S)
    assert "Traceback" not in err, err
    assert err.strip() == "", err
    assert proc.returncode == 0, err
