"""Prometheus metrics of a running instance (``kvtier_`` prefix) and reading them back."""

from kvtier.observe.metrics.exporter import MetricsExporter, metric_families
from kvtier.observe.metrics.families import SPECS, MetricSpec, enrich
from kvtier.observe.metrics.scrape import ScrapeError, parse, scrape

__all__ = ["SPECS", "MetricSpec", "MetricsExporter", "ScrapeError", "enrich", "metric_families",
           "parse", "scrape"]
