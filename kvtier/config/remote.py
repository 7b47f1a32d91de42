"""``tiers.remote``: the shared tier on Redis / Valkey (standalone or Cluster).

Kept apart from ``schema.py`` / ``loader.py`` because it has its own vocabulary (server
addresses, timeouts, a namespace) and its own budget rule: ``capacity`` is only advisory. The
real budget is the server's ``maxmemory`` with ``maxmemory-policy allkeys-lru``: many
instances share the server, so none of them can count what it holds; a key the server evicted
is simply a miss.

Timeouts are explicit and short on purpose: redis-py's defaults wait forever on a hung server
(no socket timeout) or retry for ~25 s, and the tier sits under a scheduler that must not stall.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from yaml.nodes import ScalarNode, SequenceNode
from yaml.constructor import SafeConstructor


if TYPE_CHECKING:  # pragma: no cover
    from kvtier.config.reader import _Reader

REMOTE_BACKENDS = ("redis",)
REMOTE_KEYS = ("backend", "url", "nodes", "namespace", "connect_timeout_s", "timeout_s",
               "retries", "probe_interval_s", "compression", "zstd_level", "admission",
               "store_threshold", "capacity", "max_writes_in_flight", "lookup_ttl_s")
URL_ALLOWED = "redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB] (Redis or Valkey)"
NODE_ALLOWED = "a list of HOST:PORT strings (any reachable Cluster nodes)"
NAMESPACE_ALLOWED = "1-64 characters from A-Z a-z 0-9 . _ - : (or leave it out: derived)"
_NAMESPACE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True)
class RemoteTierConfig:
    """The validated ``tiers.remote`` section (sizes in bytes, times in seconds)."""

    url: str | None = None  # standalone server (or one Cluster node when cluster is detected)
    nodes: tuple[str, ...] = ()  # Cluster start-up nodes, "host:port"
    backend: str = "redis"
    namespace: str | None = None  # None: derived from model, dtype, geometry, TP, hash
    connect_timeout_s: float = 0.5
    timeout_s: float = 0.5  # per command; a hung server costs at most this per try
    retries: int = 1  # extra tries after a connection error or timeout (bounded)
    probe_interval_s: float = 2.0  # while degraded: one PING this often, nothing else
    compression: str = "none"
    zstd_level: int = 1
    admission: str = "all"
    store_threshold: int = 1
    capacity: int | None = None  # advisory only: reported, never enforced by kvtier
    max_writes_in_flight: int = 256  # blocks being written to the server at once
    lookup_ttl_s: float = 2.0  # how long a presence answer from the server is trusted

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.nodes):
            raise ValueError("tiers.remote needs exactly one of url and nodes")
        if self.backend not in REMOTE_BACKENDS:
            raise ValueError(f"tiers.remote.backend: unknown backend {self.backend!r}")
        object.__setattr__(self, "nodes", tuple(self.nodes))

    @property
    def cluster(self) -> bool:
        return bool(self.nodes)


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a usable server URL, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("redis", "rediss"):
        return f"unsupported scheme {parts.scheme!r}"
    if not parts.hostname:
        return "no host"
    if port is None:
        return "no port"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"database {db!r} is not a number"
    return None


def node_problem(node: object) -> str | None:
    if not isinstance(node, str):
        return "must be a HOST:PORT string"
    host, colon, port = node.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return f"{node!r} is not HOST:PORT"
    return None


def _nodes(reader: "_Reader", key: str) -> tuple[str, ...]:
    item = reader.items[key]
    value = item.value
    if isinstance(value, SequenceNode):
        out = []
        for child in value.value:
            if not isinstance(child, ScalarNode):
                reader.fail(key, item, "every node must be a HOST:PORT string", NODE_ALLOWED)
            out.append(SafeConstructor().construct_object(child))
        value = out
    elif isinstance(value, str):  # from the environment: comma separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        reader.fail(key, item, "must be a non-empty list of HOST:PORT strings", NODE_ALLOWED)
    for node in value:
        problem = node_problem(node)
        if problem:
            reader.fail(key, item, problem, NODE_ALLOWED)
    return tuple(value)


def build_remote(reader: "_Reader", admissions: tuple[str, ...],
                 compressions: tuple[str, ...]) -> RemoteTierConfig:
    """``tiers.remote`` from the collected items; every problem is a ``ConfigError``."""
    items = reader.items
    has_url, has_nodes = "tiers.remote.url" in items, "tiers.remote.nodes" in items
    if has_url == has_nodes:
        key = "tiers.remote.nodes" if has_nodes else "tiers.remote"
        reader.fail(key, items[key], "give the server once: url (one server) or nodes "
                    "(a Cluster)", f"url: {URL_ALLOWED}, or nodes: {NODE_ALLOWED}")
    url = nodes = None
    if has_url:
        url = reader.get_str("tiers.remote.url", None, URL_ALLOWED)
        problem = url_problem(url)
        if problem:
            reader.fail("tiers.remote.url", items["tiers.remote.url"], f"{problem}: {url!r}",
                        URL_ALLOWED)
    else:
        nodes = _nodes(reader, "tiers.remote.nodes")
    namespace = reader.get_str("tiers.remote.namespace", None, NAMESPACE_ALLOWED, nullable=True)
    if namespace is not None and not _NAMESPACE.match(namespace):
        reader.fail("tiers.remote.namespace", items["tiers.remote.namespace"],
                    f"not a valid namespace: {namespace!r}", NAMESPACE_ALLOWED)
    seconds = "a positive number of seconds (at most 60)"
    threshold = reader.get_int("tiers.remote.store_threshold", 1, 1, 1000)
    admission = reader.get_choice("tiers.remote.admission",
                                  "threshold" if threshold > 1 else "all", admissions,
                                  "admission policy")
    if threshold > 1 and admission != "threshold":
        reader.fail("tiers.remote.admission", items["tiers.remote.admission"],
                    f"{admission!r} contradicts store_threshold: {threshold}",
                    "threshold (or drop store_threshold)")
    capacity = None
    if items.get("tiers.remote.capacity") is not None and \
            items["tiers.remote.capacity"].value is not None:
        capacity = reader.get_size("tiers.remote.capacity", 0)
    return RemoteTierConfig(
        url=url, nodes=nodes or (),
        backend=reader.get_choice("tiers.remote.backend", "redis", REMOTE_BACKENDS,
                                  "remote backend"),
        namespace=namespace,
        connect_timeout_s=reader.get_float("tiers.remote.connect_timeout_s", 0.5, seconds,
                                           lambda s: 0 < s <= 60),
        timeout_s=reader.get_float("tiers.remote.timeout_s", 0.5, seconds,
                                   lambda s: 0 < s <= 60),
        retries=reader.get_int("tiers.remote.retries", 1, 0, 10),
        probe_interval_s=reader.get_float("tiers.remote.probe_interval_s", 2.0,
                                          "a positive number of seconds (at most 3600)",
                                          lambda s: 0 < s <= 3600),
        compression=reader.get_choice("tiers.remote.compression", "none", compressions,
                                      "compression"),
        zstd_level=reader.get_int("tiers.remote.zstd_level", 1, 1, 22),
        admission=admission,
        store_threshold=threshold,
        capacity=capacity,
        max_writes_in_flight=reader.get_int("tiers.remote.max_writes_in_flight", 256, 1,
                                            1 << 20),
        # an answer must outlive the step between vLLM's lookup and its load planning
        lookup_ttl_s=reader.get_float("tiers.remote.lookup_ttl_s", 2.0,
                                      "a number of seconds from 0.1 to 3600",
                                      lambda s: 0.1 <= s <= 3600),
    )
