"""The config reader's mechanics: walking the YAML node tree (or a dict) into ``{dotted key:
value with its origin}``, environment overrides, and typed getters that fail with a precise
``ConfigError``. Split from ``loader.py``, which builds the config objects from these values.

Every getter bounds what it accepts, not only its type: a value is later used to size memory
(tier indexes, the CPU pool) or printed, so a 5,000-digit integer, ``1.5e99GiB`` or ``1e400``
must end as a ``ConfigError`` here, never as an OverflowError or MemoryError deep inside.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvtier.config.env import ENV_OVERRIDES
from kvtier.config.errors import ConfigError
from kvtier.config.remote import REMOTE_KEYS
from kvtier.config.schema import ENDPOINT_ALLOWED, MAX_SIZE, endpoint_problem
from kvtier.config.sizes import format_size, parse_size

MAX_INT = (1 << 62) - 1  # counts, thresholds, token budgets: anything beyond is a typo

SIZE_ALLOWED = "a size such as 512MiB, 32GiB, 2TB or plain bytes"
_POLICY = "eviction policy"
_ADMISSION = "admission policy"

# Allowed keys of every section; a dotted name here is a section, anything else a value.
_LAYOUT: dict[str, tuple[str, ...]] = {
    "": ("block_tokens", "gil_switch_interval_ms", "tiers", "admission", "stats", "events",
         "metrics", "cost"),
    "tiers": ("cpu", "disk", "remote", "host"),
    "tiers.cpu": ("capacity", "eviction", "pin", "admission", "pin_wait_s", "store_copy"),
    "tiers.host": ("capacity", "dir", "group", "idle_exit_s"),
    "tiers.disk": ("path", "capacity", "eviction", "compression", "zstd_level", "fsync",
                   "segment_bytes", "store_threshold", "admission", "io_process",
                   "request_timeout_s"),
    "tiers.remote": REMOTE_KEYS,
    "admission": ("store_threshold", "offload_ratio", "max_offload_tokens"),
    "stats": ("snapshot_path", "interval_s"),
    "events": ("endpoint", "replay_endpoint", "topic", "buffer_batches", "allow_remote",
               "max_subscribers", "subscriber_max_bytes", "replay_max_bytes",
               "replay_max_clients", "replay_client_max_bytes", "stall_timeout_s"),
    "metrics": ("port", "host"),
    "cost": ("recompute_us_per_token", "recompute_tokens_per_s", "prior_load_gbps"),
}

# Sections that exist only when configured: a KVTIER_* variable for one of their keys enables it.
_OPTIONAL_SECTIONS = ("tiers.disk", "tiers.remote", "tiers.host", "events", "metrics", "cost")


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
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
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
        if high is None:
            allowed, high = "a positive integer", MAX_INT
        else:
            allowed = f"an integer from {low} to {high}"
        allowed += " or null" if nullable else ""
        value = self._number(key, default, allowed, (int,), nullable)
        if value is not None and not low <= value <= high:
            self.fail(key, self.items[key], f"out of range, got {_describe(value)}", allowed)
        return value

    def get_float(self, key: str, default: float, allowed: str,
                  ok: Callable[[float], bool]) -> float:
        value = self._number(key, default, allowed, (int, float))
        try:
            number = float(value)  # an int beyond 1e308 overflows here
        except OverflowError:
            number = math.inf
        if not (math.isfinite(number) and ok(number)):
            self.fail(key, self.items[key], f"out of range, got {_describe(value)}", allowed)
        return number

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
        if value > MAX_SIZE:
            self.fail(key, item, f"larger than {format_size(MAX_SIZE)}, got {_describe(item.value)}",
                      f"{SIZE_ALLOWED}, at most {format_size(MAX_SIZE)}")
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

