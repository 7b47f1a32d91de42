"""The host tier's index: which block of the host's pool holds which key, and who reads it.

The pool is one array of slots that every kvtier instance on the host maps. Each instance
gets a **region** of it (``register``): its own CPU tier, whose blocks its manager stores,
evicts and writes back as it always did. What an instance stored is **published** here once
its bytes are complete (the store's copy has finished on every rank), and every other
instance may then **acquire** it: the slot is pinned for that reader until it **releases**
it, and the owner can only take a block back (**retire**, before reusing its slot) while
nobody reads it. So a slot is never rewritten under a reader, and a block half written is
never visible: publication comes after the write, from the writer's own manager.

An instance's blocks are unpublished once the connection that took its region (its
scheduler's, which publishes and retires them) closes, a kill -9 included: the unpinned ones
at once, the pinned ones as their readers release them (a reader that dies releases by
closing). The instance is gone with its last connection (its workers', which may still
write the region), and its region is free for the next instance once none of its blocks is
read. Slots, keys and pins live in this process only; nothing here
touches the bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


MAX_TOUCHED = 1 << 16  # hits kept for an owner that does not ask (older ones just age)


class HostTierError(ValueError):
    """A request the host tier cannot serve (no room for a region, a slot outside it)."""


@dataclass
class Instance:
    """One kvtier instance (one vLLM engine: its scheduler and its workers)."""

    name: str
    base: int = -1  # first slot of its region; -1 until its scheduler registers
    slots: int = 0
    connections: int = 0
    alive: bool = True
    keys: set = field(default_factory=set)  # published by it
    stored: int = 0  # blocks it published
    hits_given: int = 0  # its blocks acquired by other instances
    hits_taken: int = 0  # other instances' blocks it acquired
    # its blocks other instances acquired since it last asked (``touched``): its eviction
    # order then counts every instance's hits, not only its own
    touched: list = field(default_factory=list)

    def owns(self, slot: int) -> bool:
        return self.base <= slot < self.base + self.slots


@dataclass
class Reader:
    """One connection: whose it is and which slots it pins (a slot may be pinned twice).
    ``registered``: the connection that took the instance's region (its scheduler), the one
    that publishes and retires its blocks."""

    instance: Instance
    pins: Counter = field(default_factory=Counter)
    registered: bool = False


class HostDirectory:
    def __init__(self, total_slots: int) -> None:
        if total_slots <= 0:
            raise HostTierError(f"the host tier needs at least one slot, got {total_slots}")
        self.total_slots = total_slots
        self.instances: dict[str, Instance] = {}
        self._free: list[tuple[int, int]] = [(0, total_slots)]  # (start, length), by start
        self._where: dict[bytes, tuple[int, Instance]] = {}  # published key -> (slot, owner)
        self._pins: Counter = Counter()  # slot -> readers
        self._closing: dict[int, bytes] = {}  # pinned slot of a gone owner -> its key
        self.duplicates = 0  # blocks published again under a key already published

    # ------------------------------------------------------------------ instances
    def connect(self, name: str) -> Reader:
        inst = self.instances.get(name)
        if inst is None or not inst.alive:
            if inst is not None and (inst.keys or inst.slots):
                raise HostTierError(f"instance {name!r} is gone and its region is still read")
            inst = self.instances[name] = Instance(name)
        inst.connections += 1
        return Reader(inst)

    def register(self, reader: Reader, slots: int) -> int:
        """Give the reader's instance a region of ``slots``; its first slot."""
        inst = reader.instance
        if inst.slots:
            raise HostTierError(f"instance {inst.name!r} already holds a region "
                                f"({inst.slots} slots)")
        if slots <= 0:
            raise HostTierError(f"a region needs at least one slot, got {slots}")
        for i, (start, length) in enumerate(self._free):
            if length >= slots:
                self._free[i:i + 1] = [(start + slots, length - slots)] if length > slots else []
                inst.base, inst.slots = start, slots
                reader.registered = True
                return start
        free = sum(length for _, length in self._free)
        largest = max((length for _, length in self._free), default=0)
        raise HostTierError(
            f"the host tier has no room for {slots} slots (tiers.cpu.capacity): {free} of "
            f"{self.total_slots} are free, the largest free run is {largest}; "
            f"{sum(1 for i in self.instances.values() if i.slots)} instances hold the rest "
            "(raise tiers.host.capacity, or lower tiers.cpu.capacity)")

    def disconnect(self, reader: Reader) -> None:
        """A connection closed (its process exited or was killed): its pins go; the instance
        is gone with its last connection."""
        for slot, n in reader.pins.items():
            self._unpin(slot, n)
        reader.pins.clear()
        inst = reader.instance
        inst.connections -= 1
        if reader.registered or inst.connections == 0:
            # nobody can retire its blocks any more: none is found from now on (its workers
            # may still write the region: it is free only once they are gone too)
            self._unpublish_all(inst)
        if inst.connections > 0:
            return
        inst.alive = False
        self._maybe_free_region(inst)

    def _unpublish_all(self, inst: Instance) -> None:
        for key in list(inst.keys):
            hit = self._where.get(key)
            if hit is None:
                continue  # already closing: its last reader frees it
            slot, _ = self._where.pop(key)
            if self._pins[slot]:
                self._closing[slot] = key  # unpublished: its last reader frees it
            else:
                inst.keys.discard(key)

    def _maybe_free_region(self, inst: Instance) -> None:
        if inst.alive or inst.keys or not inst.slots:
            return
        self._free.append((inst.base, inst.slots))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged
        inst.base, inst.slots = -1, 0
        del self.instances[inst.name]

    # ------------------------------------------------------------------ blocks
    def publish(self, reader: Reader, keys: list[bytes], slots: list[int]) -> int:
        """The owner's blocks at ``slots`` are complete: readable by every instance. A key
        already published stays where it is (the host keeps one copy). Returns how many
        were published."""
        inst = reader.instance
        if len(keys) != len(slots):
            raise HostTierError(f"{len(keys)} keys for {len(slots)} slots")
        bad = [s for s in slots if not inst.owns(s)]
        if bad:
            raise HostTierError(f"slots {bad[:8]} are outside instance {inst.name!r}'s region "
                                f"[{inst.base}, {inst.base + inst.slots})")
        n = 0
        for key, slot in zip(keys, slots):
            if key in self._where:
                self.duplicates += 1
                continue
            self._where[key] = (slot, inst)
            inst.keys.add(key)
            n += 1
        inst.stored += n
        return n

    def find(self, keys: list[bytes]) -> list[bool]:
        """Which ``keys`` are published (by any instance)."""
        where = self._where
        return [key in where for key in keys]

    def touched(self, reader: Reader) -> list[bytes]:
        """The reader's instance's blocks other instances acquired since it last asked."""
        inst = reader.instance
        out, inst.touched = inst.touched, []
        return out

    def acquire(self, reader: Reader, keys: list[bytes]) -> list[int]:
        """Pin the published ``keys`` for ``reader``: their slots, -1 for a key not held."""
        out: list[int] = []
        me = reader.instance
        for key in keys:
            hit = self._where.get(key)
            if hit is None:
                out.append(-1)
                continue
            slot, owner = hit
            self._pins[slot] += 1
            reader.pins[slot] += 1
            if owner is not me:
                owner.hits_given += 1
                me.hits_taken += 1
                if len(owner.touched) < MAX_TOUCHED:
                    owner.touched.append(key)
            out.append(slot)
        return out

    def release(self, reader: Reader, slots: list[int]) -> int:
        """Drop ``reader``'s pins of ``slots`` (one each); returns how many it did not hold."""
        stray = 0
        for slot in slots:
            if reader.pins[slot] <= 0:
                stray += 1
                continue
            reader.pins[slot] -= 1
            if not reader.pins[slot]:
                del reader.pins[slot]
            self._unpin(slot, 1)
        return stray

    def _unpin(self, slot: int, n: int) -> None:
        left = self._pins[slot] - n
        if left > 0:
            self._pins[slot] = left
            return
        del self._pins[slot]
        key = self._closing.pop(slot, None)
        if key is not None:  # the last reader of an unpublished block
            for inst in self.instances.values():
                if inst.owns(slot):
                    inst.keys.discard(key)
                    self._maybe_free_region(inst)
                    break

    def retire(self, reader: Reader, keys: list[bytes]) -> list[bytes]:
        """The owner wants ``keys``' slots back: those nobody reads are unpublished; returns
        the ones being read (the owner keeps them for now)."""
        inst = reader.instance
        busy: list[bytes] = []
        for key in keys:
            hit = self._where.get(key)
            if hit is None or hit[1] is not inst:
                continue  # not published by it (a duplicate, or never published)
            if self._pins[hit[0]]:
                busy.append(key)
                continue
            del self._where[key]
            inst.keys.discard(key)
        return busy

    # ------------------------------------------------------------------ what operators see
    def pins(self) -> int:
        return sum(self._pins.values())

    def describe(self) -> dict:
        return {
            "total_slots": self.total_slots,
            "published_blocks": len(self._where),
            "free_slots": sum(length for _, length in self._free),
            "pinned_slots": len(self._pins),
            "duplicates": self.duplicates,
            "instances": [
                {"name": i.name, "base": i.base, "slots": i.slots, "alive": i.alive,
                 "connections": i.connections, "published_blocks": len(i.keys),
                 "stored_blocks": i.stored, "hits_given": i.hits_given,
                 "hits_taken": i.hits_taken}
                for i in self.instances.values()
            ],
        }
