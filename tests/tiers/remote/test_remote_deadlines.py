"""Issue 48: a slow server costs a lookup at most ``lookup_deadline_s``, and a hung I/O process
a load at most a few seconds beyond what its bytes should take.

Before, a server that dripped its EXISTS reply a byte per socket timeout kept lookups pending
for as long as it dripped, and a stopped I/O process held a load for about a second per block.
"""

from __future__ import annotations

import os
import signal
import time

from kvtier.tiers.remote.io.process import DEADLINE_BASE_S, DEADLINE_SPEED_FLOOR
from kvtier.tiers.remote import RemoteKeys, RemoteStore
from kvtier.tiers.remote.directory import RemoteDirectory
from kvtier.tiers.remote.exists import PresenceQueries
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.secrets import RemoteSecrets
from support.fake_resp import FakeResp
from support.remote_blocks import remote_cfg
from support.stopped import stop
from support.valkey_fixtures import valkey  # noqa: F401 - a pytest fixture


def _drip(args, conn):
    """Answers every EXISTS with 1, one byte at a time, each within the socket timeout."""
    if args[0].upper() == b"EXISTS":
        for byte in b":1\r\n":
            time.sleep(0.15)
            conn.sendall(bytes([byte]))
        return None
    return b"+OK\r\n"


def test_a_dripping_reply_is_a_miss_at_the_lookup_deadline():
    server = FakeResp(_drip)
    try:
        slow = PresenceQueries(remote_cfg(url=server.url, timeout_s=0.5,
                                          lookup_deadline_s=0.2),
                               RemoteSecrets(), RemoteHealth(60.0))
        patient = PresenceQueries(remote_cfg(url=server.url, timeout_s=0.5,
                                             lookup_deadline_s=1.0),
                                  RemoteSecrets(), RemoteHealth(60.0))
        try:
            assert slow.count_present([[b"k"]]) == [None]  # cut off mid-reply
            assert patient.count_present([[b"k"]]) == [1]  # the same drip, within its deadline
        finally:
            slow.close()
            patient.close()
    finally:
        server.close()


def test_a_lookup_pending_past_the_deadline_reads_absent(valkey):
    """Whatever the asker is stuck on (here a paused server), a key asked more than
    ``lookup_deadline_s`` ago is answered "absent": the request recomputes, it never waits
    longer. The directory's clock is the test's."""
    server = valkey()
    cfg = remote_cfg(url=server.url, timeout_s=5.0, lookup_deadline_s=0.5)
    now = [100.0]
    store = RemoteStore(cfg, RemoteKeys("ns-deadline", "geo"))
    directory = RemoteDirectory(store, clock=lambda: now[0])
    server.pause()
    try:
        assert directory.query([b"a"]) == [None]
        now[0] += 0.4
        assert directory.query([b"a"]) == [None]  # still within the deadline
        now[0] += 0.2
        assert directory.query([b"a", b"a"]) == [False, False]
        assert directory.late_answers == 2
    finally:
        server.resume()
        directory.close()
        store.close()


def test_a_stopped_io_process_is_replaced_within_its_byte_budget(tmp_path, valkey):
    from support.remote_processes import BLOCK, fill, keys_of, open_io, remote_cfg as proc_cfg

    server = valkey()
    cfg = proc_cfg(tmp_path, url=server.url, timeout_s=5.0, retries=2)
    pool, io = open_io(cfg, respawn_after_s=0.2)
    try:
        assert io.warm_up() == 2
        fill(pool, range(16))
        assert all(io.put_slots(list(range(16)), keys_of(16)))
        # the old budget: ~one socket timeout per try and block, here over 250 s
        assert io._deadline_s(16) <= DEADLINE_BASE_S + 2 * 16 * BLOCK / DEADLINE_SPEED_FLOOR
        stopped = io._children[0].proc.pid
        stop(stopped)
        try:
            r = io.fetch_slots(keys_of(16), list(range(16, 32)))
        finally:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:  # killed as hung: what the test wants
                pass
        assert r.failed and set(r.failed) == set(r.transient)  # recomputed, never wrong
        assert io._children[0].proc is None or io._children[0].proc.pid != stopped
    finally:
        io.close()
