"""One blocking RESP2 connection to a Redis / Valkey node, built for large values.

Why not a general client here: a block's value is hundreds of KiB to MiBs, and a general client
(redis-py with hiredis included) reads each reply into a fresh ``bytes`` object that the tier
then verifies and copies into its CPU slot: two passes over every byte and an allocation per
value. This connection reads a GET's bulk reply straight into the caller's buffer (the CPU slot)
with ``recv_into``, and sends a SET's payload from the slot's memory with ``sendmsg``, so a
block crosses user space once in each direction. Commands are pipelined: a batch goes out in
one send, then its replies are read in order.

Every wait is bounded by the socket timeout. Anything that does not parse leaves the connection
unusable (``broken``): the caller drops it and opens a new one, so a damaged stream is never
resynchronised by guessing. Nothing read is unpickled or evaluated.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Sequence

from kvtier.tiers.remote.wire.redact import redact

READ_CHUNK = 16 << 10  # what a line read asks the kernel for: the start of a value that comes
# with it is copied twice, so this stays small; the rest of a value lands in place
MAX_LINE = 64 << 10  # a status, error or length line longer than this is a damaged stream
MAX_SMALL_BULK = 16 << 20  # a bulk reply read into memory (not into a slot) is capped
MAX_REPLY_ITEMS = 1 << 16  # elements of one (nested) array reply: a CLUSTER SLOTS of 16,384
# single-slot ranges fits; a server flooding entries breaks the connection instead of memory
MAX_REPLY_BYTES = 32 << 20  # bulk bytes of one array reply, all elements together
MAX_REPLY_DEPTH = 8  # arrays in arrays (CLUSTER SLOTS nests three deep)
JOIN_BELOW = 4 << 10  # command pieces smaller than this are joined before sending (a pipeline
# of thousands of small commands in one buffer); larger ones (values) go out from where they are
TLS_JOIN_BELOW = 64 << 10  # over TLS (no sendmsg) pieces up to this are joined into one write
Buffers = Sequence[bytes | bytearray | memoryview]


class RespError(Exception):
    """An error reply from the server (``-ERR ...``, ``-OOM ...``, ``-MOVED ...``)."""

    @property
    def moved(self) -> bool:
        return str(self).startswith(("MOVED ", "ASK "))


class ProtocolError(ConnectionError):
    """The byte stream does not parse as RESP: the connection cannot be used any more."""


class AuthFailed(RespError, ConnectionError):
    """The server refused the connection's AUTH (wrong user or password, or no ACLs): the
    connection is unusable, like a refused connect."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect: a node address, credentials and TLS."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    connect_timeout_s: float = 0.5
    timeout_s: float = 0.5

    def secret_words(self) -> list[str]:
        """What a server's error text must never carry on (see :mod:`.redact`)."""
        if not self.password:
            return []
        return [self.password, f"{self.username} {self.password}",
                f"'{self.username}' '{self.password}'"]


def _command(*parts: bytes | bytearray | memoryview) -> list[bytes | bytearray | memoryview]:
    """The RESP array of ``parts``, as buffers ready for ``sendmsg`` (payloads not copied)."""
    out: list[bytes | bytearray | memoryview] = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n" % memoryview(p).nbytes)
        out.append(p)
        out.append(b"\r\n")
    return out


def command(*parts: bytes | str | int) -> list[bytes | bytearray | memoryview]:
    """A small command (names, keys, numbers) as buffers."""
    return _command(*(p if isinstance(p, (bytes, bytearray, memoryview)) else str(p).encode()
                      for p in parts))


def command_with_value(head: Sequence[bytes], value: Buffers) -> list:
    """A command whose last argument is ``value``, given as several buffers (a record's header
    and key, the payload in the CPU slot, a tag): nothing is joined or copied."""
    size = sum(memoryview(v).nbytes for v in value)
    out: list = [b"*%d\r\n" % (len(head) + 1)]
    for p in head:
        out += [b"$%d\r\n" % len(p), p, b"\r\n"]
    out.append(b"$%d\r\n" % size)
    out += list(value)
    out.append(b"\r\n")
    return out


def key_commands(name: bytes, keys: Sequence[bytes]) -> bytes:
    """One ``name key`` command per key, as the RESP bytes of the whole pipeline: thousands
    of small commands built as one buffer, not a list of buffers each."""
    head = b"*2\r\n$%d\r\n%s\r\n" % (len(name), name)
    return b"".join(head + b"$%d\r\n%s\r\n" % (len(k), k) for k in keys)


