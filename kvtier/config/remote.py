"""``tiers.remote``: the shared tier on Redis / Valkey (standalone or Cluster).

Kept apart from ``schema.py`` / ``loader.py`` because it has its own vocabulary (server
addresses, timeouts, a namespace) and its own budget rule: ``capacity`` is only advisory. The
real budget is the server's ``maxmemory`` with ``maxmemory-policy allkeys-lru``: many
instances share the server, so none of them can count what it holds; a key the server evicted
is simply a miss. Reading the section from YAML is :mod:`kvtier.config.remote_reader`.

Timeouts are explicit and short on purpose: redis-py's defaults wait forever on a hung server
(no socket timeout) or retry for ~25 s, and the tier sits under a scheduler that must not stall.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvtier.config.redact_url import redact_address

REMOTE_BACKENDS = ("redis",)
REMOTE_KEYS = ("backend", "url", "nodes", "namespace", "connect_timeout_s", "timeout_s",
               "retries", "probe_interval_s", "compression", "zstd_level", "admission",
               "store_threshold", "capacity", "max_writes_in_flight", "lookup_ttl_s",
               "io_processes", "connections", "username", "password_file", "password_env", "tls",
               "tls_ca_file", "auth_key_file", "allow_unlisted_nodes", "lookup_deadline_s")
URL_ALLOWED = "redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB] (Redis or Valkey)"
NODE_ALLOWED = "a list of HOST:PORT strings (any reachable Cluster nodes)"
NAMESPACE_ALLOWED = "1-64 characters from A-Z a-z 0-9 . _ - : (or leave it out: derived)"
NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


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
    io_processes: int = 8  # child processes per worker that move block bytes (tiers/remote/io/process.py)
    connections: int = 4  # per I/O process and server node: a server serves each one at a
    # bounded rate, so one hit's blocks go over several at once
    username: str | None = None  # ACL user (the password never sits in the YAML)
    password_file: str | None = None  # a file holding the password (first line)
    password_env: str | None = None  # or the environment variable that holds it
    tls: bool = False  # TLS to every node (rediss:// in url says the same)
    tls_ca_file: str | None = None  # CA bundle that signed the server's certificate
    auth_key_file: str | None = None  # key of the keyed MAC every record carries (optional)
    # a Cluster node the slot map names but nobody configured gets no AUTH and no SET unless
    # this says so; None: allowed only with TLS (whose host-name check vouches for the node)
    allow_unlisted_nodes: bool | None = None
    lookup_deadline_s: float = 0.5  # a presence lookup not answered by then is a miss

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.nodes):
            raise ValueError("tiers.remote needs exactly one of url and nodes")
        if self.backend not in REMOTE_BACKENDS:
            raise ValueError(f"tiers.remote.backend: unknown backend {self.backend!r}")
        object.__setattr__(self, "nodes", tuple(self.nodes))

    @property
    def cluster(self) -> bool:
        return bool(self.nodes)

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url or "").startswith("rediss://")

    @property
    def unlisted_nodes_allowed(self) -> bool:
        """Whether a node the slot map names, outside ``nodes``, may be sent credentials and
        values: said so, or TLS on (the certificate's host name is checked)."""
        if self.allow_unlisted_nodes is not None:
            return self.allow_unlisted_nodes
        return self.uses_tls


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a usable server URL, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("redis", "rediss"):
        return f"unsupported scheme {parts.scheme!r}"
    if parts.password is not None or parts.username is not None:
        return ("credentials in the URL (they would sit in the YAML in clear): give "
                "username, and password_file or password_env")
    if not parts.hostname:
        return "no host"
    if port is None:
        return "no port"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"database {db!r} is not a number"
    return None


def node_problem(node: object) -> str | None:
    """Why ``node`` is not a usable ``HOST:PORT``, or None; the message never repeats a
    password written into the entry."""
    if not isinstance(node, str):
        return "must be a HOST:PORT string"
    if "@" in node:
        return (f"credentials in a node address ({redact_address(node)!r}): give username, "
                "and password_file or password_env")
    host, colon, port = node.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return f"{node!r} is not HOST:PORT"
    return None
