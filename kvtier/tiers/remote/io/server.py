"""A shared-tier I/O process: moves blocks between the worker's CPU pool (mapped from its memfd)
and Redis / Valkey, so neither the bytes nor their parsing and checksums touch the engine's
process or its GIL (see process.py).

Started by the worker (``python -I -c`` calling :func:`main`, cwd ``/``, no PYTHON*
variables); never by hand. Its command line holds no secret: the ACL password and the MAC key
arrive as the first frame on its private socket. It then connects to the server (warm-up, so a
first hit does not pay the connection) and answers requests in order until the worker closes
the socket.
"""

from __future__ import annotations

import json
import os
import socket

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.child import wire
from kvtier.tiers.child.serve import child_main, serve_requests
from kvtier.tiers.child.slots import MappedSlots
from kvtier.tiers.remote.block_io import BlockIOStats, RemoteBlockIO
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.secrets import RemoteSecrets

def _handle(io: RemoteBlockIO, op: int, slots: list[int], keys: list[bytes],
            sock: socket.socket) -> dict:
    if op == wire.PUT:
        r = io.put(slots, keys)
        out: dict = {"ok": r.ok, "lost": r.lost}
    elif op == wire.FETCH:
        def ready(positions: list[int]) -> None:  # verified already: the worker may copy them on
            wire.send_reply(sock, json.dumps({"ready": positions}).encode(), wire.PART)

        r = io.fetch(keys, slots, ready)
        out = {"failed": r.failed, "transient": r.transient}
    else:  # STATS: a warm-up probe
        out = {"warm": io.warm_up()}
    out["stats"], io.stats = io.stats.to_dict(), BlockIOStats()  # what this request added
    return out


def _widen_affinity() -> None:
    """Run on every CPU this process may use. A child inherits the CPU affinity of the worker
    that started it, and an engine process is often pinned to a few cores (NUMA binding);
    eight I/O processes squeezed onto those cores would move a hit at a fraction of the
    server's speed. The kernel keeps the mask within the cgroup's cpuset."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError, ValueError):  # not Linux, or not permitted: keep it
        pass


def main(argv: list[str]) -> int:
    return child_main(_serve, argv, "kvtier remote process")


def _serve(spec: dict) -> int:
    _widen_affinity()
    sock = socket.socket(fileno=spec["socket"])
    status, payload = wire.read_reply(sock)  # the secrets frame
    secrets = RemoteSecrets.from_wire(json.loads(bytes(payload)))
    try:
        cfg = RemoteTierConfig(**spec["config"])
        keys = RemoteKeys(**spec["keys"])
        pool = MappedSlots(spec["pool_fd"], spec["num_slots"], spec["block_bytes"],
                           populate=True)
        io = RemoteBlockIO(cfg, keys, secrets, pool.buffer, spec["block_bytes"])
    except Exception as exc:  # noqa: BLE001 - the worker logs it and runs without the tier
        wire.send_reply(sock, wire.error_payload(exc), wire.ERROR)
        return 2
    wire.send_reply(sock, json.dumps({"pid": os.getpid(), "warm": io.warm_up()}).encode())
    serve_requests(sock, lambda op, slots, keys: json.dumps(_handle(io, op, slots, keys, sock))
                   .encode(), "kvtier remote process")
    io.close()
    return 0
