"""Counters the manager keeps: what operators and ``kvtier stats`` read.

Plain integers updated on the scheduler thread; ``snapshot()`` copies them into a JSON-able
dict so another thread (the snapshot writer, a metrics exporter) never sees a torn update of
a single field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _per_tier() -> dict[str, int]:
    return {"CPU": 0, "DISK": 0}  # "REMOTE" joins when the shared tier is configured


@dataclass
class ManagerStats:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: dict[str, int] = field(default_factory=_per_tier)  # counted at prepare_load
    stored_blocks: dict[str, int] = field(default_factory=_per_tier)
    evicted_blocks: dict[str, int] = field(default_factory=_per_tier)
    admission_rejected: dict[str, int] = field(default_factory=_per_tier)
    store_skipped_no_space: int = 0
    # CPU evictions of blocks the disk would have taken but had no copy of yet (write-back
    # was behind): lost from the hierarchy, not just from the CPU tier
    evicted_unwritten: int = 0
    load_truncated_no_space: int = 0
    # resident hits lookup did not report: loading them was estimated slower than recompute
    skipped_slower_than_recompute: dict[str, int] = field(default_factory=_per_tier)
    failed_loads: int = 0
    # of failed_loads: reads that failed transiently (EIO, EMFILE, ENOMEM), not corruption
    failed_loads_transient: int = 0
    failed_stores: dict[str, int] = field(default_factory=_per_tier)
    protocol_errors: int = 0  # complete_* for something never prepared (caller bug), ignored
    disk_degraded: bool = False  # demotions keep failing (disk full / EIO): disk admits only probes
    disk_degradations: int = 0  # episodes of disk_degraded so far
    remote_degraded: bool = False  # the shared tier is down or hung: local tiers serve alone
    remote_degradations: int = 0
    remote_writes_skipped: int = 0  # write-backs not queued: tier degraded or queue full
    remote_writes_already_held: int = 0  # write-backs not needed: the server held the block
    remote_pending_lookups: int = 0  # lookups answered "not yet" (server asked, reply due)
    # the host tier (manager/host.py): hits on blocks other instances stored, stores skipped
    # because another instance holds the block, evictions held back while another reads
    host_foreign_hit_blocks: int = 0
    host_store_skipped_held: int = 0
    host_evictions_held: int = 0
    host_degraded: bool = False  # the host tier's service is gone: this region serves alone

    def snapshot(self) -> dict:
        return asdict(self)
