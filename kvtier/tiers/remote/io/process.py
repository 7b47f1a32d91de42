"""The shared tier's data path: a few child processes that map the CPU pool and move its blocks
to and from Redis / Valkey.

Why processes: one raw client process moves well under what a Valkey server serves; the ceiling
is reached with many clients in parallel, each parsing replies and hashing values. In the
worker's own process that work would take the GIL that vLLM's engine loop needs, once per value
and per system call. So each child (``server.py``) owns its own connections to every
node, receives values straight into the shared CPU pool (``CpuBlockPool(shared=True)``, a memfd
the child maps), verifies them there, and sends values from there; only slot ids, keys and
counts cross its Unix socket. A job's blocks are split across the children, which run in
parallel.

Failures: a child that dies, or misses a request's deadline (hung, SIGSTOPped), is killed and
declared lost; its share of the job fails as transient misses (the engine recomputes them) and
a new child replaces it ``RESPAWN_AFTER_S`` later. A job in which every block was lost to a
connection marks the tier degraded: jobs then fail at once, and one goes through per
``probe_interval_s`` to look for recovery (``RemoteUnavailable``).
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import subprocess
import threading
import time
from dataclasses import asdict
from typing import Callable, Sequence

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.child import wire
from kvtier.tiers.child.process import CHILD_CWD, child_environment, isolated_command
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.remote.wire import failures
from kvtier.tiers.remote.block_io import BlockIOStats, FetchResult
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.store import RemoteUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
DEADLINE_BASE_S = 2.0  # a request's deadline: this, plus twice what its bytes take ...
DEADLINE_SPEED_FLOOR = 50e6  # ... at the measured speed, never taken as slower than this
# (bytes/s): a hung child is replaced within seconds, not the minutes of one socket timeout
# per block, while a first slow measurement cannot stretch every later deadline
SPEED_MIN_SAMPLE_BYTES = 1 << 20  # a request moving less says more about latency than speed
RESPAWN_AFTER_S = 5.0
MIN_BLOCKS_PER_CHILD = 8  # a smaller share costs a round trip for too few bytes; larger
# shares keep each child's pipeline deep and leave the other children to concurrent jobs
PUT_ROUND_BYTES = 4 << 20  # bytes per child per round of a store (at least one block): a
# load waiting for a child waits at most its round, whatever the block size


def _part_positions(payload: memoryview, n: int) -> list[int]:
    """The positions of a PART frame for a part of ``n`` blocks; WireError for junk."""
    try:
        positions = json.loads(bytes(payload))["ready"]
        if all(type(p) is int and 0 <= p < n for p in positions):
            return positions
    except (ValueError, KeyError, TypeError):
        pass
    raise wire.WireError("a partial reply that does not fit its request")


class _Child:
    """One I/O process and its socket; one request at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready = False  # its start-up frame was read
        self.retry_at = 0.0  # when a lost child may be replaced

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        self.ready = False


