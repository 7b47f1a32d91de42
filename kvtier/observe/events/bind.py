"""Binding the publisher's sockets: any-port tcp, and ``ipc://`` socket files only the owner
can connect to.

An ``ipc://`` socket file takes the process umask (0777 under umask 000), so any local user
could read the stream (block hashes, token ids) or hold replay answers. The file is therefore
bound inside a fresh 0700 directory beside its path, made 0600 there, and renamed into place:
it is never reachable with a looser mode. (The umask is process-wide and vLLM's other threads
create files too, so it is not changed.) The directory is removed at once; a stale file left at
the path by an earlier run is replaced by the rename.
"""

from __future__ import annotations

import os
import tempfile

import zmq


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; returns the endpoint bound (the real port for tcp port 0 or *)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        if port in ("0", "*"):
            sock.bind(f"tcp://{host}:*")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # @: abstract
        _bind_private_ipc(sock, endpoint[len("ipc://"):])
        return endpoint
    sock.bind(endpoint)
    return endpoint


def _bind_private_ipc(sock: zmq.Socket, path: str) -> None:
    where = os.path.dirname(os.path.abspath(path))
    private = tempfile.mkdtemp(prefix=".kvt", dir=where)  # 0700, ours
    staged = os.path.join(private, "s")
    try:
        sock.bind(f"ipc://{staged}")
        os.chmod(staged, 0o600)
        os.rename(staged, path)
    except BaseException:
        try:
            sock.unbind(f"ipc://{staged}")
        except zmq.ZMQError:
            pass
        raise
    finally:
        try:
            os.unlink(staged)
        except FileNotFoundError:
            pass
        os.rmdir(private)
