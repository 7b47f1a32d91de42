"""What went wrong with the shared tier, in words an operator can act on, and once in the log.

A wrong CA, a certificate for another host name or a wrong password looks, from the data path,
like any other lost connection: the tier degrades and the local tiers serve alone. That is the
right behaviour but not a diagnosis; so these failures are named (``describe``), counted apart
(``kind``: ``tls`` / ``auth``, the ``remote.tls_errors`` / ``remote.auth_errors`` counters) and
logged once per process and kind (``log_once``), not once per connection attempt.
"""

from __future__ import annotations

import logging
import ssl
import threading

from kvtier.tiers.remote.wire.resp import AuthFailed

_logged: set[str] = set()
_lock = threading.Lock()


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind ``exc`` (itself, or what it wraps: redis-py re-raises them)."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _auth_error(exc: BaseException | None) -> BaseException | None:
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, AuthFailed) or type(exc).__name__ == "AuthenticationError" or \
                str(exc).startswith(("WRONGPASS", "NOAUTH")):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def kind(exc: BaseException) -> str | None:
    """``"tls"``, ``"auth"`` or None (any other failure)."""
    if _ssl_error(exc) is not None or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return "tls"
    if _auth_error(exc) is not None:
        return "auth"
    return None


def describe(exc: BaseException) -> str:
    """One line naming the failure: ``TLS: ...``, ``AUTH failed: ...`` or the exception."""
    tls = _ssl_error(exc)
    text = str(exc)
    if tls is not None or "CERTIFICATE_VERIFY_FAILED" in text:
        detail = str(getattr(tls, "verify_message", "") or "") or text
        if "hostname" in detail.lower() or "host name" in detail.lower() or \
                "IP address mismatch" in detail:
            return f"TLS: the certificate is for another host name ({detail})"
        if "CERTIFICATE_VERIFY_FAILED" in text or isinstance(tls, ssl.SSLCertVerificationError):
            return f"TLS: certificate verify failed (wrong CA?): {detail}"
        return f"TLS: {getattr(tls, 'reason', None) or detail}"
    auth = _auth_error(exc)
    if auth is not None:
        return f"AUTH failed (wrong username or password?): {auth}"
    return f"{type(exc).__name__}: {text}"


def log_once(logger: logging.Logger, what: str, message: str) -> None:
    """Log ``message`` at ERROR the first time this process meets a failure of ``what``."""
    with _lock:
        if what in _logged:
            return
        _logged.add(what)
    logger.error("kvtier: shared tier: %s", message)
