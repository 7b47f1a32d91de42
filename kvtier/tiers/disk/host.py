"""Which host a store directory is served from: the ``HOST`` file its owner writes.

Why: with a replicated KV layout (MLA, every tensor-parallel rank holds the same bytes) only
rank 0 writes the disk tier and the other ranks read rank 0's records. That is only sound on
rank 0's own host: LMDB's reader table is shared memory, which does not work across hosts (a
directory on a network file system, or a same-named local directory on another node). The
owner records this host's identity in ``<dir>/HOST`` each time it opens the store; a reader
compares it with its own before mapping anything, and anything else (no file, another host,
an unreadable file) means "not rank 0's directory on this host".

The identity is the host name plus the kernel's boot id: two nodes never share a boot id, and
a file left by an earlier boot never matches, so a reboot cannot make a stale directory look
served.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

HOST_FILE = "HOST"
_TMP = HOST_FILE + ".tmp"
_MAX = 512
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def this_host() -> str:
    """This host's identity (``hostname/boot-id``; the machine id where no boot id exists)."""
    ident = ""
    for path in (_BOOT_ID, "/etc/machine-id"):
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                ident = f.read(128).strip()
        except OSError:
            continue
        if ident:
            break
    return f"{socket.gethostname()}/{ident}"


def record(root_fd: int) -> None:
    """Write this host's identity into the store directory (owner only, under its lock).

    Rewritten only when it differs (the directory is not touched on every start); replaced
    atomically, so a reader sees the old or the new identity, never a torn one. Raises OSError.
    """
    ident = this_host()
    if read(root_fd) == ident:
        return
    fd = os.open(_TMP, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=root_fd)
    try:
        os.write(fd, ident.encode())
    finally:
        os.close(fd)
    os.replace(_TMP, HOST_FILE, src_dir_fd=root_fd, dst_dir_fd=root_fd)


def read(root_fd: int) -> str | None:
    """The identity recorded in the directory, or None (missing, not a regular file, too long
    or unreadable). Never follows a link and never blocks on a FIFO."""
    try:
        fd = os.open(HOST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=root_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > _MAX:
        return None
    return raw.decode("utf-8", "replace")


def served_here(root: Path) -> bool:
    """Whether ``root``'s owner recorded this host (False when there is nothing to read)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return read(fd) == this_host()
    finally:
        os.close(fd)
