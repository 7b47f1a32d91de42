"""The disk I/O process: owns a worker's disk store and moves blocks between it and the
worker's CPU pool, which it maps from the memfd the worker passed in (see process.py).

Started by the worker (``DiskProcess``: ``python -I -c`` calling :func:`main`, isolated from
the starting directory and PYTHON* variables); never by hand. The spec names the store's
settings, the pool's memfd and the socket descriptors to serve, one thread per socket. The
first reply on the first socket says whether the store opened (or which error it raised).
When the worker goes away its sockets close, every thread ends, and the store is closed
cleanly.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading

from kvtier.tiers.child import wire
from kvtier.tiers.child.serve import child_main, serve_requests
from kvtier.tiers.child.slots import MappedSlots
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk.slot_io import SlotIO
from kvtier.tiers.layout import BlockGeometry


def _handle(op: int, slots: list[int], keys: list[bytes], store: DiskStore, io: SlotIO) -> bytes:
    if op == wire.PUT:
        io.put_slots(slots, keys)
        return b""
    if op == wire.FETCH:
        return wire.encode_positions(*io.fetch_slots(keys, slots))
    if op == wire.DELETE:
        return str(io.delete_many(keys)).encode()
    if op == wire.KEYS:
        keys = store.keys_by_age()
        return len(keys).to_bytes(8, "little") + wire.encode_keys(keys)
    return json.dumps(store.stats().to_dict()).encode()  # STATS


def main(argv: list[str]) -> int:
    return child_main(_serve_all, argv, "kvtier disk process")


def _serve_all(spec: dict) -> int:
    if spec.get("gil_switch_interval_ms"):  # reads must not wait 5 ms behind the writer
        sys.setswitchinterval(spec["gil_switch_interval_ms"] / 1000)
    socks = [socket.socket(fileno=fd) for fd in spec["sockets"]]
    try:
        geometry = BlockGeometry(**spec["geometry"])
        pool = MappedSlots(spec["pool_fd"], spec["num_slots"], geometry.block_bytes)
        store = DiskStore(spec["path"], geometry, **spec["store"])
    except Exception as exc:  # noqa: BLE001 - the worker raises it as its own
        wire.send_reply(socks[0], wire.error_payload(exc), wire.ERROR)
        return 2
    try:
        io = SlotIO(store, pool.buffer)
        wire.send_reply(socks[0], json.dumps({"pid": os.getpid()}).encode())
        answer = functools.partial(_handle, store=store, io=io)
        threads = [threading.Thread(target=serve_requests, args=(s, answer, "kvtier disk process"),
                                    daemon=True, name=f"kvtier-disk-io-{i}")
                   for i, s in enumerate(socks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        store.close()
    return 0

