"""Reuse gate: write a never-seen block only while such blocks are measured to pay off.

On real traces most offloaded blocks are never read again, and almost all of them are blocks
seen for the first time (one-off documents, unique user turns, the partial tail of a prompt).
A block seen before (within a history a few times the tier's size) is likely to be seen again,
so it is always admitted. A *first-timer* is admitted only while first-timers of its class are
measured to be read before they would be evicted, and only when evictions are hurting:

- classes: whether the block extends a prefix already seen, whether it is the first new block
  of its lookup or a deeper one, and whether it is the lookup's last block; the gate learns
  from the outcomes which classes get reused, so no trace needs its own parameters.
- outcome of an admitted first-timer: hit before eviction (1) or evicted unread (0); of a
  refused one: sighted again before ``capacity`` more blocks were admitted (1), or not (0).
  Both feed one running mean per class, so refusing does not stop the measurement.
- pressure: the share of recent evictions that threw out a block that was not an unread
  first-timer. Without pressure the gate stays open; under pressure the bar is
  ``GATE_BAR * pressure``.
- payoff: whether to gate at all is measured by :class:`ShadowCaches` (shadow.py), so a tier
  that is nearly big enough for its traffic behaves like admit-all and a small one keeps the
  write savings.

Every call is O(1) per key (the maps are :class:`KeyedList`, values packed into ints). Memory:
a two-generation bitset doorkeeper (16-32 bytes per tier block) plus maps of keys awaiting a
decision or an outcome, bounded to 1x (sighted, admitted) and 2x (refused) the tier's capacity."""

from __future__ import annotations

from typing import Hashable, Sequence

from kvtier.manager.admission.base import AdmissionPolicy, register_admission
from kvtier.manager.admission.shadow import ShadowCaches
from kvtier.manager.hints import KEEP, ONE_OFF, HintBook
from kvtier.manager.index.keyed_list import KeyedList
from kvtier.manager.specs import BlockKey

GATE_BAR = 0.5  # first-timers must be read at least this often (at full pressure) to be written
RATE = 0.01  # weight of one outcome in the running means
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

# A first-timer's class, 3 bits: extends a seen prefix (4), not the first new block of its
# lookup (2), the lookup's last block (1). Packed so the maps hold plain ints.
Class = int
EXTENDS, DEEPER, LAST = 4, 2, 1
UNGATED = 8  # flag on an admitted first-timer that a gate would have refused


