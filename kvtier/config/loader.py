"""Reads kvtier settings from YAML, a dict or defaults, applies environment overrides, validates.

The YAML is only *composed* (safe node tree with line numbers), never loaded with a general
loader, and only scalar values are converted (by PyYAML's SafeConstructor), so no tag can run
code and alias bombs are never expanded: the reader only descends where the schema expects a
section. Every value keeps where it came from (file and line, or the environment variable), so
the first problem found is reported as one precise ``ConfigError`` and later checks
(``KvtierConfig.check_block_bytes``) can still cite the line.

Relative paths in a YAML file are taken relative to that file's directory; elsewhere
(inline text, dicts, environment) relative to the current directory.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvtier.config.env import ENV_OVERRIDES
from kvtier.config.errors import ConfigError
from kvtier.config.schema import (
    ADMISSION_POLICIES,
    COMPRESSIONS,
    DEFAULT_CPU_CAPACITY,
    DEFAULT_DISK_CAPACITY,
    DEFAULT_EVENTS_BUFFER_BATCHES,
    DEFAULT_EVENTS_ENDPOINT,
    DEFAULT_METRICS_HOST,
    DEFAULT_METRICS_PORT,
    DEFAULT_PRIOR_LOAD_GBPS,
    DEFAULT_SEGMENT_BYTES,
    ENDPOINT_ALLOWED,
    EVICTION_POLICIES,
    AdmissionConfig,
    CostConfig,
    CpuTierConfig,
    DiskTierConfig,
    EventsConfig,
    KvtierConfig,
    MetricsConfig,
    StatsConfig,
    endpoint_problem,
    endpoints_clash,
)
from kvtier.config.sizes import parse_size

SIZE_ALLOWED = "a size such as 512MiB, 32GiB, 2TB or plain bytes"
_POLICY = "eviction policy"
_ADMISSION = "admission policy"

# Allowed keys of every section; a dotted name here is a section, anything else a value.
_LAYOUT: dict[str, tuple[str, ...]] = {
    "": ("block_tokens", "tiers", "admission", "stats", "events", "metrics", "cost"),
    "tiers": ("cpu", "disk"),
    "tiers.cpu": ("capacity", "eviction", "pin", "admission"),
    "tiers.disk": ("path", "capacity", "eviction", "compression", "zstd_level", "fsync",
                   "segment_bytes", "store_threshold", "admission"),
    "admission": ("store_threshold", "offload_ratio", "max_offload_tokens"),
    "stats": ("snapshot_path", "interval_s"),
    "events": ("endpoint", "replay_endpoint", "topic", "buffer_batches", "allow_remote"),
    "metrics": ("port", "host"),
    "cost": ("recompute_us_per_token", "recompute_tokens_per_s", "prior_load_gbps"),
}

# Sections that exist only when configured: a KVTIER_* variable for one of their keys enables it.
_OPTIONAL_SECTIONS = ("tiers.disk", "events", "metrics", "cost")


@dataclass(frozen=True)
class _Item:
    value: Any  # a plain value, or a yaml collection node not converted yet
    line: int | None = None  # 1-based
    env: str | None = None  # the variable that supplied it


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _describe(value: Any) -> str:
    if isinstance(value, (MappingNode, Mapping)):
        return "a mapping"
    if isinstance(value, (SequenceNode, list, tuple, set)):
        return "a list"
    if isinstance(value, ScalarNode):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    try:
        text = repr(value)
    except ValueError:  # ints too long to print
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _suggest(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    elsewhere = [f"{s}.{name}" if s else name for s, keys in _LAYOUT.items() if name in keys]
    return f" (it belongs under {elsewhere[0]!r})" if elsewhere else ""


def _parses(text: str) -> bool:
    try:
        parse_size(text)
        return True
    except ValueError:
        return False


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Reader:
    """Collects ``{dotted key: _Item}`` from one source, then builds the config from them."""

    def __init__(self, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir
        self.items: dict[str, _Item] = {}

    def fail(self, key: str | None, item: _Item | None, problem: str,
             allowed: str | None = None) -> NoReturn:
        if item is not None and item.env:
            raise ConfigError(problem, file="<env>", key=item.env, allowed=allowed)
        line = item.line if item is not None else None
        raise ConfigError(problem, file=self.source, line=line, key=key, allowed=allowed)

    # -- collecting ---------------------------------------------------------------------------

    def collect(self, prefix: str, item: _Item) -> None:
        allowed = _LAYOUT[prefix]
        for name, key_line, raw in self._entries(prefix, item):
            key = _join(prefix, name if len(name) <= 40 else name[:37] + "...")
            if name not in allowed:
                self.fail(key, _Item(None, key_line),
                          f"unknown key {_describe(name)}{_suggest(name, allowed)}",
                          ", ".join(allowed))
            child = self._convert(key, raw, key_line)
            if key in _LAYOUT:
                if child.value is None:  # `disk:` with everything under it commented out
                    continue
                child = _Item(child.value, key_line)  # cite `disk:`, not its first entry
                self.items[key] = child
                self.collect(key, child)
            else:
                self.items[key] = child

    def _entries(self, prefix: str, item: _Item) -> list[tuple[str, int | None, Any]]:
        value = item.value
        if isinstance(value, Mapping):
            if not all(isinstance(name, str) for name in value):
                self.fail(prefix or None, item, "keys must be strings", ", ".join(_LAYOUT[prefix]))
            return [(name, item.line, raw) for name, raw in value.items()]
        if not isinstance(value, MappingNode):
            what = "this section" if prefix else "the top level"
            self.fail(prefix or None, item,
                      f"{what} must be a mapping of settings, got {_describe(value)}",
                      "a mapping with keys " + ", ".join(_LAYOUT[prefix]))
        entries, seen = [], {}
        for key_node, value_node in value.value:
            line = _line(key_node)
            if not isinstance(key_node, ScalarNode):
                self.fail(prefix or None, _Item(None, line),
                          f"keys must be plain names, got {_describe(key_node)}",
                          ", ".join(_LAYOUT[prefix]))
            name = key_node.value
            if name in seen:
                self.fail(_join(prefix, name), _Item(None, line),
                          f"duplicate key {name!r} (first at line {seen[name]})", "each key once")
            seen[name] = line
            entries.append((name, line, value_node))
        return entries

    def _convert(self, key: str, raw: Any, line: int | None) -> _Item:
        if not isinstance(raw, Node):
            return _Item(raw, line)
        if not isinstance(raw, ScalarNode):  # collections stay nodes; only sections descend
            return _Item(raw, _line(raw))
        try:
            return _Item(SafeConstructor().construct_object(raw, deep=True), _line(raw))
        except Exception as exc:  # bad timestamps, unknown tags, over-long ints, ...
            reason = getattr(exc, "problem", None) or exc
            self.fail(key, _Item(None, _line(raw)), f"cannot read value {_describe(raw)}: {reason}",
                      "plain YAML values without tags")

    def apply_env(self, env: Mapping[str, str]) -> None:
        for var, (key, parse) in ENV_OVERRIDES.items():
            text = env.get(var)
            if not text:
                continue
            self.items[key] = _Item(parse(text), env=var)
            for section in _OPTIONAL_SECTIONS:
                if key.startswith(section + ".") and section not in self.items:
                    self.items[section] = _Item({}, env=var)

    # -- typed getters ------------------------------------------------------------------------

    def _number(self, key: str, default: Any, allowed: str, kinds: tuple[type, ...],
                nullable: bool = False) -> Any:
        item = self.items.get(key)
        if item is None or (nullable and item.value is None):
            return None if item is not None else default
        if isinstance(item.value, bool) or not isinstance(item.value, kinds):
            kind = "an integer" if kinds == (int,) else "a number"
            self.fail(key, item, f"must be {kind}, got {_describe(item.value)}", allowed)
        return item.value

    def get_int(self, key: str, default: int | None, low: int = 1, high: int | None = None,
                nullable: bool = False) -> Any:
        allowed = "a positive integer" if high is None else f"an integer from {low} to {high}"
        allowed += " or null" if nullable else ""
        value = self._number(key, default, allowed, (int,), nullable)
        if value is not None and (value < low or (high is not None and value > high)):
            self.fail(key, self.items[key], f"out of range, got {value}", allowed)
        return value

    def get_float(self, key: str, default: float, allowed: str,
                  ok: Callable[[float], bool]) -> float:
        value = self._number(key, default, allowed, (int, float))
        if not (math.isfinite(value) and ok(value)):
            self.fail(key, self.items[key], f"out of range, got {value}", allowed)
        return float(value)

    def get_bool(self, key: str, default: bool | None, nullable: bool = False) -> bool | None:
        item = self.items.get(key)
        if item is None or (nullable and item.value is None):
            return default if item is None else None
        if not isinstance(item.value, bool):
            allowed = "true or false" + (" or null (automatic)" if nullable else "")
            self.fail(key, item, f"must be true or false, got {_describe(item.value)}", allowed)
        return item.value

    def get_size(self, key: str, default: int) -> int:
        item = self.items.get(key)
        if item is None:
            return default
        try:
            value = parse_size(item.value)
        except ValueError:
            text = item.value if isinstance(item.value, str) else ""
            negative = text.strip().startswith("-") and _parses(text.strip()[1:])
            if not negative and not (isinstance(item.value, (int, float)) and item.value < 0):
                self.fail(key, item, f"not a valid size, got {_describe(item.value)}", SIZE_ALLOWED)
            value = -1
        if value <= 0:
            self.fail(key, item, f"must be positive, got {_describe(item.value)}", SIZE_ALLOWED)
        return value

    def get_choice(self, key: str, default: str, options: Sequence[str], what: str) -> str:
        item = self.items.get(key)
        if item is None:
            return default
        if not isinstance(item.value, str) or item.value not in options:
            hint = _suggest(item.value, options) if isinstance(item.value, str) else ""
            self.fail(key, item, f"unknown {what}, got {_describe(item.value)}{hint}",
                      ", ".join(options))
        return item.value

    def get_str(self, key: str, default: str | None, allowed: str,
                nullable: bool = False) -> str | None:
        item = self.items.get(key)
        if item is None or (nullable and item.value is None):
            return default if item is None else None
        if not isinstance(item.value, str):
            self.fail(key, item, f"must be a string, got {_describe(item.value)}", allowed)
        return item.value

    def get_endpoint(self, key: str, default: str | None, allow_remote: bool) -> str | None:
        value = self.get_str(key, default, ENDPOINT_ALLOWED, nullable=default is None)
        if value is None:
            return None
        problem = endpoint_problem(value, allow_remote)
        if problem:
            self.fail(key, self.items.get(key), problem, ENDPOINT_ALLOWED)
        return value

    def get_path(self, key: str) -> Path | None:
        item = self.items.get(key)
        if item is None or item.value is None:
            return None
        value = item.value
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            self.fail(key, item, f"must be a path, got {_describe(item.value)}",
                      "a file system path")
        path = Path(os.path.expanduser(value))
        base = self.base_dir if (self.base_dir is not None and item.env is None) else Path.cwd()
        return base / path  # an absolute `path` replaces `base`

    def writable_dir(self, key: str, path: Path) -> Path:
        item = self.items[key]
        try:
            if path.exists() and not path.is_dir():
                self.fail(key, item, f"{str(path)!r} exists and is not a directory",
                          "a writable directory")
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            self.fail(key, item, f"cannot create directory {str(path)!r}: {exc.strerror or exc}",
                      "a writable directory")
        if not os.access(path, os.W_OK | os.X_OK):
            self.fail(key, item, f"directory {str(path)!r} is not writable", "a writable directory")
        return path

    # -- building -----------------------------------------------------------------------------

    def build(self) -> KvtierConfig:
        block_tokens = self.get_int("block_tokens", 16)
        cpu = CpuTierConfig(
            capacity=self.get_size("tiers.cpu.capacity", DEFAULT_CPU_CAPACITY),
            eviction=self.get_choice("tiers.cpu.eviction", "lru", EVICTION_POLICIES, _POLICY),
            pin=self.get_bool("tiers.cpu.pin", None, nullable=True),
            admission=self.get_choice("tiers.cpu.admission", "all", ADMISSION_POLICIES,
                                      _ADMISSION),
        )
        disk = self.build_disk() if "tiers.disk" in self.items else None
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
        origins = {
            key: ("<env>", None, item.env) if item.env else (self.source, item.line, key)
            for key, item in self.items.items()
        }
        return KvtierConfig(block_tokens=block_tokens, cpu=cpu, disk=disk, admission=admission,
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

    def build_disk(self) -> DiskTierConfig:
        path = self.get_path("tiers.disk.path")
        if path is None:
            where = self.items.get("tiers.disk.path") or self.items["tiers.disk"]
            self.fail("tiers.disk.path", where, "the disk tier needs a directory",
                      "a writable directory path")
        threshold = self.get_int("tiers.disk.store_threshold", 1)
        return DiskTierConfig(
            path=self.writable_dir("tiers.disk.path", path),
            capacity=self.get_size("tiers.disk.capacity", DEFAULT_DISK_CAPACITY),
            eviction=self.get_choice("tiers.disk.eviction", "lru", EVICTION_POLICIES, _POLICY),
            compression=self.get_choice("tiers.disk.compression", "none", COMPRESSIONS,
                                        "compression"),
            zstd_level=self.get_int("tiers.disk.zstd_level", 1, 1, 22),
            fsync=self.get_bool("tiers.disk.fsync", True),
            segment_bytes=self.get_size("tiers.disk.segment_bytes", DEFAULT_SEGMENT_BYTES),
            store_threshold=threshold,
            admission=self.disk_admission(threshold),
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
) -> KvtierConfig:
    """Validated config from a YAML file, YAML text, a parsed dict (vLLM's
    ``kv_connector_extra_config``) or defaults, with ``KVTIER_*`` overrides from ``env``
    (``os.environ`` by default). Raises ``ConfigError`` for the first problem found."""
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
    reader = _Reader(source, base_dir)
    if root is not None:
        reader.collect("", root)
    reader.apply_env(os.environ if env is None else env)
    return reader.build()
