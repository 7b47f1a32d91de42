"""The frames between a kvtier instance and its host's host-tier service.

A frame is a little-endian u32 length and a msgpack map (msgspec: plain maps, lists, ints,
bytes and strings; nothing read is unpickled or evaluated). Every request carries ``op``;
every reply carries ``ok`` and, when false, ``error``. ``publish`` and ``release`` get no
reply (a scheduler step never waits for them); the others get exactly one, in order. The
``attach`` reply carries the rank's pool file descriptor (``SCM_RIGHTS``) with its frame.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20  # far above any real frame (a million keys); larger: a damaged stream
NO_REPLY = frozenset({"publish", "release"})

_LEN = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict)


class HostProtocolError(OSError):
    """The other side closed the connection or sent a frame that does not parse."""


def encode(message: dict[str, Any]) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int, first: bytes = b"") -> bytes:
    buf = bytearray(first)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HostProtocolError("the host tier connection closed")
        buf += chunk
    return bytes(buf)


def _decode(body: bytes) -> dict[str, Any]:
    try:
        message = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HostProtocolError(f"bad host tier frame: {exc}") from None
    return message


def read(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame; None when the other side closed between frames."""
    head = sock.recv(_LEN.size)
    if not head:
        return None
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, head))
    if n > MAX_FRAME:
        raise HostProtocolError(f"host tier frame of {n} bytes (at most {MAX_FRAME})")
    return _decode(_recv_exact(sock, n))


def read_with_fd(sock: socket.socket) -> tuple[dict[str, Any], int | None]:
    """A reply that may carry one file descriptor (``attach``)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
    if not data:
        raise HostProtocolError("the host tier connection closed")
    head = _recv_exact(sock, _LEN.size, data[:_LEN.size])
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise HostProtocolError(f"host tier frame of {n} bytes (at most {MAX_FRAME})")
    body = _recv_exact(sock, n, data[_LEN.size:])
    return _decode(body), (fds[0] if fds else None)


def send(sock: socket.socket, message: dict[str, Any], fd: int | None = None) -> None:
    frame = encode(message)
    if fd is None:
        sock.sendall(frame)
    else:
        sent = socket.send_fds(sock, [frame], [fd])
        if sent < len(frame):
            sock.sendall(frame[sent:])


def peer_ids(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
