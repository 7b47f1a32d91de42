"""The disk tier served by a separate process, so write-back does not tax vLLM's engine thread.

Why: a write-back thread in the worker costs the engine loop GIL time for every block (record
encoding, checksum, index entries) plus a GIL hand-off after every system call, slowing every
request served meanwhile. A writer process shares no GIL with the engine loop (figures:
docs/design-measurements.md).

How: the CPU pool lives in a memfd (``CpuBlockPool(shared=True)``) that the child maps too, so
only slot ids and keys cross a Unix socket. The child owns the store (directory lock, LMDB
index, segments); each request is one round trip on one of a few connections.

Failures: a store the child cannot open raises here what ``DiskStore`` would (busy, layout
mismatch, unreadable index ...). If the child dies, writes raise ``DiskWriteError`` (failed
writes to the manager) and reads are transient misses: the engine recomputes, nothing wrong
is ever loaded. The first call ``respawn_after_s`` after the loss starts a new child on the
same directory and pool (the kernel released the dead one's lock; indexed records are
checksummed as after any restart; a record still being written was never indexed, so it reads
as a miss). A replacement that fails to start waits twice as long, up to ``RESPAWN_MAX_S``.

Hangs: every request has a deadline (``tiers.disk.request_timeout_s`` per started
``DEADLINE_BYTES`` of blocks it moves; the start-up key listing gets ``START_TIMEOUT_S``). A
child that misses it (stopped, stuck in the kernel on a dead disk ...) is declared lost as if
it had died: it is killed, so its other requests fail at once too, and replaced as above."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import socket
import subprocess
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterable, Sequence

from kvtier.config.schema import DiskTierConfig
from kvtier.tiers.child import wire
from kvtier.tiers.child.process import CHILD_CWD, child_environment, isolated_command
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import DiskStats, errors
from kvtier.tiers.layout import BlockGeometry

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # opening a large store checks its index and segments
RESPAWN_AFTER_S = 5.0  # a lost child is replaced by the first call this long after the loss
RESPAWN_MAX_S = 60.0  # backoff cap between failed replacements
# a request moving more block bytes than this gets one more request_timeout_s per started share
DEADLINE_BYTES = 256 << 20
_RAISED_AS_IS = {c.__name__: c for c in (
    errors.DiskLayoutMismatch, errors.NotADiskStore, errors.UnsafeDiskDirectory,
    errors.DiskStoreBusy, errors.DiskIndexUnreadable, errors.DiskFull)}


def store_options(disk: DiskTierConfig) -> dict:
    """``DiskStore``'s keyword arguments from the config: the same in this process and in
    the child."""
    return {"compression": disk.compression, "zstd_level": disk.zstd_level,
            "fsync": disk.fsync, "segment_bytes": disk.segment_bytes}


class DiskProcessGone(errors.DiskWriteError):
    """The disk I/O process exited or its connection broke: no more disk reads or writes."""


def _exception(payload: memoryview) -> Exception:
    """The child's exception as this process raises it."""
    try:
        info = json.loads(bytes(payload))
        name, code, message = str(info["type"]), info.get("errno"), str(info["message"])
    except (ValueError, KeyError, TypeError):
        return errors.DiskWriteError(errno.EPROTO, "kvtier disk process: unreadable error reply")
    if name in _RAISED_AS_IS:
        return _RAISED_AS_IS[name](message)
    if name in ("ValueError", "IndexError"):
        return ValueError(message)
    return errors.DiskWriteError(code if isinstance(code, int) else None,
                                 f"kvtier disk process: {name}: {message}")


