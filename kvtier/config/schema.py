"""The validated configuration: frozen dataclasses with every size already in bytes.

Everything below the loader works on these objects only, never on raw YAML. Some checks need the
model's block size, which is only known once the engine is up; ``check_block_bytes`` runs them
then and still cites the config line the value came from (kept in ``origins``).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvtier.config.errors import ConfigError
from kvtier.config.remote import RemoteTierConfig
from kvtier.config.sizes import format_size

EVICTION_POLICIES = ("lru", "arc")
"""Names the manager's policy registry provides; a test keeps the two in step."""

ADMISSION_POLICIES = ("all", "threshold", "reuse_gate")
"""Per-tier admission plug-ins (the manager's admission registry; a test keeps them in step)."""

DEFAULT_PRIOR_LOAD_GBPS = 100.0  # optimistic: an unmeasured tier is tried, then measured

COMPRESSIONS = ("none", "zstd")

STORE_COPIES = ("kernel", "dma")
"""How a store moves GPU pages to the CPU pool (kvtier/transfer/cuda/handlers.py): a gather
kernel and DMA from a staging ring, or batched DMA on the copy engines alone."""

GiB = 1 << 30
MAX_SIZE = 1 << 60  # 1 EiB: any size beyond is a typo (and overflows what sizes feed)
MAX_BLOCK_TOKENS = 1 << 20
INDEX_BYTES_PER_BLOCK = 160
"""What the manager keeps in memory per block a tier can hold (key, maps, policy lists, slot
state), measured on a full tier; ``check_block_bytes`` refuses tiers whose index would not fit."""
DEFAULT_CPU_CAPACITY = 4 * GiB
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.2  # Python's own is 5 ms: see kvtier/runtime/gil.py
MAX_GIL_SWITCH_INTERVAL_MS = 5.0  # above Python's default there is nothing to shorten
DEFAULT_DISK_CAPACITY = 64 * GiB
DEFAULT_SEGMENT_BYTES = 256 << 20
STATS_FILE_NAME = "kvtier-stats.json"
DEFAULT_EVENTS_ENDPOINT = "tcp://127.0.0.1:5570"  # vLLM's own publisher defaults to 5557
DEFAULT_EVENTS_BUFFER_BATCHES = 10_000
# what the event publisher (in vLLM's scheduler process) may hold for its clients: see
# kvtier/observe/events/peers.py and replay_streams.py, and docs/security.md
DEFAULT_EVENTS_MAX_SUBSCRIBERS = 8
DEFAULT_EVENTS_SUBSCRIBER_MAX_BYTES = 16 << 20
DEFAULT_EVENTS_REPLAY_MAX_BYTES = 64 << 20
DEFAULT_EVENTS_REPLAY_MAX_CLIENTS = 4
DEFAULT_EVENTS_REPLAY_CLIENT_MAX_BYTES = 4 << 20
DEFAULT_EVENTS_STALL_TIMEOUT_S = 10.0
DEFAULT_METRICS_PORT = 9400
DEFAULT_METRICS_HOST = "127.0.0.1"
ENDPOINT_ALLOWED = ("tcp://HOST:PORT (PORT may be * or 0 for any free port), ipc://PATH or "
                    "inproc://NAME; a host other than loopback needs allow_remote: true")

Origin = tuple[str, "int | None", str]
"""Where a value came from: (file or "<env>", 1-based line or None, key or variable name)."""


DEFAULT_PIN_WAIT_S = 120.0
"""How long vLLM's start-up (after its CUDA graph capture) waits for the CPU pool to finish
page-locking: pinning while the engine serves holds up its CUDA calls (a fresh server's first
request waited seconds), so by default a pool of tens of GiB pins before the server is up."""


@dataclass(frozen=True)
class CpuTierConfig:
    capacity: int
    eviction: str = "lru"
    pin: bool | None = None  # None: pin when CUDA is available
    admission: str = "all"  # which new blocks are written: all | threshold (2nd sighting) | reuse_gate
    pin_wait_s: float = DEFAULT_PIN_WAIT_S  # start-up waits this long for the pool's pinning
    store_copy: str = "kernel"  # kernel | dma (STORE_COPIES)


def default_host_dir() -> Path:
    """Where the host tier's socket lives unless ``tiers.host.dir`` says: per user, in
    memory (``/dev/shm``), so a reboot leaves nothing stale behind."""
    return Path(f"/dev/shm/kvtier-host-{os.getuid()}")