class SightingFilter:
    """Has this key been sighted recently? Two generations of a 2-hash bitset: a key counts as
    seen for the last ``per_generation``..``2 * per_generation`` new sightings. Rotation drops
    the older generation in one step (no scan), and false positives only make the gate admit."""

    def __init__(self, per_generation: int, bits_per_key: int = 16) -> None:
        bits = 1 << max(10, (per_generation * bits_per_key - 1).bit_length())
        self._mask = bits - 1
        self._per_gen = max(1, per_generation)
        self._cur = bytearray(bits // 8)
        self._old = bytearray(bits // 8)
        self._added = 0

    def _bits(self, key: Hashable) -> tuple[int, int]:
        h = (hash(key) * _MIX) & _MASK64
        return h & self._mask, (h >> 32) & self._mask

    @staticmethod
    def _has(arr: bytearray, a: int, b: int) -> bool:
        return bool(arr[a >> 3] & (1 << (a & 7))) and bool(arr[b >> 3] & (1 << (b & 7)))

    def seen_then_add(self, key: Hashable) -> bool:
        a, b = self._bits(key)
        if self._has(self._cur, a, b):
            return True
        seen = self._has(self._old, a, b)
        self._cur[a >> 3] |= 1 << (a & 7)  # refresh into the current generation
        self._cur[b >> 3] |= 1 << (b & 7)
        self._added += 1
        if self._added >= self._per_gen:
            self._old, self._cur = self._cur, bytearray(len(self._cur))
            self._added = 0
        return seen


class ReuseGate(AdmissionPolicy):
    name = "reuse_gate"

    def __init__(self, capacity_blocks: int, bar: float = GATE_BAR, shadow: bool = True) -> None:
        """``shadow=False``: always gate (no payoff measurement); for studying the classes."""
        if not 0.0 <= bar <= 1.0:
            raise ValueError(f"bar must be within [0, 1], got {bar}")
        self.capacity = max(1024, capacity_blocks)  # 0 (unknown) still gets a usable history
        self.bar = bar
        self._seen = SightingFilter(4 * self.capacity)
        self._first = KeyedList(self.capacity)  # sighted first-timers -> class
        self._pending = KeyedList(self.capacity)  # admitted, no outcome yet -> class
        self._refused = KeyedList(2 * self.capacity)  # -> clock * 8 + class
        self._clock = 0  # blocks admitted so far
        self.reuse: dict[Class, float] = {}  # per class: share of first-timers read in time
        self.pressure = 0.0
        self.refused = 0
        self.shadow = ShadowCaches(capacity_blocks or self.capacity) if shadow else None
        self.gating = not shadow  # on while the shadow caches measure that refusing pays
        self.hints: HintBook | None = None  # retention hints, when a hint source feeds them

    # -- observations -------------------------------------------------------------------
    def record_lookup(self, keys: Sequence[BlockKey]) -> None:
        known_prefix = False  # an earlier block of this lookup was seen before
        deeper = False  # an earlier block of this lookup is new too
        last = len(keys) - 1
        refuse_from = len(keys)  # where a gate that refuses would stop storing
        bar = self.bar * self.pressure
        reuse = self.reuse
        for i, key in enumerate(keys):
            refused = self._refused.pop(key)
            if refused is not None:
                self._outcome(refused & 7, 1.0)
            if self._seen.seen_then_add(key):
                known_prefix = True
                self._first.pop(key)  # sighted twice before being stored: proven
            else:
                cls = (EXTENDS if known_prefix else 0) | (DEEPER if deeper else 0) | (i == last)
                self._first.push_bounded(key, cls)
                deeper = True
                if refuse_from > i and reuse.get(cls, 1.0) < bar:
                    refuse_from = i
        self._expire_refused()
        if self.shadow is not None:
            self.shadow.observe(keys, refuse_from)
            self.gating = (self.shadow.within_budget(self.gating)
                           and self.shadow.gating_pays(self.gating))

    def on_hit(self, key: BlockKey) -> None:
        if self.shadow is not None:
            self.shadow.note_real_hit(key)
        cls = self._pending.pop(key)
        if cls is not None and not cls & UNGATED:
            self._outcome(cls, 1.0)

    def on_evict(self, key: BlockKey) -> None:
        cls = self._pending.pop(key)
        wasted = cls is not None
        if wasted and not cls & UNGATED:
            self._outcome(cls, 0.0)
        self.pressure += RATE * ((0.0 if wasted else 1.0) - self.pressure)

    # -- decision -----------------------------------------------------------------------
    def admit(self, key: BlockKey) -> bool:
        cls = self._first.pop(key)
        if cls is None:  # seen before (or not tracked any more): worth writing
            self._clock += 1
            return True
        hint = self.hints.rank(key) if self.hints is not None else 0
        if hint == ONE_OFF:  # a one-off's never-seen blocks will not be asked for again
            self.refused += 1
            return False
        # A conversation the router says continues faces half the bar.
        if self.reuse.get(cls, 1.0) < self.bar * self.pressure * (0.5 if hint == KEEP else 1.0):
            # Tracked as refused either way (what falls out: no outcome), so the classes learn
            # the same thing whether or not gating is on.
            self._refused.push_bounded(key, self._clock * 8 + cls)
            if self.gating:
                self.refused += 1
                return False
            cls |= UNGATED  # admitted only because gating does not pay: outcome comes from above
        self._clock += 1
        self._pending.push_bounded(key, cls)
        return True

    def would_admit(self, key: BlockKey) -> bool:
        cls = self._first.get(key)
        if cls is None:
            return True
        hint = self.hints.rank(key) if self.hints is not None else 0
        if hint == ONE_OFF:
            return False
        return not self.gating or (self.reuse.get(cls, 1.0)
                                   >= self.bar * self.pressure * (0.5 if hint == KEEP else 1.0))

    # -- internals ----------------------------------------------------------------------
    def _outcome(self, cls: Class, value: float) -> None:
        old = self.reuse.get(cls, 1.0)
        self.reuse[cls] = old + RATE * (value - old)

    def _expire_refused(self) -> None:
        """A refused block not sighted again before ``capacity`` more blocks were admitted would
        have been evicted unread: count it as a correct refusal."""
        horizon = self._clock - self.capacity
        refused = self._refused
        while refused:
            _, packed = refused.first()
            if packed >> 3 > horizon:
                break
            refused.pop_first()
            self._outcome(packed & 7, 0.0)


register_admission(
    "reuse_gate", lambda threshold=1, capacity_blocks=0: ReuseGate(capacity_blocks)
)
