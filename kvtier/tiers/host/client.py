"""An instance's connection to its host's host-tier service, starting the service if none runs.

One service per user (or group), host and model geometry: its socket is
``<dir>/<fingerprint>.sock`` in a directory that must belong to this user and let nobody
else in (``0700``; ``0770`` with a group). Two instances starting at once do not start two
services: the start holds ``<fingerprint>.lock`` (``flock``) while it looks for a running
one and, finding none, starts one and waits for its socket.

Every call is a blocking round trip on the caller's thread except ``publish`` and
``release``, which nobody waits for; an answer later than ``REQUEST_TIMEOUT_S`` ends the
connection (a stuck service never holds vLLM's scheduler longer). A call that fails (the
service died or is stuck, a bad reply) raises :class:`HostTierUnavailable`; the manager then
goes on with its own region alone.
"""

from __future__ import annotations

import fcntl
import grp
import os
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvtier.tiers.child.process import CHILD_CWD, child_environment, isolated_command
from kvtier.tiers.host import protocol

START_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 5.0  # a service slower than this is stuck: the instance goes on alone


class HostTierUnavailable(OSError):
    """The host tier's service cannot be reached, or refused the request (the message says
    which and why)."""


@dataclass(frozen=True)
class HostAddress:
    """Where an instance finds its host tier, and what it starts if none runs."""

    directory: Path
    fingerprint: str  # model geometry (rank 0's): one service per geometry
    total_slots: int  # the pool's slots (tiers.host.capacity / block bytes)
    idle_exit_s: float | None = 600.0
    group: str | None = None

    @classmethod
    def from_config(cls, host, fingerprint: str, block_bytes: int) -> "HostAddress":
        """From ``tiers.host`` (a ``HostTierConfig``) and the instance's rank-0 geometry."""
        return cls(host.dir, fingerprint, host.capacity // block_bytes,
                   host.idle_exit_s or None, host.group)

    @property
    def socket_path(self) -> Path:
        return self.directory / f"{self.fingerprint[:24]}.sock"

    @property
    def group_gid(self) -> int | None:
        if self.group is None:
            return None
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise HostTierUnavailable(f"tiers.host.group: no group named {self.group!r} on "
                                      "this host") from None


def secure_directory(address: HostAddress) -> Path:
    """Create the host tier's directory (``0700``, ``0770`` with a group) or check the one
    there: a directory another user owns, a link, or one others may enter is refused."""
    d = address.directory
    gid = address.group_gid
    mode = 0o770 if gid is not None else 0o700
    try:
        d.mkdir(mode=mode, parents=True)
        if gid is not None:
            os.chown(d, -1, gid)
            os.chmod(d, mode)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise HostTierUnavailable(f"tiers.host.dir {d} is not a directory (a link or a file)")
    if st.st_uid != os.getuid():
        raise HostTierUnavailable(f"tiers.host.dir {d} belongs to uid {st.st_uid}, not this "
                                  f"user ({os.getuid()}): its pool would not be yours")
    if st.st_mode & 0o007 or (gid is None and st.st_mode & 0o070):
        raise HostTierUnavailable(
            f"tiers.host.dir {d} has mode {stat.S_IMODE(st.st_mode):o}: other users could "
            f"reach the pool; chmod it {mode:o}" + ("" if gid is not None else
                                                   " (or set tiers.host.group)"))
    return d


