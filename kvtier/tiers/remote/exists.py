"""Which of many keys the shared tier holds: pipelined EXISTS on plain RESP connections.

Why not the asyncio client (redis-py) that the store's upkeep uses: a lookup asks one EXISTS
per block (2,048 for a 32k-token prompt of 16-token blocks), and each command there is a
coroutine and a future on a loop thread that must win the GIL from vLLM's busy engine loop
for every step of every command. Beside vLLM's engine loop a lookup's answer took longer that
way than recomputing the prompt. Here the directory's asker thread sends every key's
EXISTS to its node in one write and reads the integer replies back in order: a few system
calls and a parse per buffer read, and the thread blocks in the kernel (GIL released)
meanwhile. The pipeline is built as one buffer and its replies parsed in bulk: built and read
command by command, a 2,048-key lookup cost about ten times the Python, every slice of which
had to be won back from the engine loop at the GIL switch interval (docs/design-measurements.md).

Failures are contained as in the store: a key whose node failed reads ``None`` (absent); if
every node failed, the tier is marked degraded (``RemoteHealth``) and later lookups answer
"absent" without touching a socket until a probe finds the server again.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.nodes import NodeConnections
from kvtier.tiers.remote.resp import ProtocolError, RespError, key_commands
from kvtier.tiers.remote.secrets import RemoteSecrets


class PresenceQueries:
    def __init__(self, cfg: RemoteTierConfig, secrets: RemoteSecrets, health: RemoteHealth,
                 on_error: Callable[[str], None] = lambda why: None) -> None:
        self.nodes = NodeConnections(cfg, secrets)
        self.health = health
        self.on_error = on_error  # counted with the store's errors (stats)

    def count_present(self, key_groups: Sequence[Sequence[bytes]]) -> list[int | None]:
        """How many keys of each group exist; None where a key's command failed."""
        if self.health.degraded:  # no socket touched until a probe finds the server again
            return [None] * len(key_groups)
        flat = [k for group in key_groups for k in group]
        found: list[int | None] = [None] * len(flat)
        try:
            by_node = self.nodes.by_node(flat)
        except ConnectionError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return [None] * len(key_groups)
        answered = not by_node
        for node, positions in by_node.items():
            try:
                conn = self.nodes.conn(node)
                conn.send([[key_commands(b"EXISTS", [flat[i] for i in positions])]])
                for i, reply in zip(positions, conn.read_integers(len(positions))):
                    if isinstance(reply, RespError):  # this key only (MOVED: map read again)
                        if reply.moved:
                            self.nodes.forget_slots()
                        self.on_error(f"RespError: {reply}"[:300])
                    else:
                        found[i] = reply
                answered = True
            except (OSError, ProtocolError, ValueError, TypeError) as exc:
                self.nodes.drop(node)
                self.on_error(f"{node[0]}:{node[1]}: {type(exc).__name__}: {exc}"[:300])
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

    def _failed(self, why: str) -> None:
        self.on_error(why[:300])
        self.health.failed(f"presence: {why}"[:300])

    def close(self) -> None:
        self.nodes.close()