def _joined_small(parts: Sequence[bytes | bytearray | memoryview],
                  below: int = JOIN_BELOW) -> list[memoryview]:
    """``parts`` as byte views to send, runs of pieces under ``below`` bytes joined."""
    out: list[memoryview] = []
    run: list = []
    for p in parts:
        v = memoryview(p)
        if v.nbytes < below:
            run.append(v)
            continue
        if run:
            out.append(memoryview(b"".join(run)))
            run = []
        out.append(v.cast("B"))
    if run:
        out.append(memoryview(b"".join(run)))
    return out


class DeadlinePassed(TimeoutError):
    """A read went past the connection's ``deadline`` (a server answering too slowly)."""


class RespConnection:
    def __init__(self, endpoint: Endpoint, deadline: float | None = None) -> None:
        self.endpoint = endpoint
        self.broken = False
        # monotonic time by which every read must be done (None: only the socket timeout);
        # a server that drips its reply a byte per timeout_s cannot hold a caller past it
        self.deadline = deadline
        sock = socket.create_connection((endpoint.host, endpoint.port),
                                        timeout=self._wait(endpoint.connect_timeout_s))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
            sock.settimeout(self._wait(endpoint.timeout_s))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._secrets = endpoint.secret_words()
        self._buf = bytearray(READ_CHUNK + MAX_LINE)  # a line can span a compaction
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        if endpoint.password is not None:
            args = ["AUTH"] + ([endpoint.username] if endpoint.username else []) + [endpoint.password]
            try:
                self.send([command(*args)])
                self.read_reply()
            except RespError as exc:  # refused: the text is redacted already
                self.close()
                raise AuthFailed(str(exc)) from None
            except BaseException:
                self.close()
                raise

    def _wait(self, timeout_s: float) -> float:
        """``timeout_s``, or less when the deadline is nearer; DeadlinePassed once past it."""
        if self.deadline is None:
            return timeout_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.broken = True
            raise DeadlinePassed("no complete reply before the deadline")
        return min(timeout_s, left)

    def _recv_into(self, view: memoryview) -> int:
        if self.deadline is not None:
            self.sock.settimeout(self._wait(self.endpoint.timeout_s))
        return self.sock.recv_into(view)

    def set_deadline(self, deadline: float | None) -> None:
        self.deadline = deadline
        if deadline is None and not self.broken:
            self.sock.settimeout(self.endpoint.timeout_s)

    # ---- sending ------------------------------------------------------------------------
    def send(self, commands: Sequence[Sequence[bytes | bytearray | memoryview]]) -> None:
        """Send a pipeline of commands; values (large pieces) are sent from their own buffers,
        never joined or copied."""
        parts = [p for c in commands for p in c]
        try:
            if isinstance(self.sock, ssl.SSLSocket):  # no sendmsg: small pieces joined
                self._send_tls(parts)
                return
            views = _joined_small(parts)
            i = 0
            while i < len(views):
                sent = self.sock.sendmsg(views[i:i + 512])
                while sent and i < len(views):
                    n = views[i].nbytes
                    if sent >= n:
                        sent -= n
                        i += 1
                    else:
                        views[i] = views[i][sent:]
                        sent = 0
        except BaseException:
            self.broken = True
            raise

    def _send_tls(self, parts: list) -> None:
        for view in _joined_small(parts, TLS_JOIN_BELOW):
            self.sock.sendall(view)

    # ---- receiving ----------------------------------------------------------------------
    def _fill(self) -> None:
        """Read more bytes after ``_end`` (compacting the buffer first when needed)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < READ_CHUNK:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        got = self._recv_into(self._view[self._end:self._end + READ_CHUNK])
        if got == 0:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise ProtocolError("a reply line longer than the protocol allows")
            self._fill()

    def _read_into(self, out: memoryview) -> None:
        """Fill ``out`` with the next ``len(out)`` bytes: buffered ones first, then straight
        from the socket into ``out``."""
        n = out.nbytes
        have = min(n, self._end - self._start)
        if have:
            out[:have] = self._view[self._start:self._start + have]
            self._start += have
        got = have
        while got < n:
            k = self._recv_into(out[got:])
            if k == 0:
                raise ConnectionError("the server closed the connection mid-value")
            got += k

    def _crlf(self) -> None:
        end = bytearray(2)
        self._read_into(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError("a bulk reply not ended by CRLF")

    def _head(self) -> tuple[bytes, bytes]:
        line = self._line()
        if not line:
            raise ProtocolError("an empty reply line")
        return line[:1], line[1:]

    def _error(self, text: bytes) -> RespError:
        """An error reply as an exception whose text is safe to log: a server may echo the
        command it refuses, AUTH's password included."""
        return RespError(redact(text.decode("utf-8", "replace"), self._secrets))

    def read_reply(self) -> object:
        """The next reply as Python data (status str, int, bytes, None, list); an error reply
        raises ``RespError``. Bulk replies here are small (capped), and so are arrays: their
        elements and bytes together (``MAX_REPLY_*``). Values go through
        :meth:`read_value_into`."""
        try:
            return self._reply([MAX_REPLY_ITEMS, MAX_REPLY_BYTES], 0)
        except RespError:
            raise
        except BaseException:
            self.broken = True
            raise

    def _reply(self, budget: list[int], depth: int) -> object:
        """One reply; ``budget``: the elements and bulk bytes the whole reply may still use."""
        kind, rest = self._head()
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            raise self._error(rest)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if n > min(MAX_SMALL_BULK, budget[1]):
                raise ProtocolError(f"a {n}-byte reply where a small one was expected")
            budget[1] -= n
            out = bytearray(n)
            self._read_into(memoryview(out))
            self._crlf()
            return bytes(out)
        if kind == b"*":
            n = int(rest)
            if n < 0:
                return None
            budget[0] -= n
            if budget[0] < 0 or depth >= MAX_REPLY_DEPTH:
                raise ProtocolError("an array reply larger or deeper than the tier expects")
            return [self._reply(budget, depth + 1) for _ in range(n)]
        raise ProtocolError(f"unknown reply type {kind!r}")

    def read_integers(self, n: int) -> list[int | RespError]:
        """The next ``n`` replies, each an integer or an error reply (returned, not raised:
        the stream stays in step). A pipeline of thousands of EXISTS is answered with one
        parse per buffer read, not a call chain per reply; any other reply type is a
        ``ProtocolError``."""
        out: list[int | RespError] = []
        try:
            while len(out) < n:
                last = self._buf.rfind(b"\r\n", self._start, self._end)
                if last < 0:
                    if self._end - self._start > MAX_LINE:
                        raise ProtocolError("a reply line longer than the protocol allows")
                    self._fill()
                    continue
                lines = bytes(self._buf[self._start:last]).split(b"\r\n")
                lines = lines[:n - len(out)]
                for line in lines:
                    if line[:1] == b":":
                        out.append(int(line[1:]))
                    elif line[:1] == b"-":
                        out.append(self._error(line[1:]))
                    else:
                        raise ProtocolError(f"an integer reply expected, got {line[:1]!r}")
                self._start += sum(len(line) + 2 for line in lines)
            return out
        except BaseException:
            self.broken = True
            raise

    def read_value_into(self, parts: Sequence[memoryview], max_other: int) -> int | bytes | None:
        """Read one GET reply. A value of exactly the summed size of ``parts`` is scattered
        into them in order (header, CPU slot, tag...) and its size returned; an absent key
        returns None. A value of another size up to ``max_other`` bytes is returned as bytes
        (a compressed record, or one that will fail verification); a larger one breaks the
        connection rather than be read (a cap on what a value may cost). An error reply
        raises ``RespError``."""
        try:
            kind, rest = self._head()
            if kind == b"-":
                raise self._error(rest)
            if kind != b"$":
                raise ProtocolError(f"a GET answered with type {kind!r}")
            n = int(rest)
            if n < 0:
                return None
            if n == sum(p.nbytes for p in parts):
                for p in parts:
                    self._read_into(p)
            elif n <= max_other:
                other = bytearray(n)
                self._read_into(memoryview(other))
                self._crlf()
                return bytes(other)
            else:
                self.broken = True  # not read: the stream is given up with the connection
                raise ProtocolError(f"a {n}-byte value, over the {max_other}-byte cap")
            self._crlf()
            return n
        except RespError:
            raise
        except BaseException:
            self.broken = True
            raise

    def call(self, *parts: bytes | str | int) -> object:
        """One small command and its reply."""
        self.send([command(*parts)])
        return self.read_reply()

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass
