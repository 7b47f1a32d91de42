"""Binding the publisher's sockets: any-port tcp, and ``ipc://`` socket files only the owner
can connect to.

An ``ipc://`` socket file takes the process umask (0777 under umask 000), so any local user
could read the stream (block hashes, token ids) or hold replay answers. The file is therefore
bound inside a fresh 0700 directory beside its path, made 0600 there, and renamed into place:
it is never reachable with a looser mode. (The umask is process-wide and vLLM's other threads
create files too, so it is not changed.) The directory is removed at once; a stale file left at
the path by an earlier run is replaced by the rename. A path too long for a socket address is
refused as ZMQ refuses it; one whose directory leaves no room for the private directory's name
is bound in place and made 0600 at once.
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


_IPC_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 107)  # sizeof(sockaddr_un.sun_path) - 1


def _bind_private_ipc(sock: zmq.Socket, path: str) -> None:
    where = os.path.dirname(os.path.abspath(path))
    if len(os.fsencode(path)) > _IPC_MAX:
        sock.bind(f"ipc://{path}")  # raises ZMQ's own error: no client could connect to it
        return
    if len(os.fsencode(where)) + 16 > _IPC_MAX:  # no room for the private directory's name
        sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)  # at once: the file was reachable with the umask's mode only now
        return
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
