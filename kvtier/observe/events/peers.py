"""``PeerWatch``: the connections of one publisher socket, capped and dropped when they stall.

Why: ZMQ queues what a socket sends to each connected peer in the sending process (here vLLM's
scheduler) until the peer reads it, bounded only by a message count. A local client that
connects and never reads therefore pins memory there, and any number of them may connect. The
publisher bounds the bytes of each peer's queue (a message-count limit times a message-size
limit, see sender.py); this watch bounds the number of peers and takes back a stuck peer's
queue by closing its connection.

How: a ZMQ monitor reports each accepted connection with its file descriptor (recorded with the
socket's inode, so a descriptor number reused for another file is never acted on). Every
``CHECK_INTERVAL_S`` the kernel's unsent byte count of each connection (``TIOCOUTQ``) is read:
a peer whose unsent bytes stay above zero without ever going down for ``stall_s`` is not reading
(or reads slower than the stream) and is dropped - its connection is shut down, ZMQ frees its
queue, and the consumer, if it ever reads again, reconnects and fills the hole by replay or a
resync. A connection beyond ``max_peers`` is shut down at once. Both are counted; the first of
each kind is logged (once per publisher, so a client reconnecting in a loop cannot flood the
log). ``inproc`` peers have no descriptor and are not watched.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import termios
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("kvtier.observe.events.publisher")

CHECK_INTERVAL_S = 0.5
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass
class _Peer:
    inode: int
    unsent: int = 0  # at the last check
    stalled_since: float | None = None


@dataclass
class PeerCounts:
    connected: int = 0
    dropped: int = 0  # stalled: shut down
    refused: int = 0  # over the cap: shut down at once


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _unsent(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.TIOCOUTQ, buf, True)
    return buf[0]


def _shut_down(fd: int) -> None:
    """End the connection under ``fd`` (ZMQ's own descriptor: only shut down, never closed
    here; ZMQ sees the end, drops the peer's queue and closes it)."""
    dup = os.dup(fd)
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket after all
        os.close(dup)
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already ended
    finally:
        sock.close()


class PeerWatch:
    def __init__(self, sock: zmq.Socket, *, max_peers: int, stall_s: float, what: str) -> None:
        self.what = what  # "subscriber", "replay client": for the log
        self.max_peers = max_peers
        self.stall_s = stall_s
        self.counts = PeerCounts()
        self._sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self._peers: dict[int, _Peer] = {}
        self._next_check = 0.0
        self._logged: set[str] = set()

    def on_events(self) -> None:
        """Take the monitor's events (call when its socket is readable)."""
        while True:
            try:
                msg = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            fd, event = int(msg["value"]), msg["event"]
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif self._peers.pop(fd, None) is not None:
                self.counts.connected = len(self._peers)

    def _accepted(self, fd: int) -> None:
        inode = _inode(fd)
        if inode is None:
            return  # already gone
        if len(self._peers) >= self.max_peers:
            self.counts.refused += 1
            self._log_once("refused", "kvtier events: more than %d event %ss connected; "
                           "closing the new connection (events.max_subscribers; logged once)",
                           self.max_peers, self.what)
            _shut_down(fd)
            return
        self._peers[fd] = _Peer(inode)
        self.counts.connected = len(self._peers)

    def check(self, now: float | None = None) -> None:
        """Drop peers that stopped reading (at most every CHECK_INTERVAL_S)."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        for fd, peer in list(self._peers.items()):
            if _inode(fd) != peer.inode:  # closed (its event is on the way) or reused
                del self._peers[fd]
                continue
            try:
                unsent = _unsent(fd)
            except OSError:
                continue
            if unsent > 0 and unsent >= peer.unsent:
                peer.stalled_since = peer.stalled_since or now
            else:
                peer.stalled_since = None
            peer.unsent = unsent
            if peer.stalled_since is not None and now - peer.stalled_since >= self.stall_s:
                self.counts.dropped += 1
                self._log_once("dropped", "kvtier events: an event %s has not read for %.0f s "
                               "(%d bytes unsent); closing its connection so its queue is "
                               "freed (events.stall_timeout_s; logged once)", self.what,
                               self.stall_s, unsent)
                del self._peers[fd]
                _shut_down(fd)
        self.counts.connected = len(self._peers)

    def _log_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
