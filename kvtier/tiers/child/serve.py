"""What the disk and shared-tier I/O processes share: start-up, and answering requests."""

from __future__ import annotations

import json
import logging
import socket
import sys
from typing import Callable

from kvtier.tiers.child import wire

log = logging.getLogger("kvtier.child")


def child_main(serve: Callable[[dict], int], argv: list[str], who: str) -> int:
    """Run ``serve(spec)`` (``argv[1]`` is the spec as JSON) until the worker goes away. Its
    going (a closed or reset socket at any point, even mid-frame or before the first reply)
    is a normal end, status 0, no traceback."""
    try:
        spec = json.loads(argv[1])
        logging.basicConfig(level=spec.get("log_level", logging.WARNING), stream=sys.stderr,
                            format=f"%(asctime)s %(levelname)s [{who}] %(message)s")
        return serve(spec)
    except ConnectionError:
        return 0


def serve_requests(sock: socket.socket, answer: Callable[[int, list[int], list[bytes]], bytes],
                   who: str) -> None:
    """Answer one connection's requests in order until the worker closes it; an error raised
    by ``answer`` is reported to the worker, which raises it."""
    with sock:
        while True:
            try:
                request = wire.read_request(sock)
            except ConnectionError:  # the worker went away mid-frame: as between frames
                return
            except wire.WireError as exc:  # a damaged stream cannot be resynchronised
                log.error("%s: dropping a connection: %s", who, exc)
                return
            if request is None:
                return
            try:
                payload, status = answer(*request), wire.OK
            except Exception as exc:  # noqa: BLE001 - reported to the worker
                payload, status = wire.error_payload(exc), wire.ERROR
            try:
                wire.send_reply(sock, payload, status)
            except OSError:
                return