class DiskProcess:
    """A worker's disk tier in a child process; implements ``SlotDisk`` for the handlers."""

    def __init__(self, pool: CpuBlockPool, disk: DiskTierConfig, geometry: BlockGeometry, *,
                 gil_switch_interval_ms: float = 0.0, connections: int = 8,
                 start_timeout: float = START_TIMEOUT_S,
                 respawn_after_s: float | None = RESPAWN_AFTER_S) -> None:
        if pool.shared_fd is None:
            raise ValueError("the disk I/O process needs a shared CPU pool "
                             "(CpuBlockPool(shared=True))")
        if geometry.block_bytes != pool.geometry.block_bytes:
            raise ValueError(f"disk blocks of {geometry.block_bytes} B for CPU slots of "
                             f"{pool.geometry.block_bytes} B")
        self.root = Path(disk.path)
        self.geometry = geometry
        self._broken: str | None = None
        self._closed = False
        self._pool_fd = pool.shared_fd
        self._spec = {
            "path": os.path.abspath(self.root), "geometry": asdict(geometry),
            "num_slots": pool.num_slots,
            "store": store_options(disk), "pool_fd": pool.shared_fd,
            "gil_switch_interval_ms": gil_switch_interval_ms,
            "log_level": logging.getLogger("kvtier").getEffectiveLevel(),
        }
        self._connections = max(1, connections)
        self.request_timeout_s = disk.request_timeout_s
        self._start_timeout = start_timeout
        self.respawn_after_s = respawn_after_s  # None: a lost child stays lost
        self.respawns = 0  # children started to replace a lost one
        self._retry_at = 0.0  # monotonic time of the next replacement try
        self._backoff = respawn_after_s or 0.0
        self._respawn_lock = threading.Lock()
        self._free: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._gen = 0  # which child a connection belongs to (bumped by each replacement)
        self._sock_gen: dict[socket.socket, int] = {}
        self._spawn()
        log.info("kvtier: disk tier %s served by process %d", self.root, self.pid)

    def _spawn(self) -> None:
        """Start a child and connect to it (raises what the child's store raised)."""
        pairs = [socket.socketpair() for _ in range(self._connections)]
        spec = dict(self._spec, sockets=[b.fileno() for _, b in pairs])
        try:
            self._proc = subprocess.Popen(
                isolated_command("kvtier.tiers.disk.io.server", spec),
                pass_fds=[self._pool_fd, *spec["sockets"]], stdin=subprocess.DEVNULL,
                cwd=CHILD_CWD, env=child_environment())
        finally:
            for _, theirs in pairs:
                theirs.close()
        self.pid = self._proc.pid
        self._socks = [mine for mine, _ in pairs]
        self._started(self._start_timeout)
        for s in self._socks:
            self._sock_gen[s] = self._gen
            self._free.put(s)

    def _started(self, timeout: float) -> None:
        first = self._socks[0]
        first.settimeout(timeout)
        try:
            status, payload = wire.read_reply(first)
        except (OSError, socket.timeout) as exc:
            self._stop(kill=True)
            what = (f"did not answer within {timeout:g} s" if isinstance(exc, socket.timeout)
                    else f"exited with code {self._proc.returncode}")
            raise errors.DiskIndexUnreadable(
                f"kvtier: the disk I/O process for {self.root} {what} (its log is above)"
            ) from exc
        if status == wire.ERROR:
            self._stop(kill=False)
            raise _exception(payload)

    # -- requests ----------------------------------------------------------------------------
    def _call(self, op: int, slots: Sequence[int] = (), keys: Sequence[bytes] = ()
              ) -> memoryview:
        request = wire.encode_request(op, slots, keys)  # bad keys raise before anything is sent
        allowed = self.deadline_s(op, len(keys))
        if self._broken:
            self._maybe_respawn()
        while True:
            if self._broken:
                raise DiskProcessGone(errno.EPIPE, self._broken)
            sock = self._free.get()
            if self._sock_gen.get(sock) == self._gen:
                break
            if self._broken:  # a lost child's connection: wake the next waiter, fail
                self._free.put(sock)
                raise DiskProcessGone(errno.EPIPE, self._broken)
            self._sock_gen.pop(sock, None)  # left over from a replaced child: drop it
            sock.close()
        deadline = time.monotonic() + allowed
        try:
            sock.settimeout(allowed)  # sendall: the whole send within it (a full socket buffer)
            sock.sendall(request)
            status, payload = wire.read_reply(sock, deadline)
        except OSError as exc:  # TimeoutError included: a child past its deadline is lost
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"no answer to a request within {allowed:g} s, killed")
            self._lost(sock, exc)
            raise DiskProcessGone(errno.EPIPE, self._broken or str(exc)) from exc
        self._free.put(sock)
        if status == wire.ERROR:
            raise _exception(payload)
        return payload

    def deadline_s(self, op: int, n_keys: int) -> float:
        """Seconds a request may take: ``request_timeout_s`` per started ``DEADLINE_BYTES``
        of blocks it moves (at least one), so a large batch on a busy disk is not a hang. The
        key listing (once, at start-up, before any load: millions of keys on a large store)
        gets the start-up allowance instead."""
        if op == wire.KEYS:
            return max(self._start_timeout, self.request_timeout_s)
        moved = n_keys * self.geometry.block_bytes if op in (wire.PUT, wire.FETCH) else 0
        return self.request_timeout_s * max(1, -(-moved // DEADLINE_BYTES))

    def _lost(self, sock: socket.socket, exc: BaseException) -> None:
        sock.close()
        if self._sock_gen.get(sock) != self._gen:  # an earlier child's: already replaced
            self._sock_gen.pop(sock, None)
            return
        code = self._proc.poll()
        hung = isinstance(exc, TimeoutError)
        if hung and code is None:
            self._proc.kill()  # its other requests fail now, not at their own deadlines
        self._free.put(sock)  # a caller waiting for a connection gets it, fails, and says so
        if self._broken is None:
            after = self.respawn_after_s
            why = exc if hung or code is None else f"exit code {code}"
            self._broken = (f"kvtier disk tier: the disk I/O process {self.pid} for {self.root} "
                            f"is {'hung' if hung else 'gone'} ({why});"
                            " disk reads miss and writes fail "
                            + (f"until a new one starts (in {after:g} s)" if after is not None
                               else "from now on"))
            self._retry_at = time.monotonic() + (after or 0.0)
            self._backoff = after or 0.0
            log.error("%s", self._broken)

    def _maybe_respawn(self) -> None:
        """Replace a lost child once its wait is over (one caller does; the others fail)."""
        if (self._closed or self.respawn_after_s is None or time.monotonic() < self._retry_at
                or not self._respawn_lock.acquire(blocking=False)):
            return
        try:
            if not self._broken or self._closed:
                return
            if self._proc.poll() is None:  # connections broke but it lives: stop it first
                self._proc.kill()
            self._proc.wait()
            old = self.pid
            self._gen += 1
            try:
                self._spawn()
            except Exception as exc:  # noqa: BLE001 - the store may be gone too: try later
                self._backoff = min(max(2 * self._backoff, 0.1), RESPAWN_MAX_S)
                self._retry_at = time.monotonic() + self._backoff
                log.error("kvtier disk tier: replacing the disk I/O process for %s failed "
                          "(%s); next try in %g s", self.root, exc, self._backoff)
                return
            self.respawns += 1
            self._broken = None
            log.warning("kvtier disk tier: disk I/O process %d replaces %d for %s "
                        "(replacement %d)", self.pid, old, self.root, self.respawns)
        finally:
            self._respawn_lock.release()

    def put_slots(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self._call(wire.PUT, slots, keys)

    def fetch_slots(self, keys: Sequence[bytes], slots: Sequence[int]
                    ) -> tuple[list[int], list[int]]:
        try:
            return wire.decode_positions(self._call(wire.FETCH, slots, keys), len(keys))
        except DiskProcessGone:  # a miss that proves nothing about the records
            every = list(range(len(keys)))
            return every, list(every)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        payload = self._call(wire.DELETE, (), list(keys))
        try:
            return int(bytes(payload))
        except ValueError as exc:
            raise wire.WireError("bad delete reply") from exc

    def keys_by_age(self) -> list[bytes]:
        payload = self._call(wire.KEYS)
        if len(payload) < 8:
            raise wire.WireError("truncated key list reply")
        return wire.decode_keys(payload[8:], int.from_bytes(payload[:8], "little"))

    def stats(self) -> DiskStats:
        """The child's counters; while a lost child is being replaced, the last ones it
        gave (a report or a stats scrape must not fail because a child hung: issue 48)."""
        try:
            payload = self._call(wire.STATS)
        except DiskProcessGone:
            last = getattr(self, "_last_stats", None)
            if last is None:  # gone before its first answer: nothing counted yet
                last = DiskStats(**{f.name: 0 for f in fields(DiskStats)})
            return last
        try:
            self._last_stats = DiskStats(**json.loads(bytes(payload)))  # frozen: shared
        except (ValueError, TypeError) as exc:
            raise wire.WireError(f"bad stats reply: {exc}") from exc
        return self._last_stats

    # -- lifecycle ---------------------------------------------------------------------------
    def _stop(self, *, kill: bool, timeout: float = 30.0) -> None:
        for s in self._socks:
            s.close()  # the child's threads see EOF, it closes the store and exits
        if kill:
            self._proc.kill()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("kvtier: disk I/O process %d did not exit in %g s; killing it",
                      self.pid, timeout)
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._broken = f"kvtier disk tier: {self.root} is closed"
            with self._respawn_lock:  # a replacement starting now is stopped, not leaked
                self._stop(kill=False)