class HostClient:
    def __init__(self, sock: socket.socket, total_slots: int,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        sock.settimeout(timeout_s)
        self._sock = sock
        self.total_slots = total_slots
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, address: HostAddress, instance: str, *, start: bool = True,
                timeout_s: float = REQUEST_TIMEOUT_S) -> "HostClient":
        """Say hello to the running service (``start``: starting one if none runs). Every
        request after it waits at most ``timeout_s`` for its answer."""
        secure_directory(address)
        sock = _try_connect(address.socket_path)
        if sock is None and start:
            sock = _start_service(address)
        if sock is None:
            raise HostTierUnavailable(f"no host tier service at {address.socket_path}")
        sock.settimeout(timeout_s)
        try:
            protocol.send(sock, {"op": "hello", "version": protocol.PROTOCOL_VERSION,
                                 "fingerprint": address.fingerprint, "instance": instance})
            reply = protocol.read(sock)
        except OSError as exc:
            sock.close()
            raise HostTierUnavailable(f"host tier at {address.socket_path}: {exc}") from None
        if reply is None or not reply.get("ok"):
            sock.close()
            why = "closed the connection" if reply is None else reply.get("error")
            raise HostTierUnavailable(f"host tier at {address.socket_path} refused this "
                                      f"instance: {why}")
        return cls(sock, int(reply["total_slots"]), timeout_s)

    def close(self) -> None:
        self._sock.close()

    # ------------------------------------------------------------------ requests
    def _call(self, message: dict[str, Any], with_fd: bool = False) -> Any:
        op = message["op"]
        try:
            with self._lock:
                protocol.send(self._sock, message)
                if op in protocol.NO_REPLY:
                    return None
                if with_fd:
                    reply, fd = protocol.read_with_fd(self._sock)
                else:
                    reply, fd = protocol.read(self._sock), None
        except OSError as exc:
            # a late answer would be read as the next request's: this connection is done
            self._sock.close()
            raise HostTierUnavailable(f"host tier {op}: {exc or type(exc).__name__}") from None
        if reply is None:
            raise HostTierUnavailable(f"host tier {op}: the service closed the connection")
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            raise HostTierUnavailable(f"host tier {op}: {reply.get('error')}")
        return (reply, fd) if with_fd else reply

    def register(self, slots: int) -> int:
        """This instance's region of ``slots``: its first slot."""
        return int(self._call({"op": "register", "slots": slots})["base"])

    def attach(self, rank: int, block_bytes: int) -> int:
        """The file descriptor of ``rank``'s pool (this process owns it: close it)."""
        reply, fd = self._call({"op": "attach", "rank": rank, "block_bytes": block_bytes},
                               with_fd=True)
        if fd is None:
            raise HostTierUnavailable("host tier attach: the reply carried no pool")
        return fd

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call({"op": "find", "keys": list(keys)})["held"])

    def find_and_touched(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bytes]]:
        """``find``, and this instance's blocks other instances read since it last asked."""
        reply = self._call({"op": "find", "keys": list(keys), "touched": True})
        return list(reply["held"]), list(reply.get("touched", ()))

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        return list(self._call({"op": "acquire", "keys": list(keys)})["slots"])

    def release(self, slots: Sequence[int]) -> None:
        self._call({"op": "release", "slots": list(slots)})

    def publish(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self._call({"op": "publish", "keys": list(keys), "slots": list(slots)})

    def retire(self, keys: Sequence[bytes]) -> list[bytes]:
        return list(self._call({"op": "retire", "keys": list(keys)})["busy"])

    def flush(self) -> None:
        """Return once the service applied every ``publish`` and ``release`` sent before
        (they get no reply; requests on one connection are applied in order)."""
        self.find(())

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})["stats"]


def observe(socket_path: Path) -> dict[str, Any]:
    """The stats of the service at ``socket_path`` (``kvtier host-tier``): an operator's
    look, which is not an instance and holds nothing."""
    sock = _try_connect(socket_path)
    if sock is None:
        raise HostTierUnavailable(f"no host tier service at {socket_path}")
    with sock:
        try:
            protocol.send(sock, {"op": "observe", "version": protocol.PROTOCOL_VERSION})
            reply = protocol.read(sock)
        except OSError as exc:
            raise HostTierUnavailable(f"host tier at {socket_path}: {exc}") from None
    if reply is None or not reply.get("ok"):
        raise HostTierUnavailable(f"host tier at {socket_path} refused: "
                                  f"{'closed' if reply is None else reply.get('error')}")
    return reply["stats"]


def _try_connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
        return None
    return s


def _start_service(address: HostAddress) -> socket.socket:
    """Start the service (unless another instance just did) and connect to it."""
    lock_path = address.directory / f"{address.fingerprint[:24]}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _try_connect(address.socket_path)  # started while we waited for the lock
        if sock is not None:
            return sock
        r, w = os.pipe()
        spec = {"socket": str(address.socket_path), "total_slots": address.total_slots,
                "fingerprint": address.fingerprint, "idle_exit_s": address.idle_exit_s,
                "group_gid": address.group_gid, "ready_fd": w}
        log_path = address.directory / f"{address.fingerprint[:24]}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                isolated_command("kvtier.tiers.host.service", spec), pass_fds=[w],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=CHILD_CWD,
                env=child_environment(), start_new_session=True)
        os.close(w)
        try:
            ready = _read_ready(r, proc)
        finally:
            os.close(r)
        if not ready:
            raise HostTierUnavailable(f"the host tier service did not start (exit status "
                                      f"{proc.poll()}); its log: {log_path}")
        sock = _try_connect(address.socket_path)
        if sock is None:
            raise HostTierUnavailable(f"the host tier service started but {address.socket_path} "
                                      f"takes no connection; its log: {log_path}")
        return sock


def _read_ready(fd: int, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    os.set_blocking(fd, False)
    while time.monotonic() < deadline:
        try:
            if os.read(fd, 1):
                return True
        except BlockingIOError:
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False

