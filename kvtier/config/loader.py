"""Reads kvtier settings from YAML, a dict or defaults, applies environment overrides, validates.

The YAML is only *composed* (safe node tree with line numbers), never loaded with a general
loader, and only scalar values are converted (by PyYAML's SafeConstructor), so no tag can run
code and alias bombs are never expanded: the reader only descends where the schema expects a
section. Every value keeps where it came from (file and line, or the environment variable), so
the first problem found is reported as one precise ``ConfigError`` and later checks
(``KvtierConfig.check_block_bytes``) can still cite the line.

Relative paths in a YAML file are taken relative to that file's directory; elsewhere
(inline text, dicts, environment) relative to the current directory.

Nothing is created until every value is valid: a refused config leaves no ``tiers.disk.path``
behind, and a CPU tier larger than the machine's memory is refused here, not by the OOM killer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml
from yaml.nodes import ScalarNode

from kvtier.config.errors import ConfigError
from kvtier.config.machine import make_private_dir, physical_memory
from kvtier.config.remote_reader import build_remote
from kvtier.config.reader import (
    _ADMISSION,
    _POLICY,
    SIZE_ALLOWED,
    _describe,
    _Item,
    _line,
    _Reader,
)
from kvtier.config.schema import (
    MAX_BLOCK_TOKENS,
    ADMISSION_POLICIES,
    COMPRESSIONS,
    DEFAULT_CPU_CAPACITY,
    DEFAULT_DISK_CAPACITY,
    DEFAULT_EVENTS_BUFFER_BATCHES,
    DEFAULT_EVENTS_MAX_SUBSCRIBERS,
    DEFAULT_EVENTS_REPLAY_CLIENT_MAX_BYTES,
    DEFAULT_EVENTS_REPLAY_MAX_BYTES,
    DEFAULT_EVENTS_REPLAY_MAX_CLIENTS,
    DEFAULT_EVENTS_STALL_TIMEOUT_S,
    DEFAULT_EVENTS_SUBSCRIBER_MAX_BYTES,
    DEFAULT_EVENTS_ENDPOINT,
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    MAX_GIL_SWITCH_INTERVAL_MS,
    DEFAULT_METRICS_HOST,
    DEFAULT_METRICS_PORT,
    DEFAULT_PIN_WAIT_S,
    DEFAULT_PRIOR_LOAD_GBPS,
    DEFAULT_SEGMENT_BYTES,
    EVICTION_POLICIES,
    STORE_COPIES,
    AdmissionConfig,
    CostConfig,
    CpuTierConfig,
    DiskTierConfig,
    HostTierConfig,
    default_host_dir,
    EventsConfig,
    KvtierConfig,
    MetricsConfig,
    StatsConfig,
    endpoints_clash,
)
from kvtier.config.sizes import format_size


class _Builder(_Reader):
    """Builds the frozen config objects from the collected values."""

    create_dirs = True  # False: a reader of the config (kvtier stats) creates nothing

    def writable_dir(self, key: str, path: Path) -> Path:
        item = self.items[key]
        try:
            if path.exists() and not path.is_dir():
                self.fail(key, item, f"{str(path)!r} exists and is not a directory",
                          "a writable directory")
            make_private_dir(path)
        except OSError as exc:
            self.fail(key, item, f"cannot create directory {str(path)!r}: {exc.strerror or exc}",
                      "a writable directory")
        if not os.access(path, os.W_OK | os.X_OK):
            self.fail(key, item, f"directory {str(path)!r} is not writable", "a writable directory")
        return path

    def cpu_capacity(self) -> int:
        """The CPU pool is allocated in full: more than the machine's memory cannot work. Only
        an explicit value is checked (the 4GiB default stays usable on a small machine, where a
        block-size check or the pool's own allocation error reports it)."""
        key = "tiers.cpu.capacity"
        capacity = self.get_size(key, DEFAULT_CPU_CAPACITY)
        memory = physical_memory()
        if key in self.items and memory is not None and capacity > memory:
            self.fail(key, self.items[key],
                      f"{format_size(capacity)} is more than this machine's memory "
                      f"({format_size(memory)})", f"{SIZE_ALLOWED}, below {format_size(memory)}")
        return capacity

    # -- building -----------------------------------------------------------------------------

    def build(self) -> KvtierConfig:
        block_tokens = self.get_int("block_tokens", 16, high=MAX_BLOCK_TOKENS)
        switch_ms = self.get_float("gil_switch_interval_ms", DEFAULT_GIL_SWITCH_INTERVAL_MS,
                                   "a number of milliseconds from 0 (leave Python's) to "
                                   f"{MAX_GIL_SWITCH_INTERVAL_MS:g}",
                                   lambda ms: 0 <= ms <= MAX_GIL_SWITCH_INTERVAL_MS)
        cpu = CpuTierConfig(
            capacity=self.cpu_capacity(),
            eviction=self.get_choice("tiers.cpu.eviction", "lru", EVICTION_POLICIES, _POLICY),
            pin=self.get_bool("tiers.cpu.pin", None, nullable=True),
            admission=self.get_choice("tiers.cpu.admission", "all", ADMISSION_POLICIES,
                                      _ADMISSION),
            pin_wait_s=self.get_float("tiers.cpu.pin_wait_s", DEFAULT_PIN_WAIT_S,
                                      "a number of seconds >= 0",
                                      lambda s: s >= 0),
            store_copy=self.get_choice("tiers.cpu.store_copy", "kernel", STORE_COPIES,
                                       "store copy path"),
        )
        disk = self.build_disk() if "tiers.disk" in self.items else None
        host = self.build_host(cpu.capacity) if "tiers.host" in self.items else None
        remote = (build_remote(self, ADMISSION_POLICIES, COMPRESSIONS)
                  if "tiers.remote" in self.items else None)
        admission = AdmissionConfig(
            store_threshold=self.get_int("admission.store_threshold", 1),
            offload_ratio=self.get_float("admission.offload_ratio", 1.0, "a number in (0, 1]",
                                     lambda r: 0 < r <= 1),
            max_offload_tokens=self.get_int("admission.max_offload_tokens", None, nullable=True),
        )
        stats = StatsConfig(
            snapshot_path=self.get_path("stats.snapshot_path"),
            interval_s=self.get_float("stats.interval_s", 1.0, "a positive number of seconds",
                                  lambda s: s > 0),
        )
        events = self.build_events() if "events" in self.items else None
        metrics = self.build_metrics() if "metrics" in self.items else None
        cost = self.build_cost() if "cost" in self.items else None
        if disk is not None and self.create_dirs:  # last: only a config that is valid in
            self.writable_dir("tiers.disk.path", disk.path)  # full creates anything
        origins = {
            key: ("<env>", None, item.env) if item.env else (self.source, item.line, key)
            for key, item in self.items.items()
        }
        return KvtierConfig(block_tokens=block_tokens, gil_switch_interval_ms=switch_ms,
                            cpu=cpu, disk=disk, remote=remote, host=host, admission=admission,
                            stats=stats, events=events, metrics=metrics, cost=cost,
                            source=self.source,
                            origins=origins)

    def build_events(self) -> EventsConfig:
        allow_remote = self.get_bool("events.allow_remote", False)
        endpoint = self.get_endpoint("events.endpoint", DEFAULT_EVENTS_ENDPOINT, allow_remote)
        replay = self.get_endpoint("events.replay_endpoint", None, allow_remote)
        if endpoints_clash(endpoint, replay):
            self.fail("events.replay_endpoint", self.items["events.replay_endpoint"],
                      "must differ from events.endpoint", "a second endpoint or null")
        topic = self.get_str("events.topic", "", "a string (ZMQ topic prefix; '' = no topic)")
        if len(topic.encode()) > 255:
            self.fail("events.topic", self.items["events.topic"], "longer than 255 bytes",
                      "a short string")
        return EventsConfig(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=topic,
            buffer_batches=self.get_int("events.buffer_batches", DEFAULT_EVENTS_BUFFER_BATCHES,
                                        1, 10_000_000),
            allow_remote=allow_remote,
            max_subscribers=self.get_int("events.max_subscribers",
                                         DEFAULT_EVENTS_MAX_SUBSCRIBERS, 1, 1024),
            subscriber_max_bytes=self.get_size("events.subscriber_max_bytes",
                                               DEFAULT_EVENTS_SUBSCRIBER_MAX_BYTES),
            replay_max_bytes=self.get_size("events.replay_max_bytes",
                                           DEFAULT_EVENTS_REPLAY_MAX_BYTES),
            replay_max_clients=self.get_int("events.replay_max_clients",
                                            DEFAULT_EVENTS_REPLAY_MAX_CLIENTS, 1, 1024),
            replay_client_max_bytes=self.get_size("events.replay_client_max_bytes",
                                                  DEFAULT_EVENTS_REPLAY_CLIENT_MAX_BYTES),
            stall_timeout_s=self.get_float("events.stall_timeout_s",
                                           DEFAULT_EVENTS_STALL_TIMEOUT_S,
                                           "seconds, from 0.1 to 3600",
                                           lambda s: 0.1 <= s <= 3600),
        )

    def build_metrics(self) -> MetricsConfig:
        host = self.get_str("metrics.host", DEFAULT_METRICS_HOST, "a host name or IP address")
        if not host.strip() or any(c.isspace() or c in "/?#@" for c in host):
            self.fail("metrics.host", self.items["metrics.host"],
                      f"not a host name or address, got {_describe(host)}",
                      "a host name or IP address such as 127.0.0.1 or 0.0.0.0")
        return MetricsConfig(
            port=self.get_int("metrics.port", DEFAULT_METRICS_PORT, 0, 65535),
            host=host,
        )

    def build_cost(self) -> CostConfig:
        us, tps = "cost.recompute_us_per_token", "cost.recompute_tokens_per_s"
        both = "exactly one of recompute_us_per_token and recompute_tokens_per_s"
        if (us in self.items) == (tps in self.items):
            key = tps if tps in self.items else "cost"
            self.fail(key, self.items[key], "give the engine's recompute speed once", both)
        positive = "a positive number"
        if us in self.items:
            per_token = self.get_float(us, 0.0, positive + " of microseconds", lambda v: v > 0)
        else:
            per_token = 1e6 / self.get_float(tps, 0.0, positive + " of tokens per second",
                                             lambda v: v > 0)
        return CostConfig(
            recompute_us_per_token=per_token,
            prior_load_gbps=self.get_float("cost.prior_load_gbps", DEFAULT_PRIOR_LOAD_GBPS,
                                           positive + " of GB/s", lambda v: v > 0),
        )

    def disk_admission(self, store_threshold: int) -> str:
        """``store_threshold`` > 1 alone means threshold admission; naming another policy next
        to it is a contradiction, reported rather than guessed."""
        key = "tiers.disk.admission"
        if key not in self.items:
            return "threshold" if store_threshold > 1 else "all"
        name = self.get_choice(key, "all", ADMISSION_POLICIES, _ADMISSION)
        if name != "threshold" and store_threshold > 1:
            self.fail(key, self.items[key],
                      f"{name!r} contradicts store_threshold: {store_threshold}",
                      "threshold (or drop store_threshold)")
        return name

    def build_host(self, cpu_capacity: int) -> HostTierConfig:
        """``tiers.host``: the pool holds at least this instance's region (its CPU tier) and
        fits in this machine's memory."""
        key = "tiers.host.capacity"
        if key not in self.items:  # named where the section came from (a KVTIER_HOST_* too)
            given = next((self.items[k] for k in self.items if k.startswith("tiers.host.")),
                         self.items.get("tiers.host"))
            self.fail(key, given, "tiers.host needs capacity (KVTIER_HOST_CAPACITY): the "
                      "host tier's pool size", SIZE_ALLOWED)
        capacity = self.get_size(key, 0)
        memory = physical_memory()
        if memory is not None and capacity > memory:
            self.fail(key, self.items[key], f"{format_size(capacity)} is more than this "
                      f"machine's memory ({format_size(memory)})",
                      f"{SIZE_ALLOWED}, below {format_size(memory)}")
        if capacity < cpu_capacity:
            self.fail(key, self.items[key], f"{format_size(capacity)} cannot hold this "
                      f"instance's region, tiers.cpu.capacity = {format_size(cpu_capacity)}",
                      f"{SIZE_ALLOWED}, at least tiers.cpu.capacity (the sum over the "
                      "host's instances)")
        group = self.get_str("tiers.host.group", None, "a group name or null", nullable=True)
        return HostTierConfig(
            capacity=capacity,
            dir=self.get_path("tiers.host.dir") or default_host_dir(),
            group=group,
            idle_exit_s=self.get_float("tiers.host.idle_exit_s", 600.0,
                                       "a number of seconds >= 0", lambda s: s >= 0),
        )

    def build_disk(self) -> DiskTierConfig:
        path = self.get_path("tiers.disk.path")
        if path is None:
            where = self.items.get("tiers.disk.path") or self.items["tiers.disk"]
            self.fail("tiers.disk.path", where, "the disk tier needs a directory",
                      "a writable directory path")
        threshold = self.get_int("tiers.disk.store_threshold", 1)
        return DiskTierConfig(
            path=path,
            capacity=self.get_size("tiers.disk.capacity", DEFAULT_DISK_CAPACITY),
            eviction=self.get_choice("tiers.disk.eviction", "lru", EVICTION_POLICIES, _POLICY),
            compression=self.get_choice("tiers.disk.compression", "none", COMPRESSIONS,
                                        "compression"),
            zstd_level=self.get_int("tiers.disk.zstd_level", 1, 1, 22),
            fsync=self.get_bool("tiers.disk.fsync", True),
            segment_bytes=self.get_size("tiers.disk.segment_bytes", DEFAULT_SEGMENT_BYTES),
            store_threshold=threshold,
            admission=self.disk_admission(threshold),
            io_process=self.get_bool("tiers.disk.io_process", True),
            request_timeout_s=self.get_float("tiers.disk.request_timeout_s", 5.0,
                                             "seconds, from 0.1 to 3600",
                                             lambda s: 0.1 <= s <= 3600),
        )



def _compose(text: str, source: str) -> _Item | None:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        where = f" at column {col}" if col else ""
        raise ConfigError(f"invalid YAML{where}: {exc.problem or exc.context}",
                          file=source, line=line) from None
    except yaml.YAMLError as exc:  # e.g. control characters the reader refuses
        raise ConfigError(f"invalid YAML: {exc}", file=source) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", file=source) from None
    if node is None or (isinstance(node, ScalarNode) and node.tag.endswith(":null")):
        return None  # an empty document ("---") means defaults, like an empty file
    return _Item(node, _line(node))


def load_config(
    path: str | os.PathLike | None = None,
    *,
    text: str | None = None,
    data: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    create_dirs: bool = True,
) -> KvtierConfig:
    """Validated config from a YAML file, YAML text, a parsed dict (vLLM's
    ``kv_connector_extra_config``) or defaults, with ``KVTIER_*`` overrides from ``env``
    (``os.environ`` by default). Raises ``ConfigError`` for the first problem found.

    ``create_dirs``: create the disk tier's directory (and check it is writable), as a config
    that will run does; False for a command that only reads what the config names."""
    if sum(x is not None for x in (path, text, data)) > 1:
        raise TypeError("load_config takes at most one of path, text and data")
    root: _Item | None = None
    base_dir: Path | None = None
    if path is not None:
        source, base_dir = os.fspath(path), Path(os.path.abspath(path)).parent
        try:
            raw = Path(path).read_bytes().decode("utf-8")
        except OSError as exc:
            problem = f"cannot read config file: {exc.strerror or exc}"
            raise ConfigError(problem, file=source) from None
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 text (bad byte at offset {exc.start})"
            raise ConfigError(problem, file=source) from None
        root = _compose(raw, source)
    elif text is not None:
        source = "<inline>"
        root = _compose(text, source)
    elif data is not None:
        source, root = "<extra_config>", _Item(data)
    else:
        source = "<defaults>"
    reader = _Builder(source, base_dir)
    reader.create_dirs = create_dirs
    if root is not None:
        reader.collect("", root)
    reader.apply_env(os.environ if env is None else env)
    return reader.build()

