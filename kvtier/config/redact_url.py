"""Server addresses as they may appear in a message: without their password.

A URL or node address that carries credentials is refused (they belong in ``username`` and
``password_file`` / ``password_env``), and the refusal must not repeat what it refuses: a
config error goes to a terminal, a log and CI output. ``user:PW@host:port`` is shown as
``user:***@host:port``; the user name stays (it says which entry is wrong).
"""

from __future__ import annotations


def redact_address(text: str) -> str:
    """``text`` (a URL or ``HOST:PORT``) with the password of any ``user:password@`` part
    replaced by ``***``."""
    if "@" not in text:
        return text
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    userinfo, _, host = rest.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    shown = f"{user}:***" if colon else "***"  # a lone word before @ may be a password too
    return f"{scheme}{sep}{shown}@{host}"
