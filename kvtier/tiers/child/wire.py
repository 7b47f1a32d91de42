"""The frames between a worker and its I/O processes (the disk tier's and the shared tier's).

Plain length-prefixed binary over a Unix socket pair: slot ids, keys, positions, and JSON for
stats and errors. Nothing read from the socket is unpickled or evaluated, and every length is
checked before it is used, so a damaged frame is a clear ``WireError``, never a wrong slot.

Request: ``op`` (u8), item count (u32), payload length (u64), payload. Reply: status (u8: OK
or ERROR), payload length (u64), payload; an ERROR payload is JSON ``{"type", "errno",
"message"}``. A request may get PART frames before its reply (the shared tier's fetches report
blocks already verified, so their copies to the GPU can start); the OK or ERROR frame ends it.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from array import array
from typing import Sequence

PUT, FETCH, DELETE, KEYS, STATS = 1, 2, 3, 4, 5
OPS = (PUT, FETCH, DELETE, KEYS, STATS)
OK, ERROR, PART = 0, 1, 2

_REQUEST = struct.Struct("<BIQ")
_REPLY = struct.Struct("<BQ")
_KEY_LEN = struct.Struct("<H")
_COUNTS = struct.Struct("<II")
MAX_PAYLOAD = 1 << 31  # far above any real frame; a larger length means a damaged stream


class WireError(OSError):
    """The other side closed the connection or sent a frame that does not parse."""


class ConnectionClosed(WireError, ConnectionError):
    """The other side closed its end (it exited). A ``ConnectionError`` like a reset or a
    broken pipe, so an I/O process treats all three alike: its worker is gone, it ends."""


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes; ``deadline`` (``time.monotonic()``): TimeoutError once it passes, however
    the bytes trickle in (a per-``recv`` timeout would restart with every byte)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionClosed("the disk I/O connection closed")
        got += k
    return buf


def encode_keys(keys: Sequence[bytes]) -> bytes:
    parts = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) > 0xFFFF:
            raise ValueError("disk keys must be bytes of at most 65535 bytes")
        parts.append(_KEY_LEN.pack(len(k)))
        parts.append(bytes(k))
    return b"".join(parts)


def decode_keys(data: memoryview, count: int) -> list[bytes]:
    keys, pos = [], 0
    for _ in range(count):
        if pos + 2 > len(data):
            raise WireError("truncated key list")
        (n,) = _KEY_LEN.unpack_from(data, pos)
        pos += 2
        if pos + n > len(data):
            raise WireError("truncated key")
        keys.append(bytes(data[pos:pos + n]))
        pos += n
    if pos != len(data):
        raise WireError(f"{len(data) - pos} stray bytes after {count} keys")
    return keys


def encode_request(op: int, slots: Sequence[int] = (), keys: Sequence[bytes] = ()) -> bytes:
    """``slots`` is empty or has one entry per key."""
    if slots and len(slots) != len(keys):
        raise ValueError(f"{len(keys)} disk keys for {len(slots)} CPU slots")
    payload = array("q", slots).tobytes() + encode_keys(keys)
    return _REQUEST.pack(op, len(keys), len(payload)) + payload


def read_request(sock: socket.socket) -> tuple[int, list[int], list[bytes]] | None:
    """(op, slots, keys), or None when the worker closed (or reset) the connection between
    frames; ``ConnectionError`` when it went away inside one."""
    try:
        head = recv_exact(sock, _REQUEST.size)
    except ConnectionError:
        return None
    op, count, length = _REQUEST.unpack(head)
    if op not in OPS or length > MAX_PAYLOAD:
        raise WireError(f"bad request frame (op {op}, {length} bytes)")
    data = memoryview(recv_exact(sock, length))
    slots: list[int] = []
    if op in (PUT, FETCH):
        if len(data) < 8 * count:
            raise WireError("truncated slot list")
        arr = array("q")
        arr.frombytes(data[:8 * count])
        slots = arr.tolist()
        data = data[8 * count:]
    return op, slots, decode_keys(data, count)


def send_reply(sock: socket.socket, payload: bytes = b"", status: int = OK) -> None:
    sock.sendall(_REPLY.pack(status, len(payload)) + payload)


def error_payload(exc: BaseException) -> bytes:
    return json.dumps({"type": type(exc).__name__, "errno": getattr(exc, "errno", None),
                       "message": str(exc)}).encode()


def read_reply(sock: socket.socket, deadline: float | None = None, *,
               partial: bool = False) -> tuple[int, memoryview]:
    """The next reply; TimeoutError if it is not complete by ``deadline`` (monotonic).
    ``partial``: a PART frame may come (only the shared tier's fetches send them)."""
    status, length = _REPLY.unpack(recv_exact(sock, _REPLY.size, deadline))
    if status not in ((OK, ERROR, PART) if partial else (OK, ERROR)) or length > MAX_PAYLOAD:
        raise WireError(f"bad reply frame (status {status}, {length} bytes)")
    return status, memoryview(recv_exact(sock, length, deadline))


def encode_positions(failed: Sequence[int], transient: Sequence[int]) -> bytes:
    return (_COUNTS.pack(len(failed), len(transient)) + array("I", failed).tobytes()
            + array("I", transient).tobytes())


def decode_positions(data: memoryview, n: int) -> tuple[list[int], list[int]]:
    """Positions in a fetch of ``n`` keys; each must be within [0, n)."""
    if len(data) < _COUNTS.size:
        raise WireError("truncated fetch reply")
    nf, nt = _COUNTS.unpack_from(data)
    if len(data) != _COUNTS.size + 4 * (nf + nt):
        raise WireError("fetch reply of the wrong length")
    arr = array("I")
    arr.frombytes(data[_COUNTS.size:])
    flat = arr.tolist()
    if any(p >= n for p in flat):
        raise WireError("fetch reply names a position outside the request")
    return flat[:nf], flat[nf:]
