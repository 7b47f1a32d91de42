"""The host tier's service: one process per host and model geometry, owning the pool's
memory and its index (:class:`HostDirectory`).

Each rank's pool is a sealed ``memfd`` (it cannot shrink or grow under a reader) that the
service creates on the first ``attach`` of that rank and hands to every worker over the
Unix socket (``SCM_RIGHTS``); the workers map and page-lock it once, at start-up, and their
GPU copies read and write it directly. Only slot ids and keys cross the socket. The socket
lives in a directory only the user (or the configured group) may enter, and the service
also checks each peer's credentials (``SO_PEERCRED``).

The service starts with the first instance (``client.connect_or_start``), or as
``kvtier host-tier serve``; it exits after ``idle_exit_s`` with no instance connected (its
pool's memory goes with it).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from kvtier.tiers.host import protocol
from kvtier.tiers.host.directory import HostDirectory, HostTierError, Reader

log = logging.getLogger("kvtier.host")

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class HostService:
    def __init__(self, socket_path: str, *, total_slots: int, fingerprint: str,
                 idle_exit_s: float | None = 600.0, group_gid: int | None = None) -> None:
        self.socket_path = socket_path
        self.fingerprint = fingerprint
        self.idle_exit_s = idle_exit_s
        self.group_gid = group_gid
        self.directory = HostDirectory(total_slots)
        self.pools: dict[int, tuple[int, int]] = {}  # rank -> (memfd, block bytes)
        self._lock = threading.Lock()
        self._clients = 0
        self._idle_since = time.monotonic()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------------ serving
    def bind(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(self.socket_path)  # a dead service's socket (the start lock is held)
        except FileNotFoundError:
            pass
        s.bind(self.socket_path)
        os.chmod(self.socket_path, 0o660 if self.group_gid is not None else 0o600)
        s.listen(64)
        self._listener = s

    def serve(self) -> None:
        """Accept instances until stopped or idle for ``idle_exit_s``."""
        if self._listener is None:
            self.bind()
        self._listener.settimeout(0.5)
        bound = os.stat(self.socket_path).st_ino  # ours to remove at the end (not a successor's)
        log.info("kvtier host tier: serving %d slots at %s (pid=%d)",
                 self.directory.total_slots, self.socket_path, os.getpid())
        try:
            while not self._stop.is_set():
                if self._idle():  # checked on every turn: a stream of looks does not defer it
                    log.info("kvtier host tier: no instance for %.0fs, exiting",
                             self.idle_exit_s)
                    return
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=self._serve_one, args=(conn,), daemon=True,
                                 name="kvtier-host-conn").start()
        finally:
            try:
                if os.stat(self.socket_path).st_ino == bound:
                    os.unlink(self.socket_path)
            except OSError:
                pass
            self._listener.close()

    def stop(self) -> None:
        self._stop.set()

    def _idle(self) -> bool:
        with self._lock:
            return (self.idle_exit_s is not None and self._clients == 0
                    and time.monotonic() - self._idle_since > self.idle_exit_s)

    def _allowed(self, conn: socket.socket) -> bool:
        _pid, uid, gid = protocol.peer_ids(conn)
        return uid == os.getuid() or (self.group_gid is not None and gid == self.group_gid)

    def _serve_one(self, conn: socket.socket) -> None:
        reader: Reader | None = None
        with conn:
            try:
                if not self._allowed(conn):
                    protocol.send(conn, {"ok": False, "error": "permission denied"})
                    return
                hello = protocol.read(conn)
                if hello is None:
                    return
                if hello.get("op") == "observe":  # an operator's look: stats only
                    protocol.send(conn, {"ok": True, "stats": self.describe()})
                    return
                reader = self._hello(conn, hello)
                if reader is None:
                    return
                while True:
                    msg = protocol.read(conn)
                    if msg is None:
                        return
                    self._handle(conn, reader, msg)
            except (OSError, protocol.HostProtocolError) as exc:
                log.warning("kvtier host tier: dropping a connection: %s", exc)
            finally:
                if reader is not None:
                    with self._lock:
                        self.directory.disconnect(reader)
                        self._clients -= 1
                        if self._clients == 0:
                            self._idle_since = time.monotonic()

    def _hello(self, conn: socket.socket, msg: dict[str, Any]) -> Reader | None:
        problem = None
        if msg.get("op") != "hello" or msg.get("version") != protocol.PROTOCOL_VERSION:
            problem = (f"expected hello, protocol {protocol.PROTOCOL_VERSION}; got "
                       f"{msg.get('op')!r}, protocol {msg.get('version')!r}")
        elif msg.get("fingerprint") != self.fingerprint:
            problem = (f"this host tier serves model geometry {self.fingerprint}, the instance "
                       f"has {msg.get('fingerprint')!r}")
        if problem is None:
            try:
                with self._lock:
                    reader = self.directory.connect(str(msg.get("instance", "")))
                    self._clients += 1
            except HostTierError as exc:
                problem = str(exc)
        if problem is not None:
            protocol.send(conn, {"ok": False, "error": problem})
            return None
        protocol.send(conn, {"ok": True, "total_slots": self.directory.total_slots})
        return reader

    def _handle(self, conn: socket.socket, reader: Reader, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        reply: dict[str, Any] = {"ok": True}
        fd = None
        try:
            with self._lock:
                d = self.directory
                if op == "find":
                    reply["held"] = d.find(msg["keys"])
                    if msg.get("touched"):
                        reply["touched"] = d.touched(reader)
                elif op == "acquire":
                    reply["slots"] = d.acquire(reader, msg["keys"])
                elif op == "release":
                    d.release(reader, msg["slots"])
                elif op == "publish":
                    d.publish(reader, msg["keys"], msg["slots"])
                elif op == "retire":
                    reply["busy"] = d.retire(reader, msg["keys"])
                elif op == "register":
                    reply["base"] = d.register(reader, int(msg["slots"]))
                elif op == "attach":
                    fd, block_bytes = self._pool(int(msg["rank"]), int(msg["block_bytes"]))
                    reply["block_bytes"] = block_bytes
                elif op == "stats":
                    reply["stats"] = self.describe()
                else:
                    raise HostTierError(f"unknown host tier request {op!r}")
        except (HostTierError, KeyError, TypeError, ValueError, OSError) as exc:
            if op in protocol.NO_REPLY:  # nobody waits for an answer: the log says it
                log.error("kvtier host tier: %s from %s failed: %s", op, reader.instance.name,
                          exc)
                return
            reply = {"ok": False, "error": str(exc) or type(exc).__name__}
            fd = None
        if op not in protocol.NO_REPLY:
            protocol.send(conn, reply, fd)

    def _pool(self, rank: int, block_bytes: int) -> tuple[int, int]:
        """The memfd of ``rank``'s pool (created at its first attach), and its block bytes."""
        have = self.pools.get(rank)
        if have is not None:
            if have[1] != block_bytes:
                raise HostTierError(f"rank {rank}'s pool holds blocks of {have[1]} bytes, the "
                                    f"instance's are {block_bytes}")
            return have
        if block_bytes <= 0:
            raise HostTierError(f"block bytes must be positive, got {block_bytes}")
        fd = os.memfd_create(f"kvtier-host-r{rank}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, self.directory.total_slots * block_bytes)  # pages come on first touch
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        self.pools[rank] = (fd, block_bytes)
        return self.pools[rank]

    def describe(self) -> dict[str, Any]:
        out = self.directory.describe()
        out["fingerprint"] = self.fingerprint
        out["pid"] = os.getpid()
        out["pool_bytes"] = {str(r): self.directory.total_slots * bb
                             for r, (_, bb) in self.pools.items()}
        out["block_bytes"] = {str(r): bb for r, (_, bb) in self.pools.items()}
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.tiers.host.service SPEC``: SPEC is JSON with ``socket``,
    ``total_slots``, ``fingerprint``, ``idle_exit_s`` and ``group_gid``."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[-1])  # (an isolated child's argv: its import path, then SPEC)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    service = HostService(spec["socket"], total_slots=int(spec["total_slots"]),
                          fingerprint=spec["fingerprint"], idle_exit_s=spec.get("idle_exit_s"),
                          group_gid=spec.get("group_gid"))
    service.bind()
    if spec.get("ready_fd") is not None:  # tell the starter the socket is bound
        os.write(int(spec["ready_fd"]), b"1")
        os.close(int(spec["ready_fd"]))
    service.serve()
    return 0


if __name__ == "__main__":  # pragma: no cover - started by client.start_service
    sys.exit(main())
