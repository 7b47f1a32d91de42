"""Blocking RESP connections to the shared tier's nodes, and which node serves a key.

Shared by what moves blocks (:mod:`.block_io`, in the I/O processes) and what asks which
blocks are held (:mod:`.exists`, in the scheduler's asker thread): both pipeline plain RESP
commands on sockets they own, without an event loop. Connections are kept per node and lane,
opened (and authenticated) on first use, and dropped on any connection or protocol error; with
a Cluster the slot map is read once and again after the caller reports a ``MOVED``.

A Cluster's slot map is the servers' word, and a hostile or confused server can name any
address in it. A node it names that ``nodes`` does not list is sent nothing (no AUTH, whose
password would go to it in clear, and no values) unless ``allow_unlisted_nodes`` (or TLS, whose
host-name check vouches for the node) allows it: its keys are left out, read as misses.
"""

from __future__ import annotations

import logging
import socket
from typing import Sequence
from urllib.parse import urlsplit

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.wire.resp import Endpoint, ProtocolError, RespConnection, RespError
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.wire.slots import SlotMap

Node = tuple[str, int]
log = logging.getLogger(__name__)


def _addresses(host: str, port: int) -> set[Node]:
    """``host`` as written and every address it resolves to (a slot map names addresses)."""
    out = {(host, port)}
    try:
        for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            out.add((str(info[4][0]), port))
    except (OSError, UnicodeError):
        pass
    return out


class NodeConnections:
    def __init__(self, cfg: RemoteTierConfig, secrets: RemoteSecrets, *,
                 log_unlisted: bool = True) -> None:
        self.cfg = cfg
        self.log_unlisted = log_unlisted  # an I/O process counts them; its parent logs
        self.deadline: float | None = None  # applied to every connection handed out
        self.secrets = secrets
        self._tls = secrets.ssl_context()
        self._conns: dict[tuple[Node, int], RespConnection] = {}  # (node, lane)
        self._slots: SlotMap | None = None
        self._db = 0
        if cfg.cluster:
            self.seeds: list[Node] = [(h, int(p)) for h, _, p in
                                      (n.rpartition(":") for n in cfg.nodes)]
        else:
            u = urlsplit(cfg.url)
            self.seeds = [(u.hostname or "127.0.0.1", u.port or 6379)]
            self._db = int(u.path.strip("/") or 0)
        self.listed: set[Node] = set()
        if cfg.cluster and not cfg.unlisted_nodes_allowed:
            for host, port in self.seeds:
                self.listed |= _addresses(host, port)
        self.unlisted: set[Node] = set()  # refused so far (each logged once)
        self._refused = 0  # keys left out for their node since the last take_refused

    def allowed(self, node: Node) -> bool:
        """Whether ``node`` may get this tier's credentials and values."""
        if not self.listed or node in self.listed:
            return True
        if node not in self.unlisted:
            self.unlisted.add(node)
            if self.log_unlisted:
                log.warning("kvtier: the Cluster slot map names %s:%d, which tiers.remote.nodes "
                            "does not list: it gets no credentials and no values (its keys "
                            "miss); list it, or set allow_unlisted_nodes", node[0], node[1])
        return False

    def take_refused(self) -> int:
        """Keys left out for an unlisted node since the last call."""
        n, self._refused = self._refused, 0
        return n

    def _endpoint(self, node: Node) -> Endpoint:
        return Endpoint(node[0], node[1], username=self.secrets.username,
                        password=self.secrets.password, tls=self._tls,
                        connect_timeout_s=self.cfg.connect_timeout_s,
                        timeout_s=self.cfg.timeout_s)

    def conn(self, node: Node, lane: int = 0) -> RespConnection:
        if not self.allowed(node):
            raise ConnectionRefusedError(f"{node[0]}:{node[1]} is not in tiers.remote.nodes")
        conn = self._conns.get((node, lane))
        if conn is None or conn.broken:
            if conn is not None:
                conn.close()
            conn = RespConnection(self._endpoint(node), self.deadline)
            if not self.cfg.cluster and self._db:
                conn.call("SELECT", self._db)
            self._conns[(node, lane)] = conn
        elif conn.deadline != self.deadline:
            conn.set_deadline(self.deadline)
        return conn

    def lanes(self, node: Node, n: int) -> list[RespConnection]:
        """Up to ``cfg.connections`` connections to ``node`` for ``n`` commands: a server
        serves each connection at a bounded rate, so a batch goes over several at once
        (command ``k`` on lane ``k % lanes``, its reply read in the same order)."""
        return [self.conn(node, j) for j in range(max(1, min(self.cfg.connections, n)))]

    def drop(self, node: Node) -> None:
        for key in [k for k in self._conns if k[0] == node]:
            self._conns.pop(key).close()

    def forget_slots(self) -> None:
        """A ``MOVED`` answer: the slot map is read again before the next command."""
        self._slots = None

    def _slot_map(self) -> SlotMap:
        if self._slots is None:
            last: Exception | None = None
            for seed in self.seeds:
                try:
                    self._slots = SlotMap(self.conn(seed).call("CLUSTER", "SLOTS"))
                    break
                except (OSError, RespError, ProtocolError, ValueError) as exc:
                    self.drop(seed)
                    last = exc
            if self._slots is None:
                raise ConnectionError(f"no Cluster node answered CLUSTER SLOTS: {last}") \
                    from last
        return self._slots

    def primaries(self) -> list[Node]:
        if not self.cfg.cluster:
            return list(self.seeds)
        return [n for n in self._slot_map().primaries if self.allowed(n)]

    def by_node(self, server_keys: Sequence[bytes]) -> dict[Node, list[int]]:
        """Positions of ``server_keys`` grouped by the node that serves them; a key of no
        node is left out (the caller treats it as lost). ``ConnectionError``: no Cluster
        node gave a slot map."""
        if not self.cfg.cluster:
            return {self.seeds[0]: list(range(len(server_keys)))}
        slots = self._slot_map()
        groups: dict[Node, list[int]] = {}
        for i, k in enumerate(server_keys):
            node = slots.node_of(k)
            if node is None:
                continue
            if not self.allowed(node):
                self._refused += 1
                continue
            groups.setdefault(node, []).append(i)
        return groups

    def close(self) -> None:
        for node in {node for node, _ in self._conns}:
            self.drop(node)
