"""Server error text made safe to keep: what a server says goes to logs, ``last_error`` and
``kvtier stats``, and a server may repeat what it was sent.

Valkey answers a command it does not know with ``ERR unknown command 'AUTH', with args
beginning with: 'user' 'password'``: a server without ACLs (or a proxy in front of one) turns
the AUTH of every connection into a copy of the password. So the arguments a server echoes are
cut off, and any secret still in the text (the password, the user-password pair, the MAC key)
is replaced by ``***`` whatever its place.
"""

from __future__ import annotations

from typing import Iterable

ECHO_MARKERS = ("with args beginning with:", "with args beginning with ")
HIDDEN = "***"


def without_echoed_args(text: str) -> str:
    """``text`` cut after a marker that introduces the command's own arguments."""
    for marker in ECHO_MARKERS:
        at = text.find(marker)
        if at >= 0:
            return text[:at + len(marker)].rstrip(": ") + ": (not shown)"
    return text


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret (longest first: a pair before its parts) replaced."""
    text = without_echoed_args(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text