class RemoteIOProcesses:
    """A worker's shared-tier I/O: ``put_slots`` / ``fetch_slots`` over ``processes`` children."""

    def __init__(self, pool: CpuBlockPool, cfg: RemoteTierConfig, keys: RemoteKeys,
                 secrets: RemoteSecrets, *, processes: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S,
                 respawn_after_s: float = RESPAWN_AFTER_S,
                 put_round_bytes: int = PUT_ROUND_BYTES) -> None:
        if pool.shared_fd is None:
            raise ValueError("the shared tier's I/O processes need a shared CPU pool "
                             "(CpuBlockPool(shared=True))")
        self.pool = pool
        self.cfg = cfg
        self.keys = keys
        self.block_bytes = pool.geometry.block_bytes
        # blocks one child stores per round of a store (put_slots)
        self.put_round_blocks = max(1, int(put_round_bytes) // self.block_bytes)
        self.start_timeout_s = start_timeout_s
        self.respawn_after_s = respawn_after_s
        self.health = RemoteHealth(cfg.probe_interval_s)
        self.respawns = 0
        self.speed_bps = 0.0  # bytes/s the children move, measured (0: not yet)
        self._secrets = json.dumps(secrets.to_wire()).encode()
        self._redact = secrets.redact  # a child's error text may quote a server
        self._spec = {"config": asdict(cfg), "num_slots": pool.num_slots,
                      "block_bytes": self.block_bytes, "pool_fd": pool.shared_fd,
                      "keys": {"namespace": keys.namespace, "rank": keys.rank,
                               "geometry_fingerprint": keys.fingerprint,
                               "replicated": keys.replicated},
                      "log_level": logging.getLogger("kvtier").getEffectiveLevel()}
        self._stats = BlockIOStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._next = -1  # the child the last job's first share went to
        # fetches waiting for (or holding) the children: a store's next round waits for them
        self._reads = threading.Condition()
        self._reads_waiting = 0
        n = processes or cfg.io_processes
        self._children = [_Child(i) for i in range(n)]
        for child in self._children:  # they connect and warm up while the engine starts
            self._spawn(child)

    # ---- children --------------------------------------------------------------------------
    def _spawn(self, child: _Child) -> None:
        mine, theirs = socket.socketpair()
        spec = dict(self._spec, socket=theirs.fileno())
        try:
            child.proc = subprocess.Popen(
                isolated_command("kvtier.tiers.remote.io.server", spec),
                pass_fds=[self.pool.shared_fd, theirs.fileno()], stdin=subprocess.DEVNULL,
                cwd=CHILD_CWD, env=child_environment())
        except OSError as exc:
            mine.close()
            child.retry_at = time.monotonic() + self.respawn_after_s
            log.error("kvtier: cannot start a shared-tier I/O process: %s", exc)
            return
        finally:
            theirs.close()
        child.sock = mine
        try:
            wire.send_reply(mine, self._secrets)  # its private socket: never the command line
        except OSError as exc:  # it died at once: lost, replaced later like any other
            self._lose(child, f"did not take its start-up frame: {exc}")

    def _ensure(self, child: _Child) -> bool:
        """The child is up and ready (starting or replacing it when due); False: lost."""
        if child.sock is None:
            if self._closed or time.monotonic() < child.retry_at:
                return False
            self.respawns += 1
            self._spawn(child)
            if child.sock is None:
                return False
        if not child.ready:
            child.sock.settimeout(self.start_timeout_s)
            try:
                status, payload = wire.read_reply(child.sock)
            except OSError as exc:
                self._lose(child, f"did not start: {exc}")
                return False
            if status != wire.OK:
                self._lose(child, f"could not start: {bytes(payload)[:300]!r}")
                return False
            child.ready = True
        return True

    def _await_starts(self, children: list[_Child]) -> None:
        """Read the start-up frames of the children that are starting, all at once: one
        ``start_timeout_s`` in all, not one per child (eight children each stuck in a slow
        connect made a load wait eight times over)."""
        starting = []
        for child in children:
            if child.sock is None and not self._closed and time.monotonic() >= child.retry_at:
                self.respawns += 1
                self._spawn(child)
            if child.sock is not None and not child.ready:
                starting.append(child)
        if not starting:
            return
        end = time.monotonic() + self.start_timeout_s
        with selectors.DefaultSelector() as sel:
            for child in starting:
                sel.register(child.sock, selectors.EVENT_READ, child)
            while sel.get_map():
                left = end - time.monotonic()
                ready = sel.select(timeout=max(0.0, left)) if left > 0 else []
                if not ready:
                    for key in list(sel.get_map().values()):
                        sel.unregister(key.fileobj)
                        self._lose(key.data, "did not start in time")
                    return
                for key, _ in ready:
                    sel.unregister(key.fileobj)
                    self._ensure(key.data)  # the frame is there: read without waiting

    def _lose(self, child: _Child, why: str) -> None:
        pid = child.proc.pid if child.proc is not None else None
        child.stop()
        child.retry_at = time.monotonic() + self.respawn_after_s
        with self._stats_lock:
            self._stats.errors += 1
            self._stats.last_error = self._redact(f"I/O process {pid}: {why}")[:300]
        why = self._redact(why)
        log.error("kvtier: shared-tier I/O process %s lost (%s); its blocks miss until a new "
                  "one starts in %g s", pid, why, self.respawn_after_s)

    def _deadline_s(self, blocks: int) -> float:
        """A request's whole budget: ``DEADLINE_BASE_S`` plus twice what its bytes take at
        the tier's measured speed (at least ``DEADLINE_SPEED_FLOOR``), and never more than
        every block at the slowest pace the socket timeouts allow. A child that misses it is
        hung (SIGSTOPped, or a server dripping bytes): it is replaced, and its share of a
        load fails as transient misses, which the engine recomputes."""
        by_timeouts = self.cfg.connect_timeout_s + (self.cfg.retries + 1) * self.cfg.timeout_s * (
            2 + blocks) + 1.0
        speed = max(self.speed_bps, DEADLINE_SPEED_FLOOR)
        return min(by_timeouts, DEADLINE_BASE_S + 2 * blocks * self.block_bytes / speed)

    def _measured(self, stats: dict, seconds: float) -> None:
        """One answered request's speed, into the running estimate (recent requests weigh
        most: the server's load changes)."""
        moved = int(stats.get("get_bytes", 0) or 0) + int(stats.get("put_bytes", 0) or 0)
        if moved < SPEED_MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = moved / seconds
        self.speed_bps = sample if not self.speed_bps else 0.8 * self.speed_bps + 0.2 * sample

    def _reply(self, status: int, payload: memoryview) -> dict | None:
        """A child's answer as data (its stats counted); None for an error or junk."""
        if status != wire.OK:
            with self._stats_lock:
                self._stats.errors += 1
                self._stats.last_error = self._redact(
                    bytes(payload).decode("utf-8", "replace"))[:300]
            return None
        try:
            reply = json.loads(bytes(payload))
        except ValueError:
            return None
        stats = reply.get("stats", {})
        if isinstance(stats, dict):
            if isinstance(stats.get("last_error"), str):
                stats["last_error"] = self._redact(stats["last_error"])
            with self._stats_lock:
                self._stats.add(stats)
            self._name_failures(stats)
        return reply

    def _name_failures(self, stats: dict) -> None:
        """TLS, AUTH and unlisted-node refusals, named in this process's log once (the
        children count them; eight children logging each would say it eight times)."""
        for field, what in (("tls_errors", "tls"), ("auth_errors", "auth"),
                            ("unlisted_refused", "unlisted node")):
            if stats.get(field):
                message = stats.get("last_error") or what
                if what == "unlisted node":
                    message = ("a Cluster node outside tiers.remote.nodes was sent nothing "
                               "(its keys miss); list it, or set allow_unlisted_nodes")
                failures.log_once(log, what, message)

    def _fan_out(self, children: list[_Child], op: int,
                 parts: list[tuple[list[int], list[bytes]]],
                 on_part: Callable[[int, list[int]], None] | None = None,
                 follow: Callable[[int, dict], tuple[list[int], list[bytes]] | None] | None = None
                 ) -> list[dict | None]:
        """Send each child its part, then read the replies as they come, all on this thread
        (one GIL hand-off per reply, not per thread and system call). The children's locks
        are taken in index order, so concurrent jobs never wait on each other in a circle.
        ``on_part(i, positions)``: a fetch's PART frame from child ``i`` (positions within its
        part that are verified already); junk in one loses the child like a bad reply.
        ``follow(i, reply)``: called with child ``i``'s reply; it returns the child's next
        part, sent at once on the same lock, or None: the child is done and its lock is
        released at once (a waiting load can take it while the other children go on).
        A child lost on the way replies None, whatever its earlier rounds answered."""
        replies: list[dict | None] = [None] * len(children)
        held = sorted(range(len(children)), key=lambda i: children[i].index)
        for i in held:
            children[i].lock.acquire()
        released: set[int] = set()
        try:
            ends: dict[int, float] = {}  # per child: its request's deadline
            starts: dict[int, float] = {}  # per child: when its request went out
            self._await_starts([c for c, (_, k) in zip(children, parts)])
            for i, (child, (slots, keys)) in enumerate(zip(children, parts)):
                if not self._ensure(child):
                    continue
                try:
                    child.sock.settimeout(self._deadline_s(len(keys)))
                    child.sock.sendall(wire.encode_request(op, slots, keys))
                    starts[i] = time.monotonic()
                    ends[i] = starts[i] + self._deadline_s(len(keys))
                except OSError as exc:
                    self._lose(child, f"{type(exc).__name__}: {exc}")
            with selectors.DefaultSelector() as sel:
                for i in ends:
                    sel.register(children[i].sock, selectors.EVENT_READ, i)
                while sel.get_map():
                    now = time.monotonic()
                    ready = sel.select(timeout=max(0.0, min(ends.values()) - now))
                    if not ready:  # past a deadline: whoever has not answered in time is hung
                        for key in list(sel.get_map().values()):
                            if ends[key.data] <= time.monotonic():
                                sel.unregister(key.fileobj)
                                del ends[key.data]
                                replies[key.data] = None  # not an earlier round's reply
                                self._lose(children[key.data], "missed its request deadline")
                        continue
                    for key, _ in ready:
                        i = key.data
                        child = children[i]
                        try:
                            status, payload = wire.read_reply(child.sock, partial=True)
                            if status == wire.PART:
                                positions = _part_positions(payload, len(parts[i][0]))
                        except OSError as exc:  # died, or sent half a frame and hung
                            sel.unregister(key.fileobj)
                            del ends[i]
                            replies[i] = None
                            self._lose(child, f"{type(exc).__name__}: {exc}")
                            continue
                        if status == wire.PART:  # the request goes on
                            if on_part is not None:
                                on_part(i, positions)
                            continue
                        replies[i] = self._reply(status, payload)
                        if replies[i] is not None and isinstance(replies[i].get("stats"), dict):
                            self._measured(replies[i]["stats"], time.monotonic() - starts[i])
                        more = (follow(i, replies[i]) if follow is not None
                                and replies[i] is not None else None)
                        if more is not None:
                            try:
                                child.sock.sendall(wire.encode_request(op, *more))
                                starts[i] = time.monotonic()
                                ends[i] = starts[i] + self._deadline_s(len(more[1]))
                                continue
                            except OSError as exc:
                                replies[i] = None
                                self._lose(child, f"{type(exc).__name__}: {exc}")
                        sel.unregister(key.fileobj)
                        del ends[i]
                        if follow is not None:
                            child.lock.release()
                            released.add(i)
        finally:
            for i in held:
                if i not in released:
                    children[i].lock.release()
        return replies

    def _shares(self, n: int, per_child: int = MIN_BLOCKS_PER_CHILD) -> list[range]:
        k = max(1, min(len(self._children), n // per_child))
        step, extra = divmod(n, k)
        out, start = [], 0
        for i in range(k):
            stop = start + step + (i < extra)
            out.append(range(start, stop))
            start = stop
        return [r for r in out if len(r)]

    def _job_children(self, shares: int) -> list[_Child]:
        """The children a job's ``shares`` go to, share ``i`` to child ``i`` of the list;
        RemoteUnavailable while the tier is degraded and no probe is due. Children are taken
        from a rotating start so concurrent jobs spread over all of them."""
        if self.health.degraded and not self.health.probe_due():
            raise RemoteUnavailable(f"degraded: {self.health.last_error}")
        n = len(self._children)
        first = self._next = (self._next + 1) % n
        return [self._children[(first + i) % n] for i in range(shares)]

    def _run(self, op: int, slots: Sequence[int], keys: Sequence[bytes],
             ready: Callable[[list[int]], None] | None = None) -> list:
        shares = self._shares(len(keys))
        children = self._job_children(len(shares))
        parts = [([slots[j] for j in r], [keys[j] for j in r]) for r in shares]

        def on_part(i: int, positions: list[int]) -> None:
            ready([parts[i][0][p] for p in positions])

        replies = self._fan_out(children, op, parts, on_part if ready is not None else None)
        return list(zip(shares, replies))

    def _settle_health(self, lost: int, total: int) -> None:
        if total and lost == total:
            if not self.health.degraded:
                log.warning("kvtier: remote tier degraded (%s); local tiers keep serving",
                            self._stats.last_error)
            self.health.failed(self._stats.last_error)
        elif self.health.degraded:
            log.warning("kvtier: remote tier reachable again")
            self.health.recovered()

    # ---- the data path ---------------------------------------------------------------------
    def put_slots(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[bool]:
        """Store each slot's block under its key; which the server acknowledged.

        Each child streams its share in rounds of ``put_round_bytes``: the next round goes
        out as its last one is answered, unless a fetch is waiting; then the child's lock is
        let go and its rounds resume once no fetch waits: a child serves one request at a
        time, and a hit the request is blocked on costs more than a write nobody waits for.
        Children do not wait for each other between rounds (docs/design-measurements.md)."""
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(slots)} CPU slots")
        ok = [False] * len(keys)
        if not keys:
            return ok
        per = self.put_round_blocks
        shares = self._shares(len(keys), per)
        share_children = self._job_children(len(shares))
        # per share: its rounds still to send, as ranges of positions into keys
        rounds = [[range(j, min(j + per, r.stop)) for j in range(r.start, r.stop, per)]
                  for r in shares]
        lost = 0

        def part(k: int) -> tuple[list[int], list[bytes]]:
            r = rounds[k][0]
            return [slots[j] for j in r], [keys[j] for j in r]

        def follow(k: int, reply: dict) -> tuple[list[int], list[bytes]] | None:
            nonlocal lost
            r = rounds[k].pop(0)
            for j, good in zip(r, reply.get("ok", [])):
                ok[j] = bool(good)
            lost += len(reply.get("lost", ()))
            if not rounds[k] or self._reads_waiting:
                return None
            return part(k)

        while any(rounds):
            self._after_reads()
            active = [k for k in range(len(rounds)) if rounds[k]]
            children = [share_children[k] for k in active]
            replies = self._fan_out(children, wire.PUT, [part(k) for k in active],
                                    follow=lambda i, reply: follow(active[i], reply))
            for i, k in enumerate(active):
                if replies[i] is None and rounds[k]:  # the child was lost: its rounds too
                    lost += sum(len(r) for r in rounds[k])
                    rounds[k] = []
        self._settle_health(lost, len(keys))
        return ok

    def _after_reads(self) -> None:
        with self._reads:
            while self._reads_waiting and not self._closed:
                self._reads.wait(0.5)

    def fetch_slots(self, keys: Sequence[bytes], slots: Sequence[int],
                    ready: Callable[[list[int]], None] | None = None) -> FetchResult:
        """Load each key's block into its slot, verified; the positions that missed.
        ``ready``: called on this thread, while the fetch goes on, with CPU slots whose
        blocks are verified already (``RemoteBlockIO.fetch``); a slot reported there may
        still be in the result's misses if its I/O process is lost before it answers."""
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(slots)} CPU slots")
        failed: list[int] = []
        transient: list[int] = []
        with self._reads:
            self._reads_waiting += 1
        try:
            shares = self._run(wire.FETCH, slots, keys, ready)
        finally:
            with self._reads:
                self._reads_waiting -= 1
                self._reads.notify_all()
        for share, reply in shares:
            if reply is None:
                failed += share
                transient += share
                continue
            try:
                f = [share[i] for i in reply["failed"]]
                t = [share[i] for i in reply["transient"]]
            except (KeyError, IndexError, TypeError):  # a reply that does not fit: all missed
                f = t = list(share)
            failed += f
            transient += t
        self._settle_health(len(transient), len(keys))
        return FetchResult(sorted(failed), sorted(transient))

    def warm_up(self) -> int:
        """Wait for every child's start (and first connection); how many are ready."""
        replies = self._fan_out(self._children, wire.STATS, [([], [])] * len(self._children))
        return sum(1 for r in replies if r is not None)

    def stats(self) -> BlockIOStats:
        with self._stats_lock:
            out = BlockIOStats()
            out.add(self._stats.to_dict())
        out.degraded = self.health.degraded
        out.degradations = self.health.degradations
        return out

    def close(self) -> None:
        self._closed = True
        for child in self._children:
            with child.lock:
                child.stop()