@dataclass(frozen=True)
class HostTierConfig:
    """One CPU pool per host shared by every instance on it (``kvtier/tiers/host/``): each
    instance's CPU tier (``tiers.cpu.capacity``) is its region of this pool."""

    capacity: int  # the whole pool: at least the sum of the instances' tiers.cpu.capacity
    dir: Path = field(default_factory=default_host_dir)
    group: str | None = None  # a group whose members' instances may share it (else: the user)
    idle_exit_s: float = 600.0  # the service exits this long after its last instance

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir))
        if not self.idle_exit_s >= 0:
            raise ValueError("tiers.host.idle_exit_s must be >= 0")


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
    admission: str = "all"  # all | threshold (store_threshold sightings, at least 2) | reuse_gate
    io_process: bool = True  # serve the store from a child process (tiers/disk/io/process.py)
    request_timeout_s: float = 5.0  # a disk I/O child slower than this is hung: replaced

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not self.request_timeout_s > 0:
            raise ValueError("tiers.disk.request_timeout_s must be > 0")


@dataclass(frozen=True)
class AdmissionConfig:
    store_threshold: int = 1  # store a block after it was seen this many times
    offload_ratio: float = 1.0  # fraction of each prompt's blocks to offload, front first
    max_offload_tokens: int | None = None


@dataclass(frozen=True)
class CostConfig:
    """Cost-aware loading: a hit is loaded only while its estimated load time (per-tier load
    bandwidth, measured) beats recomputing its tokens. Absent from the config = always load."""

    recompute_us_per_token: float  # engine prefill time per token (YAML: or recompute_tokens_per_s)
    prior_load_gbps: float = DEFAULT_PRIOR_LOAD_GBPS  # assumed until a tier's loads are measured

    def __post_init__(self) -> None:
        if not self.recompute_us_per_token > 0 or not self.prior_load_gbps > 0:
            raise ValueError("cost.recompute_us_per_token and cost.prior_load_gbps must be > 0")


@dataclass(frozen=True)
class StatsConfig:
    snapshot_path: Path | None = None
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.snapshot_path is not None:
            object.__setattr__(self, "snapshot_path", Path(self.snapshot_path))


def endpoint_problem(endpoint: object, allow_remote: bool = False) -> str | None:
    """Why ``endpoint`` cannot be bound by kvtier's event publisher, or None if it can.

    Events describe what an instance caches (block hashes, token ids), so the publisher binds
    loopback or a local socket unless the operator opted in: any tcp host that is not loopback
    (a wildcard, an interface, a routable address or a name other than localhost) is refused
    unless ``allow_remote`` is set.
    """
    if not isinstance(endpoint, str) or not endpoint:
        return "must be a non-empty string"
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return f"unsupported endpoint {endpoint!r}"
    if not rest or any(c.isspace() for c in rest) or "\0" in rest:
        return f"endpoint {endpoint!r} has no address"
    if scheme != "tcp":
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return f"tcp endpoint {endpoint!r} needs HOST:PORT"
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return f"bad port {port!r} in {endpoint!r}"
    if not allow_remote and not _is_loopback(host):
        return f"{endpoint!r} is not a loopback address; set allow_remote: true to publish on it"
    return None


