"""Blocking RESP connections to the shared tier's nodes, and which node serves a key.

Shared by what moves blocks (:mod:`.block_io`, in the I/O processes) and what asks which
blocks are held (:mod:`.exists`, in the scheduler's asker thread): both pipeline plain RESP
commands on sockets they own, without an event loop. Connections are kept per node and lane,
opened (and authenticated) on first use, and dropped on any connection or protocol error; with
a Cluster the slot map is read once and again after the caller reports a ``MOVED``.
"""

from __future__ import annotations

from typing import Sequence
from urllib.parse import urlsplit

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.resp import Endpoint, ProtocolError, RespConnection, RespError
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.slots import SlotMap

Node = tuple[str, int]


class NodeConnections:
    def __init__(self, cfg: RemoteTierConfig, secrets: RemoteSecrets) -> None:
        self.cfg = cfg
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

    def _endpoint(self, node: Node) -> Endpoint:
        return Endpoint(node[0], node[1], username=self.secrets.username,
                        password=self.secrets.password, tls=self._tls,
                        connect_timeout_s=self.cfg.connect_timeout_s,
                        timeout_s=self.cfg.timeout_s)

    def conn(self, node: Node, lane: int = 0) -> RespConnection:
        conn = self._conns.get((node, lane))
        if conn is None or conn.broken:
            if conn is not None:
                conn.close()
            conn = RespConnection(self._endpoint(node))
            if not self.cfg.cluster and self._db:
                conn.call("SELECT", self._db)
            self._conns[(node, lane)] = conn
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
                raise ConnectionError(f"no Cluster node answered CLUSTER SLOTS: {last}")
        return self._slots

    def primaries(self) -> list[Node]:
        return self._slot_map().primaries if self.cfg.cluster else list(self.seeds)

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
            if node is not None:
                groups.setdefault(node, []).append(i)
        return groups

    def close(self) -> None:
        for node in {node for node, _ in self._conns}:
            self.drop(node)
