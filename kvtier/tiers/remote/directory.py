"""Which blocks the shared tier holds, answered without waiting on the network.

The shared tier belongs to every instance, so no instance can index it; the scheduler asks the
server instead. ``query`` never blocks: a key whose answer is cached (fresh for ``ttl_s``) is
answered at once; the others are queued and read ``None`` ("not yet") until the reply lands,
which the manager turns into vLLM's "ask again next step". A failed or degraded server answers
"absent", so a dead tier costs only its hits. With tensor parallelism a block is "held" only
when every rank's shard is (``shards``), so no rank finds its shard evicted after the
scheduler promised the block. Answers are hints: a key evicted between the answer and the read
is a miss (recomputed), never wrong bytes.

The scheduler's thread only queues the keys and sets an event. The directory's asker thread
sends the EXISTS of every queued key in one pipeline on its own blocking connections
(:mod:`.exists`), never through the store's asyncio loop (docs/design-measurements.md).

A lookup is pending at most ``lookup_deadline_s``: a key asked longer ago reads "absent" (the
request recomputes it) whatever the asker is stuck on, and the asker's own reads stop at the
same deadline. Write-back trusts only what it can vouch for: a key this instance wrote, or one
whose value's header was read and checked (``recheck``); EXISTS alone counts junk as held."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Sequence

from kvtier.tiers.remote.exists import PresenceQueries
from kvtier.tiers.remote.store import RemoteStore

log = logging.getLogger(__name__)

MAX_ENTRIES = 1 << 18  # cached answers kept (LRU); each is a key and two numbers


def _no_wakeup_preemption() -> None:
    """Run the calling thread under ``SCHED_BATCH`` (Linux): same CPU share as any thread,
    but waking it never preempts the running one. The scheduler thread wakes the asker in
    ``query``; on a machine whose cores are all busy the woken asker used to preempt the
    scheduler thread on the spot, which then waited a timeslice of the OS, far longer than
    the lookup itself (docs/design-measurements.md). Unprivileged; a no-op elsewhere."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return
    try:
        os.sched_setscheduler(0, batch, os.sched_param(0))  # 0: this thread
    except OSError:  # not permitted here: keep the default policy
        pass


