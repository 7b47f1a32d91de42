"""The table that maps an instance's live stats to Prometheus metrics, and back.

An instance describes itself with one JSON-able dict (the same one its stats snapshot file
holds): ``manager`` (ManagerStats), ``usage`` (blocks per tier), ``transfers`` (per
direction), and when known ``requests`` (what the engine saw, in blocks and tokens), ``disk``
(DiskStats), ``events`` (PublisherStats) and ``block_bytes``. Each metric names the path it is
read from; a ``{label}`` step walks every key there and becomes that label. The same table
parses a scrape back into the dict, so ``kvtier stats --url`` shows what the snapshot shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

PREFIX = "kvtier_"


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the ``_total`` a counter gets on the wire
    kind: str  # "counter" | "gauge"
    path: str  # dotted; one step may be "{label}"
    help: str
    integer: bool = True  # parsed back as int (counts, bytes) rather than float

    @property
    def steps(self) -> list[str]:
        return self.path.split(".")

    @property
    def label(self) -> str | None:
        return next((s[1:-1] for s in self.steps if s.startswith("{")), None)


def _c(name: str, path: str, help: str, integer: bool = True) -> MetricSpec:
    return MetricSpec(PREFIX + name, "counter", path, help, integer)


def _g(name: str, path: str, help: str, integer: bool = True) -> MetricSpec:
    return MetricSpec(PREFIX + name, "gauge", path, help, integer)


SPECS: tuple[MetricSpec, ...] = (
    _c("hit_blocks", "requests.hit_blocks.{tier}", "Prompt blocks found in each tier (GPU = engine prefix cache)."),
    _c("hit_tokens", "requests.hit_tokens.{tier}", "Prompt tokens found in each tier."),
    _c("miss_blocks", "requests.miss_blocks", "Prompt blocks found in no tier (recomputed)."),
    _c("miss_tokens", "requests.miss_tokens", "Prompt tokens found in no tier (recomputed)."),
    _c("lookups", "manager.lookups", "Manager lookup() calls."),
    _c("lookup_blocks", "manager.lookup_blocks", "Blocks asked for in lookup() calls."),
    _c("manager_hit_blocks", "manager.hit_blocks.{tier}", "Blocks kvtier planned to load from each tier."),
    _c("stored_blocks", "manager.stored_blocks.{tier}", "Blocks that became readable in each tier."),
    _c("evictions", "manager.evicted_blocks.{tier}", "Blocks evicted from each tier."),
    _c("evicted_unwritten", "manager.evicted_unwritten",
       "CPU evictions of blocks the disk would have kept but had no copy of yet (write-back "
       "behind): lost from the hierarchy, not just from the CPU tier."),
    _c("admission_rejections", "manager.admission_rejected.{tier}", "Blocks the admission policy kept out of each tier."),
    _c("store_skipped_no_space", "manager.store_skipped_no_space", "Blocks not stored: no evictable CPU slot."),
    _c("load_truncated_no_space", "manager.load_truncated_no_space", "Loads cut short: no CPU slot to promote into."),
    _c("failed_loads", "manager.failed_loads", "Blocks whose load failed (missing or corrupt)."),
    _c("failed_loads_transient", "manager.failed_loads_transient",
       "Of failed_loads: reads that failed transiently (EIO, EMFILE, ENOMEM), not corruption."),
    _c("failed_stores", "manager.failed_stores.{tier}", "Blocks whose store failed, per tier."),
    _c("protocol_errors", "manager.protocol_errors", "complete_* calls for nothing prepared (caller bugs)."),
    _c("skipped_slower_than_recompute", "manager.skipped_slower_than_recompute.{tier}",
       "Resident blocks not loaded: recomputing them was estimated faster."),
    _g("disk_degraded", "manager.disk_degraded", "1 while the disk tier refuses new blocks after write failures."),
    _c("disk_degradations", "manager.disk_degradations", "Times the disk tier entered degraded mode."),
    _g("remote_degraded", "manager.remote_degraded",
       "1 while the shared tier (Redis/Valkey) is down or hung; local tiers serve alone."),
    _c("remote_degradations", "manager.remote_degradations", "Times the shared tier became degraded."),
    _c("remote_writes_skipped", "manager.remote_writes_skipped",
       "Write-backs to the shared tier not queued (degraded, or too many in flight)."),
    _c("remote_writes_already_held", "manager.remote_writes_already_held",
       "Write-backs to the shared tier not needed: the server held the block (another "
       "instance wrote it)."),
    _c("remote_pending_lookups", "manager.remote_pending_lookups",
       "Lookups answered 'not yet' while the shared tier was asked."),
    _c("host_foreign_hit_blocks", "manager.host_foreign_hit_blocks",
       "Host tier: blocks this instance loaded that another instance on the host stored."),
    _c("host_hits_given", "usage.HOST.hits_given",
       "Host tier: this instance's blocks that other instances on the host loaded."),
    _c("host_store_skipped_held", "manager.host_store_skipped_held",
       "Host tier: blocks not stored because another instance on the host holds them."),
    _c("host_evictions_held", "manager.host_evictions_held",
       "Host tier: evictions held back because another instance was reading the block."),
    _g("host_instances", "usage.HOST.instances", "Host tier: instances sharing the host's pool."),
    _g("host_degraded", "manager.host_degraded",
       "1 once the host tier's service is gone: this instance serves from its region alone."),
    _c("remote_rejected", "remote.rejected",
       "Shared-tier values that failed verification (corrupt or foreign): read as misses."),
    _c("remote_unauthenticated", "remote.unauthenticated",
       "Shared-tier values refused for lack of a valid MAC tag (forged or keyless writers)."),
    _c("remote_misses", "remote.misses", "Shared-tier reads of absent keys (evicted or never stored)."),
    _c("remote_errors", "remote.errors", "Shared-tier commands that failed (connection or server)."),
    _c("remote_tls_errors", "remote.tls_errors",
       "Of remote_errors: TLS refused (wrong CA, another host name, no TLS on the server)."),
    _c("remote_auth_errors", "remote.auth_errors",
       "Of remote_errors: the server refused AUTH (wrong user or password)."),
    _c("remote_unlisted_refused", "remote.unlisted_refused",
       "Shared-tier blocks not sent to a Cluster node outside tiers.remote.nodes (misses)."),
    _c("transfer_bytes", "transfers.{direction}.bytes", "Bytes moved per direction."),
    _c("transfer_seconds", "transfers.{direction}.seconds", "Busy seconds per direction.", False),
    _c("transfer_jobs", "transfers.{direction}.jobs", "Transfer hops run per direction."),
    _c("failed_jobs", "transfers.{direction}.failed_jobs", "Transfer hops that failed per direction."),
    _g("tier_used_bytes", "usage.{tier}.used_bytes", "Bytes held per tier (uncompressed)."),
    _g("tier_capacity_bytes", "usage.{tier}.capacity_bytes", "Capacity per tier in bytes."),
    _g("tier_used_blocks", "usage.{tier}.used_blocks", "Blocks held per tier (including ones being written)."),
    _g("tier_capacity_blocks", "usage.{tier}.capacity_blocks", "Capacity per tier in blocks."),
    _g("disk_logical_bytes", "disk.logical_bytes", "Disk tier: block bytes as the CPU tier sees them."),
    _g("disk_stored_bytes", "disk.stored_bytes", "Disk tier: live record bytes on disk (after compression)."),
    _g("disk_file_bytes", "disk.file_bytes", "Disk tier: size of all segment files."),
    _g("disk_compression_ratio", "disk.compression_ratio", "Disk tier: logical / stored bytes.", False),
    _c("checksum_failures", "disk.checksum_failures", "Disk records that failed verification."),
    _c("disk_read_errors", "disk.read_errors", "Disk read errors."),
    _c("disk_write_errors", "disk.write_errors", "Disk write errors."),
    _c("event_batches", "events.batches", "KV-event batches published."),
    _c("events_published", "events.events", "KV events published (stored, removed, cleared)."),
    _c("access_events_published", "events.access_events", "Access (hit) events published."),
    _c("event_drops", "events.dropped_events", "Manager events dropped: the publisher queue was full."),
    _c("event_resyncs", "events.resyncs", "Full resyncs published (start, drops, replay gaps)."),
    _c("event_replay_requests", "events.replay_requests", "Replay requests served."),
    _c("event_replay_gaps", "events.replay_gaps", "Replay requests that reached past the buffer."),
    _g("block_bytes", "block_bytes", "Bytes per kvtier block."),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def samples(spec: MetricSpec, stats: dict) -> Iterator[tuple[str | None, float]]:
    """``(label value or None, value)`` for every number ``spec.path`` reaches in ``stats``."""

    def walk(node: Any, steps: list[str], label: str | None):
        if not steps:
            # a flag (disk_degraded, remote_degraded) is a gauge of 1 while set; elsewhere a
            # bool is junk, not a count
            flag = spec.kind == "gauge" and isinstance(node, bool)
            value = float(node) if flag else _number(node)
            if value is not None:
                yield label, value
            return
        if not isinstance(node, dict):
            return
        step, rest = steps[0], steps[1:]
        if step.startswith("{"):
            for key in sorted(node, key=str):
                yield from walk(node[key], rest, str(key))
        elif step in node:
            yield from walk(node[step], rest, label)

    yield from walk(stats, spec.steps, None)


def put(stats: dict, spec: MetricSpec, label: str | None, value: float) -> None:
    """Inverse of ``samples``: store ``value`` where ``spec.path`` says (counts stay ints)."""
    node = stats
    steps = spec.steps
    for step in steps[:-1]:
        key = label if step.startswith("{") else step
        if key is None:
            return
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return
    last = label if steps[-1].startswith("{") else steps[-1]
    if last is not None:
        node[last] = int(value) if spec.integer and value.is_integer() else value


def enrich(stats: dict) -> dict:
    """Fill derived numbers in place: bytes per tier from blocks x ``block_bytes`` (the disk
    tier's used bytes from its own stats when present) and GB/s per direction."""
    block = _number(stats.get("block_bytes"))
    usage = stats.get("usage")
    if isinstance(usage, dict):
        for tier, u in usage.items():
            if not isinstance(u, dict):
                continue
            if block:
                for src, dst in (("used_blocks", "used_bytes"), ("capacity_blocks", "capacity_bytes")):
                    if dst not in u and _number(u.get(src)) is not None:
                        u[dst] = int(u[src] * block)
            disk = stats.get("disk")
            if tier == "DISK" and isinstance(disk, dict) and _number(disk.get("logical_bytes")) is not None:
                u["used_bytes"] = int(disk["logical_bytes"])
    transfers = stats.get("transfers")
    if isinstance(transfers, dict):
        for t in transfers.values():
            if isinstance(t, dict) and "gbps" not in t:
                b, s = _number(t.get("bytes")), _number(t.get("seconds"))
                t["gbps"] = b / s / 1e9 if b is not None and s else 0.0
    return stats
