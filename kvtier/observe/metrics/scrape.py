"""Read a kvtier metrics endpoint back into the live-stats dict (``kvtier stats --url``).

Only the text exposition format is parsed (by prometheus-client's parser); only ``http`` and
``https`` URLs are fetched, with a size cap and one deadline for the whole fetch: a socket
timeout only bounds each read, and a server dripping one byte a second never trips it, so a
watchdog timer shuts the socket down when the deadline passes, whatever phase the fetch is in
(connect, headers, body). Metrics that are not kvtier's, and values that are not finite numbers
below 2**63, are ignored.
"""

from __future__ import annotations

import http.client
import math
import socket
import ssl
import threading
import time
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

from kvtier.observe.metrics.families import SPECS, put

MAX_BYTES = 16 << 20
MAX_VALUE = float(1 << 63)
_BY_NAME = {spec.name: spec for spec in SPECS}


class ScrapeError(OSError):
    """The endpoint could not be fetched or did not answer in the Prometheus text format."""


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ScrapeError(f"bad port in {url!r}") from None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout,
                                           context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    return conn, path


def fetch(url: str, timeout: float = 5.0) -> str:
    """The body at ``url``, fetched within ``timeout`` seconds in all."""
    conn, path = _connection(url, timeout)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv: it returns or fails
            except OSError:
                pass

    deadline = time.monotonic() + timeout
    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    try:
        conn.connect()  # bounded by the socket timeout; the watchdog needs the socket
        watchdog.interval = max(0.0, deadline - time.monotonic())
        watchdog.start()
        conn.request("GET", path, headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeError(f"cannot fetch {url}: HTTP {resp.status} {resp.reason}")
        chunks, size = [], 0
        while size <= MAX_BYTES and time.monotonic() < deadline:
            chunk = resp.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if expired.is_set() or time.monotonic() >= deadline:
            raise ScrapeError(f"cannot fetch {url}: no complete answer within {timeout:g}s")
        body = b"".join(chunks)
    except ScrapeError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise ScrapeError(f"cannot fetch {url}: no complete answer within {timeout:g}s") from None
        raise ScrapeError(f"cannot fetch {url}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        watchdog.cancel()
        conn.close()
    if len(body) > MAX_BYTES:
        raise ScrapeError(f"{url}: answer larger than {MAX_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


def parse(text: str) -> dict:
    """kvtier's metrics in ``text`` as a live-stats dict (the inverse of the exporter)."""
    stats: dict = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError(f"not Prometheus text format: {exc}") from None
    for family in families:
        spec = _BY_NAME.get(family.name)
        if spec is None:
            continue
        wanted = spec.name + ("_total" if spec.kind == "counter" else "")
        for sample in family.samples:
            if sample.name != wanted:
                continue
            label = sample.labels.get(spec.label) if spec.label else None
            if spec.label and label is None:
                continue
            value = float(sample.value)
            if math.isfinite(value) and abs(value) < MAX_VALUE:
                put(stats, spec, label, value)
    return stats


def scrape(url: str, timeout: float = 5.0) -> dict:
    return parse(fetch(url, timeout))
