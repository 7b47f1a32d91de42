"""Read a kvtier metrics endpoint back into the live-stats dict (``kvtier stats --url``).

Only the text exposition format is parsed (by prometheus-client's parser); only ``http`` and
``https`` URLs are fetched, with a timeout and a size cap. Metrics that are not kvtier's are
ignored.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtier.metrics.families import SPECS, put

MAX_BYTES = 16 << 20
_BY_NAME = {spec.name: spec for spec in SPECS}


class ScrapeError(OSError):
    """The endpoint could not be fetched or did not answer in the Prometheus text format."""


def fetch(url: str, timeout: float = 5.0) -> str:
    if not url.startswith(("http://", "https://")):
        raise ScrapeError(f"not an http(s) URL: {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - scheme checked
            body = resp.read(MAX_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ScrapeError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}") from None
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
            put(stats, spec, label, float(sample.value))
    return stats


def scrape(url: str, timeout: float = 5.0) -> dict:
    return parse(fetch(url, timeout))
