"""The manager's side of the host tier: this instance's CPU tier is its region of the host's
shared pool, and the blocks other instances published there are CPU hits here too.

What changes for the tiered manager (``tiered.py``), and only where a host tier is set:

* its CPU tier's handles are the pool's slot ids of its region (``base ..``);
* a lookup past the local CPU prefix asks the service which keys another instance holds
  (one round trip) and counts them as CPU hits;
* ``prepare_load`` pins those blocks in the service (one round trip; a key retired since the
  lookup ends the hit there: a shorter load, never another block's bytes) and the load is
  the same one CPU -> GPU job, its slot ids pointing into the other instance's region;
  ``complete_load`` releases them;
* a store skips the keys another instance holds (one copy per host), in the same round trip
  that brings the hits other instances took on this region's blocks into its eviction order;
  a completed store, or a promotion from disk or the shared tier, publishes its blocks;
* an eviction first retires its blocks in the service: one another instance is reading stays
  (the store is cut short instead), so a slot is never rewritten under a reader.

If the service goes away, this instance goes on with its own region alone: no more hits on
other instances' blocks, and for ``QUARANTINE_S`` it reuses none of the slots it had
published (a reader's copy already enqueued may still read one); then they are its own again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from kvtier.manager.specs import BlockKey
from kvtier.manager.stats import ManagerStats

log = logging.getLogger(__name__)

QUARANTINE_S = 30.0  # far longer than any enqueued CPU -> GPU copy takes


class HostTier:
    """``client``: a connected :class:`kvtier.tiers.host.HostClient`; ``base``: the first
    slot of this instance's region (``HostClient.register``)."""

    def __init__(self, client, base: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.base = base
        self._clock = clock
        self._pinned: dict[BlockKey, list[int]] = {}  # another instance's blocks a load pins
        self.down_since: float | None = None
        self.stats = ManagerStats()  # the manager's own, once it binds this tier (host_*)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def _lost(self, exc: OSError) -> None:
        if self.down_since is None:
            self.down_since = self._clock()
            self.stats.host_degraded = True
            log.error("kvtier host tier: the service is gone (%s); going on with this "
                      "instance's region alone", exc)

    def held(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which ``keys`` an instance published (this one's too)."""
        if not keys or not self.up:
            return [False] * len(keys)
        try:
            return self.client.find(keys)
        except OSError as exc:
            self._lost(exc)
            return [False] * len(keys)

    def held_and_touched(self, keys: Sequence[BlockKey]) -> tuple[list[bool], list[BlockKey]]:
        """``held``, and this instance's blocks other instances loaded since it last asked
        (its eviction order counts their hits too): one round trip, before a store."""
        if not self.up:
            return [False] * len(keys), []
        try:
            return self.client.find_and_touched(keys)
        except OSError as exc:
            self._lost(exc)
            return [False] * len(keys), []

    def pin(self, keys: Sequence[BlockKey], local: Sequence[bool],
            pin_local: Callable[[BlockKey], int]) -> tuple[list[int], list[BlockKey]]:
        """Slots of the leading ``keys`` held here (``local``: pinned by ``pin_local``) or
        published by another instance (pinned in the service), up to the first held by
        neither; and which of them are another instance's."""
        foreign = [k for k, mine in zip(keys, local) if not mine]
        acquired: list[int] = []
        if foreign and self.up:
            try:
                acquired = self.client.acquire(foreign)
            except OSError as exc:
                self._lost(exc)
        out: list[int] = []
        theirs: list[BlockKey] = []
        used = 0
        for key, mine in zip(keys, local):
            if mine:
                out.append(pin_local(key))
                continue
            slot = acquired[used] if used < len(acquired) else -1
            if slot < 0:
                break
            used += 1
            out.append(slot)
            theirs.append(key)
            self._pinned.setdefault(key, []).append(slot)
        spare = [s for s in acquired[used:] if s >= 0]
        if spare:
            self._release(spare)
        self.stats.host_foreign_hit_blocks += len(theirs)
        return out, theirs

    def unpin(self, keys: Sequence[BlockKey]) -> Sequence[BlockKey]:
        """Release the pins a load took on other instances' blocks; returns the keys that
        are not such a block (this instance's own), in order."""
        if not self._pinned:  # no load of another instance's block in flight
            return keys
        rest: list[BlockKey] = []
        slots: list[int] = []
        for key in keys:
            held = self._pinned.get(key)
            if held:
                slots.append(held.pop())
                if not held:
                    del self._pinned[key]
            else:
                rest.append(key)
        if slots:
            self._release(slots)
        return rest

    def _release(self, slots: list[int]) -> None:
        if not self.up:
            return
        try:
            self.client.release(slots)
        except OSError as exc:
            self._lost(exc)

    def publish(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        if not keys or not self.up:
            return
        try:
            self.client.publish(keys, slots)
        except OSError as exc:
            self._lost(exc)

    def retire(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Take ``keys`` back before their slots are reused: the ones another instance is
        reading, which must stay (all of them for ``QUARANTINE_S`` once the service is
        gone: nobody can say then)."""
        if not keys:
            return set()
        if self.up:
            try:
                busy = set(self.client.retire(keys))
            except OSError as exc:
                self._lost(exc)
            else:
                self.stats.host_evictions_held += len(busy)
                return busy
        if self._clock() - self.down_since < QUARANTINE_S:
            self.stats.host_evictions_held += len(keys)
            return set(keys)
        return set()

    def pins(self) -> int:
        """Pins this instance holds on other instances' blocks (loads in flight)."""
        return sum(len(v) for v in self._pinned.values())

    def usage(self) -> dict[str, int]:
        """The whole pool as the service sees it, and this instance's share of its hits
        (``usage()["HOST"]``: ``kvtier stats`` and the metrics); empty while it is gone."""
        if not self.up:
            return {}
        try:
            stats = self.client.stats()
        except OSError as exc:
            self._lost(exc)
            return {}
        me = next((i for i in stats["instances"] if i.get("base") == self.base), {})
        return {"used_blocks": stats["published_blocks"],
                "capacity_blocks": stats["total_slots"],
                "instances": sum(1 for i in stats["instances"] if i["alive"]),
                "hits_given": me.get("hits_given", 0), "hits_taken": me.get("hits_taken", 0)}

    def close(self) -> None:
        self.client.close()


def open_host_tier(config, fingerprint: str, block_bytes: int, instance: str) -> HostTier:
    """Connect this instance's scheduler to the host tier (starting its service if none
    runs) and take its region, ``tiers.cpu.capacity`` of the pool."""
    from kvtier.tiers.host import HostAddress, HostClient

    client = HostClient.connect(HostAddress.from_config(config.host, fingerprint, block_bytes),
                                instance)
    try:
        base = client.register(config.cpu_slots(block_bytes))
    except OSError:
        client.close()
        raise
    return HostTier(client, base)
