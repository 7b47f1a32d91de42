"""kvtier's own event stream, Prometheus endpoint and stats snapshot inside vLLM.

The manager lives in vLLM's scheduler process, so that is where these run, each only when the
YAML asks for it (``events:``, ``metrics:``, ``stats.snapshot_path`` or a disk tier). vLLM's
own KV-event publisher still gets kvtier's events through ``take_events``; this stream adds
kvtier's access (hit) events and replay on an endpoint the operator chooses, and the metrics
and snapshot are what ``kvtier stats`` reads. Transfer counters live in the worker processes
and reach vLLM's stats logger instead (``KVTierStats``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kvtier.config import KvtierConfig
from kvtier.observe.events import EventPublisher, ManagerFeed
from kvtier.observe.events.metadata import MetadataLookup
from kvtier.manager.events import Event
from kvtier.observe.metrics import MetricsExporter
from kvtier.runtime.snapshot import SnapshotWriter

log = logging.getLogger(__name__)


class SchedulerObservability:
    def __init__(self, config: KvtierConfig, manager: Any, *, block_tokens: int, block_bytes: int,
                 metadata: MetadataLookup | None = None,
                 wire_hash: Callable[[bytes], Any] | None = None) -> None:
        self.manager = manager
        self.block_bytes = block_bytes
        self.feed: ManagerFeed | None = None
        self.metrics: MetricsExporter | None = None
        self.snapshot: SnapshotWriter | None = None
        if config.events is not None:
            publisher = EventPublisher(config.events, block_tokens=block_tokens,
                                       metadata=metadata, wire_hash=wire_hash)
            self.feed = ManagerFeed(manager, publisher)
            log.info("kvtier: KV events on %s (replay %s)", publisher.endpoint,
                     publisher.replay_endpoint)
        if config.metrics is not None:
            self.metrics = MetricsExporter(config.metrics, self.live_stats)
            log.info("kvtier: Prometheus metrics on %s", self.metrics.url)
        path = config.snapshot_path()
        if path is not None:
            self.snapshot = SnapshotWriter(path, self.live_stats, config.stats.interval_s)

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.feed, self.metrics, self.snapshot))

    def publish(self, events: Sequence[Event]) -> None:
        """Events the scheduler drained from the manager this step (also sent to vLLM)."""
        if self.feed is not None:
            self.feed.pump(events)

    def live_stats(self) -> dict:
        usage = self.manager.usage()
        for tier in usage.values():
            tier["used_bytes"] = tier["used_blocks"] * self.block_bytes
            cap = tier["capacity_blocks"]  # None: advisory only (the shared tier's server rules)
            tier["capacity_bytes"] = None if cap is None else cap * self.block_bytes
        out = {"manager": self.manager.stats.snapshot(), "usage": usage,
               "block_bytes": self.block_bytes}
        cost = self.manager.cost
        if cost is not None:  # why hits were (not) loaded: the estimates behind the decisions
            out["cost"] = cost.snapshot()
        if self.feed is not None:
            pub = self.feed.publisher
            out["events"] = {**pub.stats().to_dict(), "endpoint": pub.endpoint,
                             "replay_endpoint": pub.replay_endpoint}
        if self.metrics is not None:
            out["metrics_url"] = self.metrics.url
        return out

    def close(self) -> None:
        if self.feed is not None:
            self.feed.publisher.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.snapshot is not None:
            self.snapshot.close()
