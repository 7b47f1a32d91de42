"""``MetricsExporter``: the instance's live stats as Prometheus metrics over HTTP.

Nothing is counted twice: a scrape calls the same ``source()`` the stats snapshot writer calls
and turns it into metric families through ``families.SPECS`` at that moment. The HTTP server
runs on prometheus-client's own daemon thread; a failing ``source`` costs an empty scrape and a
log line, never the instance.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.config.schema import MetricsConfig
from kvtier.observe.metrics.families import SPECS, enrich, samples

log = logging.getLogger(__name__)

StatsSource = Callable[[], dict]


def metric_families(stats: dict) -> Iterator[Metric]:
    """Prometheus families for one live-stats dict (metrics with no value are left out)."""
    stats = enrich(copy.deepcopy(stats))
    for spec in SPECS:
        label = spec.label
        cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
        family = cls(spec.name, spec.help, labels=[label] if label else None)
        found = False
        for value_label, value in samples(spec, stats):
            family.add_metric([value_label] if label else [], value)
            found = True
        if found:
            yield family


class _StatsCollector:
    def __init__(self, source: StatsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._source()
        except Exception:  # noqa: BLE001 - a scrape must never take the instance down
            log.exception("kvtier metrics: collecting stats failed")
            return
        yield from metric_families(stats)


def url_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class MetricsExporter:
    def __init__(self, config: MetricsConfig, source: StatsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(source))
        try:
            self._server, self._thread = start_http_server(config.port, addr=config.host,
                                                           registry=self.registry)
        except OSError as exc:
            raise OSError(f"kvtier metrics: cannot listen on {config.host}:{config.port}: "
                          f"{exc.strerror or exc}") from None
        self.port: int = self._server.server_address[1]
        self.url = f"http://{url_host(config.host)}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsExporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
