"""The validated configuration: frozen dataclasses with every size already in bytes.

Everything below the loader works on these objects only, never on raw YAML. Some checks need the
model's block size, which is only known once the engine is up; ``check_block_bytes`` runs them
then and still cites the config line the value came from (kept in ``origins``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvtier.config.errors import ConfigError
from kvtier.config.sizes import format_size

EVICTION_POLICIES = ("lru", "arc")
"""Names the manager's policy registry provides; a test keeps the two in step."""

COMPRESSIONS = ("none", "zstd")

GiB = 1 << 30
DEFAULT_CPU_CAPACITY = 4 * GiB
DEFAULT_DISK_CAPACITY = 64 * GiB
DEFAULT_SEGMENT_BYTES = 256 << 20
STATS_FILE_NAME = "kvtier-stats.json"

Origin = tuple[str, "int | None", str]
"""Where a value came from: (file or "<env>", 1-based line or None, key or variable name)."""


@dataclass(frozen=True)
class CpuTierConfig:
    capacity: int
    eviction: str = "lru"
    pin: bool | None = None  # None: pin when CUDA is available


@dataclass(frozen=True)
class DiskTierConfig:
    path: Path
    capacity: int
    eviction: str = "lru"
    compression: str = "none"
    zstd_level: int = 1
    fsync: bool = True
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    store_threshold: int = 1  # demote a block to disk only once it was seen this many times

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))


@dataclass(frozen=True)
class AdmissionConfig:
    store_threshold: int = 1  # store a block after it was seen this many times
    offload_ratio: float = 1.0  # fraction of each prompt's blocks to offload, front first
    max_offload_tokens: int | None = None


@dataclass(frozen=True)
class StatsConfig:
    snapshot_path: Path | None = None
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.snapshot_path is not None:
            object.__setattr__(self, "snapshot_path", Path(self.snapshot_path))


@dataclass(frozen=True)
class KvtierConfig:
    block_tokens: int = 16
    cpu: CpuTierConfig = field(default_factory=lambda: CpuTierConfig(DEFAULT_CPU_CAPACITY))
    disk: DiskTierConfig | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    source: str = "<defaults>"
    origins: Mapping[str, Origin] = field(default_factory=dict, compare=False, repr=False)

    def _error(self, key: str, problem: str, allowed: str) -> ConfigError:
        file, line, label = self.origins.get(key, (self.source, None, key))
        return ConfigError(problem, file=file, line=line, key=label, allowed=allowed)

    def check_block_bytes(self, block_bytes: int) -> None:
        """Fail if a tier cannot hold one block of ``block_bytes`` (known once the model is)."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        one = f"at least one block: {format_size(block_bytes)} ({block_bytes} bytes)"
        tiers = [("tiers.cpu.capacity", self.cpu.capacity)]
        if self.disk is not None:
            tiers.append(("tiers.disk.capacity", self.disk.capacity))
        for key, value in tiers:
            if value < block_bytes:
                raise self._error(
                    key, f"{format_size(value)} is smaller than one kvtier block", one
                )

    def cpu_slots(self, block_bytes: int) -> int:
        return self.cpu.capacity // block_bytes

    def disk_blocks(self, block_bytes: int) -> int:
        """Blocks the disk tier holds uncompressed (compression only adds headroom)."""
        return 0 if self.disk is None else self.disk.capacity // block_bytes

    def snapshot_path(self) -> Path | None:
        if self.stats.snapshot_path is not None:
            return self.stats.snapshot_path
        return None if self.disk is None else self.disk.path / STATS_FILE_NAME

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (sizes in bytes, paths as strings) for stats and benchmark output."""
        out = asdict(self)
        out.pop("origins")
        if self.disk is not None:
            out["disk"]["path"] = str(self.disk.path)
        snapshot = self.stats.snapshot_path
        out["stats"]["snapshot_path"] = None if snapshot is None else str(snapshot)
        return out
