"""A fake RESP server on 127.0.0.1 for the shared-tier tests of hostile and broken servers:
``answer(args) -> bytes`` decides each command's raw reply (it may echo, drip, flood or
refuse); every connection and command is recorded. Threads only, stopped by ``close``."""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Callable

Answer = Callable[[list[bytes], socket.socket], bytes | None]


def _read_command(f) -> list[bytes] | None:
    line = f.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return [line.strip()]
    args = []
    for _ in range(int(line[1:])):
        n = int(f.readline()[1:])
        args.append(f.read(n + 2)[:n])
    return args


class FakeResp:
    def __init__(self, answer: Answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls  # a server-side context: connections are TLS (handshake per thread)
        self.commands: list[list[bytes]] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):
                conn.close()
                return
        with conn, conn.makefile("rb") as f:
            try:
                while True:
                    args = _read_command(f)
                    if args is None:
                        return
                    self.commands.append(args)
                    reply = self.answer(args, conn)
                    if reply:
                        conn.sendall(reply)
            except (OSError, ValueError):
                return

    def close(self) -> None:
        self._closed = True
        self._listener.close()
