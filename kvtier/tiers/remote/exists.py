"""Which of many keys the shared tier holds: pipelined EXISTS on plain RESP connections.

Why not the asyncio client (redis-py) that the store's upkeep uses: a lookup asks one EXISTS
per block (thousands for a long prompt), and each command there is a coroutine and a future on
a loop thread that must win the GIL from vLLM's busy engine loop for every step; a lookup then
took longer than recomputing the prompt. Here the directory's asker thread sends every key's
EXISTS to its node as one buffer and parses the integer replies in bulk: a few system calls,
blocked in the kernel (GIL released) meanwhile (docs/design-measurements.md).

Failures are contained as in the store: a key whose node failed reads ``None`` (absent); if
every node failed, the tier is marked degraded (``RemoteHealth``) and later lookups answer
"absent" without touching a socket until a probe finds the server again."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.record import HEADER_BYTES, CorruptRecord, decode_head
from kvtier.tiers.layout import LAYOUT_VERSION
from kvtier.tiers.remote.wire import failures
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.wire.nodes import NodeConnections
from kvtier.tiers.remote.wire.resp import ProtocolError, RespError, command, key_commands
from kvtier.tiers.remote.secrets import MAC_BYTES, RemoteSecrets

log = logging.getLogger(__name__)


class PresenceQueries:
    def __init__(self, cfg: RemoteTierConfig, secrets: RemoteSecrets, health: RemoteHealth,
                 on_error: Callable[[str], None] = lambda why: None) -> None:
        self.nodes = NodeConnections(cfg, secrets)
        self.secrets = secrets
        self.health = health
        self.deadline_s = cfg.lookup_deadline_s  # a whole batch: connect, slot map, replies
        self.on_error = on_error  # counted with the store's errors (stats)
        self.tls_errors = 0
        self.auth_errors = 0

    def count_present(self, key_groups: Sequence[Sequence[bytes]]) -> list[int | None]:
        """How many keys of each group exist; None where a key's command failed or its
        node did not answer within ``lookup_deadline_s`` (a slow server is a miss)."""
        if self.health.degraded:  # no socket touched until a probe finds the server again
            return [None] * len(key_groups)
        flat = [k for group in key_groups for k in group]
        found: list[int | None] = [None] * len(flat)
        self.nodes.deadline = time.monotonic() + self.deadline_s
        try:
            by_node = self.nodes.by_node(flat)
        except ConnectionError as exc:
            self._failed(exc)
            self.nodes.deadline = None
            return [None] * len(key_groups)
        answered = not by_node
        try:
            for node, positions in by_node.items():
                try:
                    conn = self.nodes.conn(node)
                    conn.send([[key_commands(b"EXISTS", [flat[i] for i in positions])]])
                    for i, reply in zip(positions, conn.read_integers(len(positions))):
                        if isinstance(reply, RespError):  # this key only (MOVED: map again)
                            if reply.moved:
                                self.nodes.forget_slots()
                            self.on_error(self.secrets.redact(f"RespError: {reply}")[:300])
                        else:
                            found[i] = reply
                    answered = True
                except (OSError, ProtocolError, ValueError, TypeError) as exc:
                    self.nodes.drop(node)
                    self._note(exc, node)
        finally:
            self.nodes.deadline = None
        if not answered:
            self.health.failed("presence: every node failed")
        if len(flat) == len(key_groups):  # one key per group (no tensor-parallel shards)
            return found
        out: list[int | None] = []
        start = 0
        for group in key_groups:
            part = found[start:start + len(group)]
            start += len(group)
            out.append(None if any(c is None for c in part) else sum(part))
        return out

    def records_held(self, server_keys: Sequence[bytes],
                     record_keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a record written for it by an instance of this tier (its
        header, identity, layout, MAC key and length check out), read from the header alone
        (GETRANGE and STRLEN, never the payload). EXISTS would count junk planted by a client
        without the MAC key, a record under an old MAC key or a truncated one as held, and
        write-back would then never replace it. False where a node failed or was slow."""
        out = [False] * len(server_keys)
        if self.health.degraded or not server_keys:
            return out
        seq = self.secrets.record_seq
        tag = MAC_BYTES if self.secrets.mac_key else 0
        self.nodes.deadline = time.monotonic() + self.deadline_s
        try:
            by_node = self.nodes.by_node(server_keys)
            for node, positions in by_node.items():
                try:
                    conn = self.nodes.conn(node)
                    conn.send([c for i in positions for c in (
                        command("GETRANGE", server_keys[i], 0,
                                HEADER_BYTES + len(record_keys[i]) - 1),
                        command("STRLEN", server_keys[i]))])
                    for i in positions:
                        head, size = self._reply(conn), self._reply(conn)
                        out[i] = self._is_record(head, size, record_keys[i], seq, tag)
                except (OSError, ProtocolError, ValueError, TypeError) as exc:
                    self.nodes.drop(node)
                    self._note(exc, node)
        except ConnectionError as exc:  # no slot map
            self._note(exc)
        finally:
            self.nodes.deadline = None
        return out

    def ping(self) -> bool:
        """A degraded tier's probe: True when some node (one ``nodes`` lists, or one the
        operator allowed) answers PING within the lookup deadline. Through these connections,
        not redis-py's Cluster client, which would AUTH to whatever node the slot map names."""
        self.nodes.deadline = time.monotonic() + self.deadline_s
        try:
            for node in self.nodes.primaries():
                try:
                    self.nodes.conn(node).call("PING")
                    return True
                except (OSError, RespError, ProtocolError) as exc:
                    self.nodes.drop(node)
                    self._note(exc, node)
        except (ConnectionError, ValueError) as exc:  # no slot map
            self._note(exc)
        finally:
            self.nodes.deadline = None
        return False

    @staticmethod
    def _reply(conn) -> object:
        try:
            return conn.read_reply()
        except RespError:  # this key only: not known to hold a record
            return None

    @staticmethod
    def _is_record(head: object, size: object, record_key: bytes, seq: int, tag: int) -> bool:
        if not isinstance(head, bytes) or not isinstance(size, int):
            return False
        try:
            h = decode_head(head, record_key)
        except CorruptRecord:
            return False
        return (h.layout_version == LAYOUT_VERSION and h.seq == seq
                and size == HEADER_BYTES + h.key_len + h.stored_len + tag)

    def _note(self, exc: BaseException, node: tuple[str, int] | None = None) -> str:
        """Count and describe a failure (TLS and AUTH named in the log once); its text."""
        what = failures.kind(exc)
        why = self.secrets.redact(failures.describe(exc))
        if node is not None:
            why = f"{node[0]}:{node[1]}: {why}"
        if what == "tls":
            self.tls_errors += 1
        elif what == "auth":
            self.auth_errors += 1
        if what is not None:
            failures.log_once(log, what, why)
        self.on_error(why[:300])
        return why

    def _failed(self, exc: BaseException) -> None:
        why = self._note(exc)
        self.health.failed(f"presence: {why}"[:300])

    def close(self) -> None:
        self.nodes.close()
