"""``KVTierStats``: kvtier's numbers in vLLM's KV-transfer logging and metrics path.

vLLM sums each worker's stats with the scheduler's (same class), ships ``data`` to the logger
process and rebuilds the object there with ``KVTierConnector.build_kv_connector_stats``. So
``data`` is a flat dict of plain numbers, and ``aggregate`` adds key by key: hit tokens per
tier come from the scheduler (counted once), bytes / busy seconds / jobs per direction from
each worker (summed over tensor-parallel workers: every worker moves its own slice).
"""

from __future__ import annotations

from typing import Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.tiers.disk.io.process import DiskProcess
from kvtier.runtime.worker import WorkerRuntime
from kvtier.transfer.jobs import DirectionStats


def direction_key(route: str) -> str:
    """``"GPU->CPU"`` -> ``"gpu_to_cpu"`` (keys must be plain identifiers for log lines)."""
    return route.lower().replace("->", "_to_")


class KVTierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, value: float) -> None:
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def add_directions(self, delta: Mapping[str, DirectionStats]) -> None:
        for route, s in delta.items():
            d = direction_key(route)
            self.add(f"bytes_{d}", s.bytes)
            self.add(f"seconds_{d}", s.seconds)
            self.add(f"jobs_{d}", s.jobs)
            self.add(f"failed_jobs_{d}", s.failed_jobs)

    def aggregate(self, other: KVConnectorStats) -> "KVTierStats":
        for key, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, Any] = {}
        for key, value in sorted(self.data.items()):
            out[key] = round(value, 6) if isinstance(value, float) else value
        for key, value in self.data.items():
            if key.startswith("bytes_"):
                seconds = self.data.get("seconds_" + key[6:], 0)
                if seconds > 0:
                    out["gbps_" + key[6:]] = round(value / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> "KVTierStats | None":
        """What was counted since the last take (None: nothing), counting on from zero. The
        object stays the one its collaborators add to."""
        if self.is_empty():
            return None
        out = KVTierStats()
        out.data, self.data = self.data, {}
        return out


def direction_delta(now: Mapping[str, DirectionStats],
                    before: Mapping[str, DirectionStats]) -> dict[str, DirectionStats]:
    """Per-direction increase since ``before`` (the engine's counters only grow)."""
    out = {}
    for route, s in now.items():
        b = before.get(route, DirectionStats())
        d = DirectionStats(jobs=s.jobs - b.jobs, failed_jobs=s.failed_jobs - b.failed_jobs,
                           bytes=s.bytes - b.bytes, seconds=max(0.0, s.seconds - b.seconds))
        if d.jobs or d.bytes or d.failed_jobs:
            out[route] = d
    return out


class WorkerStatsTaker:
    """A worker's share of ``KVTierStats``: what its transfer engine moved since the last
    take, and disk I/O processes it replaced. vLLM asks every step (decode steps too): with
    no hop finished since, nothing is snapshotted (the busy time of hops still running goes
    into the next delta that has one)."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self._before = runtime.engine.stats()
        self._hops = runtime.engine.jobs_done
        self._respawns = 0

    def take(self) -> KVTierStats | None:
        engine = self.runtime.engine
        done = engine.jobs_done  # read before the snapshot: a job in between is seen next time
        if done == self._hops:
            return None
        self._hops = done
        now = engine.stats()
        delta = direction_delta(now, self._before)
        self._before = now
        if not delta:
            return None
        stats = KVTierStats()
        stats.add_directions(delta)
        store = self.runtime.store
        if isinstance(store, DiskProcess):  # a replacement follows a failed disk hop
            stats.add("disk_process_respawns", store.respawns - self._respawns)
            self._respawns = store.respawns
        return stats
