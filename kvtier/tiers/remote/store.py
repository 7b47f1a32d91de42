"""The shared tier's presence checks and upkeep: batched EXISTS / DEL / PING against Redis or
Valkey, never blocking. (Blocks themselves move through ``block_io.RemoteBlockIO`` in the I/O
processes of ``tiers/remote/io/process.py``: values never pass through this client.)

The store owns one asyncio loop in a daemon thread and the redis-py client that lives on it;
callers on any thread or loop get futures (``submit``) or await them (``call``). Each command
is bounded twice: by the client's socket timeouts and retries, and by an overall deadline here
(a Cluster client refreshing its slot map can otherwise outlast the socket timeouts).

Failures are contained. A batch in which every command failed on the connection (server down,
hung, unreachable) marks the tier degraded (``RemoteHealth``): later batches fail at once
without touching a socket, and one PING per ``probe_interval_s`` looks for recovery. A batch in
which only some commands failed (one dead Cluster primary) costs only those keys: they read as
misses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Sequence, TypeVar

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.wire import failures
from kvtier.tiers.remote.client import make_client
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.secrets import RemoteSecrets

log = logging.getLogger(__name__)
T = TypeVar("T")
_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
IN_FLIGHT = 16  # commands on the wire at once (an EXISTS of many keys is one command)


class RemoteUnavailable(Exception):
    """The shared tier is degraded (or the whole batch failed): treat as misses / not stored."""


@dataclass
class RemoteStats:
    errors: int = 0  # commands that failed on the connection or the server
    tls_errors: int = 0
    auth_errors: int = 0
    degraded: bool = False
    degradations: int = 0
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_connection_error(exc: BaseException) -> bool:
    from redis.exceptions import ConnectionError, RedisClusterException, TimeoutError

    return isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError,
                            RedisClusterException))


class RemoteStore:
    def __init__(self, cfg: RemoteTierConfig, keys: RemoteKeys, *,
                 name: str = "kvtier-remote", secrets: RemoteSecrets | None = None) -> None:
        self.cfg = cfg
        self.keys = keys
        # ACL and TLS: read once, here (a missing or exposed secret stops start-up, clearly)
        self.secrets = secrets if secrets is not None else RemoteSecrets.load(cfg)
        self.health = RemoteHealth(cfg.probe_interval_s)
        self._stats = RemoteStats()
        # a command's whole budget: connect, then every try with its backoff, plus slack
        self.deadline_s = cfg.connect_timeout_s + (cfg.retries + 1) * (cfg.timeout_s + 0.05) + 0.2
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._client: Any = None
        self._sem: asyncio.Semaphore | None = None
        self._closed = False

    # ---- plumbing ---------------------------------------------------------------------------
    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        """Run ``coro`` on the store's loop; thread-safe, returns at once."""
        if self._closed:
            coro.close()
            raise RemoteUnavailable("the remote store is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, coro: Awaitable[T]) -> T:
        """Await ``coro`` from another event loop (a transfer handler's)."""
        return await asyncio.wrap_future(self.submit(coro))

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Blocking helper for tools and tests (never on a scheduler or engine path)."""
        return self.submit(coro).result(timeout if timeout is not None else 10 * self.deadline_s)

    async def _ensure(self) -> Any:
        """The client, ready for concurrent commands. A Cluster client learns the slot map
        first, once, under a lock: redis-py's asyncio Cluster client loses commands issued
        concurrently while it is still connecting (seen with redis-py 8.1)."""
        if self._client is None:
            self._client = make_client(self.cfg, self.secrets)
            self._sem = asyncio.Semaphore(IN_FLIGHT)
            self._init_lock = asyncio.Lock()
            self._ready = not self.cfg.cluster
        if not self._ready:
            async with self._init_lock:
                if not self._ready:
                    await asyncio.wait_for(self._client.initialize(), self.deadline_s)
                    self._ready = True
        return self._client

    async def _one(self, method: str, *args: Any) -> Any:
        client = await self._ensure()
        async with self._sem:
            if _timeout is None:  # Python 3.10
                return await asyncio.wait_for(getattr(client, method)(*args), self.deadline_s)
            # no task per command (wait_for makes one): less loop work per value
            async with _timeout(self.deadline_s):
                return await getattr(client, method)(*args)

    async def _batch(self, method: str, calls: Sequence[tuple]) -> list[Any]:
        """Run one command per entry of ``calls``; results, or the exception of each."""
        if not calls:
            return []
        if self.health.degraded and not await self._probe_if_due():
            self._sync_health()
            raise RemoteUnavailable(f"degraded: {self.health.last_error}")
        out = await asyncio.gather(*(self._one(method, *c) for c in calls),
                                   return_exceptions=True)
        failed = [r for r in out if isinstance(r, BaseException)]
        for exc in failed:
            if isinstance(exc, asyncio.CancelledError):
                raise exc
            self._failure(exc)
        conn = [e for e in failed if _is_connection_error(e)]
        if conn and len(conn) == len(out):
            self.health.failed(self._stats.last_error)
            log.warning("kvtier: remote tier degraded (%s); local tiers keep serving",
                        self._stats.last_error)
        self._sync_health()
        return out

    async def _probe_if_due(self) -> bool:
        if not self.health.probe_due():
            return False
        return await self.probe()

    async def probe(self) -> bool:
        """One PING; a reply ends a degraded episode."""
        try:
            await self._one("ping")
        except Exception as exc:  # noqa: BLE001 - any failure keeps it degraded
            self.health.failed(f"probe: {self._failure(exc, count=False)}"[:300])
            self._sync_health()
            return False
        if self.health.degraded:
            log.warning("kvtier: remote tier reachable again")
        self.health.recovered()
        self._sync_health()
        return True

    def _sync_health(self) -> None:
        self._stats.degraded = self.health.degraded
        self._stats.degradations = self.health.degradations

    # ---- operations (run on the store's loop) -----------------------------------------------
    async def count_present(self, key_groups: Sequence[Sequence[bytes]]) -> list[int | None]:
        """How many keys of each group exist: one EXISTS per group (a Cluster client splits a
        group across its slots and sums); None: its command failed."""
        out = await self._batch("exists", [tuple(g) for g in key_groups])
        return [None if isinstance(r, BaseException) else int(r) for r in out]

    async def delete(self, server_keys: Sequence[bytes]) -> int:
        """Drop the keys (tools and benches cleaning up what they wrote); how many were there."""
        out = await self._batch("delete", [(k,) for k in server_keys])
        return sum(r for r in out if isinstance(r, int))

    # ---- accounting -------------------------------------------------------------------------
    def _failure(self, exc: BaseException, count: bool = True) -> str:
        """Count ``exc`` (TLS and AUTH apart, named in the log once); its redacted text."""
        what = failures.kind(exc)
        why = self.secrets.redact(failures.describe(exc))[:300]
        if count:
            self._stats.errors += 1
            self._stats.last_error = why
        if what == "tls":
            self._stats.tls_errors += 1
        elif what == "auth":
            self._stats.auth_errors += 1
        if what is not None:
            failures.log_once(log, what, why)
        return why

    def note_error(self, why: str) -> None:
        """A command of this tier that failed elsewhere (the presence queries' own sockets)."""
        self._stats.errors += 1
        self._stats.last_error = self.secrets.redact(why)[:300]

    def stats(self) -> RemoteStats:
        self._sync_health()
        return RemoteStats(**asdict(self._stats))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shut() -> None:
            if self._client is not None:
                try:
                    await asyncio.wait_for(self._client.aclose(), self.deadline_s)
                except Exception:  # noqa: BLE001 - closing a dead server's sockets
                    pass

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(2 * self.deadline_s + 1)
        except Exception:  # noqa: BLE001
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