def endpoints_clash(a: str | None, b: str | None) -> bool:
    """Two endpoints that cannot both be bound (the same address; any-port tcp never clashes)."""
    if a is None or b is None or a != b:
        return False
    return not (a.startswith("tcp://") and a.rpartition(":")[2] in ("0", "*"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EventsConfig:
    """The ZMQ event stream (vLLM's KV-event wire format); absent from the config = off."""

    endpoint: str = DEFAULT_EVENTS_ENDPOINT
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_batches: int = DEFAULT_EVENTS_BUFFER_BATCHES  # batches kept for replay
    allow_remote: bool = False
    max_subscribers: int = DEFAULT_EVENTS_MAX_SUBSCRIBERS  # more connections are closed
    subscriber_max_bytes: int = DEFAULT_EVENTS_SUBSCRIBER_MAX_BYTES  # queued per subscriber
    replay_max_bytes: int = DEFAULT_EVENTS_REPLAY_MAX_BYTES  # the replay buffer's bytes
    replay_max_clients: int = DEFAULT_EVENTS_REPLAY_MAX_CLIENTS  # connected replay clients
    replay_client_max_bytes: int = DEFAULT_EVENTS_REPLAY_CLIENT_MAX_BYTES  # queued per client
    stall_timeout_s: float = DEFAULT_EVENTS_STALL_TIMEOUT_S  # a client not reading is dropped

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            problem = endpoint_problem(value, self.allow_remote)
            if problem:
                raise ValueError(f"events.{name}: {problem}")
        if endpoints_clash(self.endpoint, self.replay_endpoint):
            raise ValueError("events.replay_endpoint must differ from events.endpoint")
        if self.buffer_batches < 1:
            raise ValueError("events.buffer_batches must be at least 1")
        for name in ("max_subscribers", "subscriber_max_bytes", "replay_max_bytes",
                     "replay_max_clients", "replay_client_max_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"events.{name} must be a positive integer")
        if not self.stall_timeout_s > 0:
            raise ValueError("events.stall_timeout_s must be > 0")


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint (``http://host:port/metrics``); absent from the config = off."""

    port: int = DEFAULT_METRICS_PORT  # 0: any free port (the snapshot records the real one)
    host: str = DEFAULT_METRICS_HOST


@dataclass(frozen=True)
class KvtierConfig:
    # tokens per block; under vLLM's connector, unset means vLLM's block size (given())
    block_tokens: int = 16
    # Python's GIL switch interval while kvtier runs in the process (0: leave it):
    # see kvtier/runtime/gil.py
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS
    cpu: CpuTierConfig = field(default_factory=lambda: CpuTierConfig(DEFAULT_CPU_CAPACITY))
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    host: HostTierConfig | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    events: EventsConfig | None = None
    metrics: MetricsConfig | None = None
    cost: CostConfig | None = None
    source: str = "<defaults>"
    origins: Mapping[str, Origin] = field(default_factory=dict, compare=False, repr=False)

    def given(self, key: str) -> bool:
        """Whether ``key`` was set (file, inline config or ``KVTIER_*``), not left at its
        default: vLLM's connector takes ``block_tokens`` from the engine unless it was set."""
        return key in self.origins

    def _error(self, key: str, problem: str, allowed: str) -> ConfigError:
        file, line, label = self.origins.get(key, (self.source, None, key))
        return ConfigError(problem, file=file, line=line, key=label, allowed=allowed)

    def check_block_bytes(self, block_bytes: int) -> None:
        """Fail if a tier cannot hold one block of ``block_bytes`` (known once the model is)."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        one = f"at least one block: {format_size(block_bytes)} ({block_bytes} bytes)"
        tiers = [("tiers.cpu.capacity", self.cpu.capacity)]
        if self.host is not None:
            tiers.append(("tiers.host.capacity", self.host.capacity))
        if self.disk is not None:
            tiers.append(("tiers.disk.capacity", self.disk.capacity))
        for key, value in tiers:
            if value < block_bytes:
                raise self._error(
                    key, f"{format_size(value)} is smaller than one kvtier block", one
                )
        self._check_index_memory(block_bytes)

    def _check_index_memory(self, block_bytes: int) -> None:
        """The manager indexes every block a tier can hold: ``1PiB`` of 64 KiB blocks is 16G
        entries, a MemoryError (or the OOM killer) long after start-up. Refuse a tier whose
        index alone would take more than half of this machine's memory, naming its key."""
        from kvtier.config.machine import physical_memory

        memory = physical_memory()
        if memory is None:
            return
        budget = memory // 2
        blocks = self.cpu_slots(block_bytes) + self.disk_blocks(block_bytes)
        if blocks * INDEX_BYTES_PER_BLOCK <= budget:
            return
        key = "tiers.disk.capacity" if self.disk is not None else "tiers.cpu.capacity"
        value = self.disk.capacity if self.disk is not None else self.cpu.capacity
        most = budget // INDEX_BYTES_PER_BLOCK * block_bytes
        raise self._error(
            key, f"{format_size(value)} is {blocks:,} blocks of {format_size(block_bytes)}; "
            f"indexing them takes ~{format_size(blocks * INDEX_BYTES_PER_BLOCK)} of memory, more "
            f"than half of this machine's {format_size(memory)}",
            f"tiers totalling at most {format_size(most)} at this block size")

    def host_slots(self, block_bytes: int) -> int:
        """Slots of the host tier's pool (0 without one)."""
        return 0 if self.host is None else self.host.capacity // block_bytes

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
        if self.host is not None:
            out["host"]["dir"] = str(self.host.dir)
        snapshot = self.stats.snapshot_path
        out["stats"]["snapshot_path"] = None if snapshot is None else str(snapshot)
        return out