class RemoteDirectory:
    def __init__(self, store: RemoteStore, ttl_s: float | None = None,
                 max_entries: int = MAX_ENTRIES, clock=time.monotonic, shards: int = 1) -> None:
        self.store = store
        self.shards = max(1, shards)  # ranks whose shard keys must all be present
        self.ttl_s = store.cfg.lookup_ttl_s if ttl_s is None else ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (held, expires, verified: a valid record was seen, not just a key)
        self._known: OrderedDict[bytes, tuple[bool, float, bool]] = OrderedDict()
        self._asking: dict[bytes, float] = {}  # key -> when it was asked
        self.deadline_s = store.cfg.lookup_deadline_s
        self.late_answers = 0  # lookups answered "absent" because the server was too slow
        self._outbox: list[bytes] = []  # asked by query(), not yet handed to the store
        self._verify_box: list[bytes] = []  # asked by recheck(): their values' headers
        self._probe_wanted = False
        self._wake = threading.Event()
        self._closed = False
        self.queries = 0  # batches sent to the server
        self.presence = PresenceQueries(store.cfg, store.secrets, store.health,
                                        on_error=store.note_error)
        self.answered_present = 0
        self._asker = threading.Thread(target=self._ask_loop, name="kvtier-remote-ask",
                                       daemon=True)
        self._asker.start()

    def query(self, keys: Sequence[bytes]) -> list[bool | None]:
        """For each key: True (held), False (not held, or the tier is down) or None (asked,
        answer pending). Never waits."""
        now = self._clock()
        out: list[bool | None] = []
        ask: list[bytes] = []
        down = self.store.health.degraded
        with self._lock:
            for key in keys:
                hit = self._known.get(key)
                if hit is not None and hit[1] > now:
                    self._known.move_to_end(key)
                    out.append(hit[0])
                elif key in self._asking:
                    if now - self._asking[key] < self.deadline_s:
                        out.append(None)
                    else:  # the server is too slow: a miss now beats a pending request
                        self.late_answers += 1
                        out.append(False)
                elif down:
                    out.append(False)
                else:
                    self._asking[key] = now
                    ask.append(key)
                    out.append(None)
            self._outbox.extend(ask)
            probe = down and self.store.health.probe_due()
            self._probe_wanted |= probe
        if ask or probe:
            self._wake.set()
        return out

    def _ask_loop(self) -> None:
        _no_wakeup_preemption()
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                keys, self._outbox = self._outbox, []
                verify, self._verify_box = self._verify_box, []
                probe, self._probe_wanted = self._probe_wanted, False
            if probe:
                self._probe()
            if keys:
                self._ask(keys)
            if verify:
                self._verify(verify)

    def _probe(self) -> None:
        """One PING of a degraded tier, on the asker's own connections (see
        ``PresenceQueries.ping``); a reply ends the episode."""
        health = self.store.health
        if self.presence.ping():
            if health.degraded:
                log.warning("kvtier: remote tier reachable again")
            health.recovered()
        else:
            health.failed(f"probe: {self.store.stats().last_error or 'no node answered'}")

    def close(self) -> None:
        """Stop the asker thread (the store is closed by its owner)."""
        self._closed = True
        self._wake.set()
        self._asker.join(timeout=5)
        self.presence.close()

    def _ask(self, keys: list[bytes]) -> None:
        self.queries += 1
        groups = [self.store.keys.shard_server_keys(k, self.shards) for k in keys]
        try:
            counts = self.presence.count_present(groups)
        except Exception:  # noqa: BLE001 - whatever failed, the keys read absent
            counts = [None] * len(groups)
        # held: every shard present (a failed EXISTS answers None: absent)
        self._answer(keys, [c == len(g) for c, g in zip(counts, groups)])

    def _verify(self, keys: list[bytes]) -> None:
        """``recheck``'s question: does every shard key hold a valid record for it?"""
        groups = [self.store.keys.shard_server_keys(k, self.shards) for k in keys]
        flat = [sk for g in groups for sk in g]
        try:
            held = self.presence.records_held(flat, [self.store.keys.record_key(sk)
                                                     for sk in flat])
        except Exception:  # noqa: BLE001 - whatever failed, the keys are written
            held = [False] * len(flat)
        out, start = [], 0
        for g in groups:
            out.append(all(held[start:start + len(g)]))
            start += len(g)
        self._answer(keys, out, verified=True)

    def _answer(self, keys: Sequence[bytes], present: Sequence[bool],
                verified: bool = False) -> None:
        expires = self._clock() + self.ttl_s
        with self._lock:
            for key, p in zip(keys, present):
                self._asking.pop(key, None)
                self._known[key] = (p, expires, verified and p)
                self._known.move_to_end(key)
                self.answered_present += p
            while len(self._known) > self.max_entries:
                self._known.popitem(last=False)

    def known_present(self, key: bytes) -> bool:
        """A fresh answer says the server holds the key (a hint: promotions verify)."""
        with self._lock:
            hit = self._known.get(key)
        return hit is not None and hit[0] and hit[1] > self._clock()

    def known_held(self, key: bytes) -> bool:
        """A fresh answer says the server holds a valid record under the key: this instance
        wrote it, or ``recheck`` read its header. Write-back skips only such keys."""
        with self._lock:
            hit = self._known.get(key)
        return hit is not None and hit[2] and hit[1] > self._clock()

    def recheck(self, keys: Sequence[bytes]) -> int:
        """Ask the server again about ``keys`` not known to be held, dropping a cached
        answer meanwhile (those keys read "not yet" until the answer lands). For write-back:
        a block this instance recomputed because the tier missed it is often being written by
        the instance that missed it first, and a write that finds it held saves the store its
        bytes. "Held" here is a record whose header checks out for the key (``records_held``),
        not a key that exists. Never waits; returns how many keys were asked."""
        if self.store.health.degraded:
            return 0
        now = self._clock()
        ask: list[bytes] = []
        with self._lock:
            for key in keys:
                if key in self._asking:
                    continue
                hit = self._known.get(key)
                if hit is not None and hit[2] and hit[1] > now:
                    continue
                self._known.pop(key, None)
                self._asking[key] = now
                ask.append(key)
            self._verify_box.extend(ask)
        if ask:
            self._wake.set()
        return len(ask)

    def learned(self, keys: Sequence[bytes], present: bool) -> None:
        """What this instance itself found out (a write landed, a read missed)."""
        self._answer(keys, [present] * len(keys), verified=True)

    @property
    def degraded(self) -> bool:
        """The tier is down or hung (see ``RemoteHealth``): writes are not worth queueing."""
        return self.store.health.degraded

    @property
    def degradations(self) -> int:
        return self.store.health.degradations

    def pending(self) -> int:
        with self._lock:
            return len(self._asking)

    def __len__(self) -> int:
        return len(self._known)
