"""Does gating pay on this traffic, at this capacity? Two miniature caches answer it online.

A gate that refuses first-timers wins when the tier is small (what it refuses would have been
evicted unread, and what it keeps stays longer) and loses when the tier is nearly big enough
(a refused block that comes back costs its hit *and* every block behind it, since a prefix hit
stops at the first missing block). Where the crossover lies depends on the trace and the
capacity, so it is measured, not configured: two key-only LRU caches run side by side on the
same lookups, ``admit_all`` storing every missed block (what LRU would do) and ``gated``
storing missed blocks up to the first one the gate would refuse. Gating starts once ``gated``
leads clearly and stops once it trails (``gating_pays``), or once the *real* tier has lost its
budget of hits against the admit-all cache (``within_budget``): what gating can cost against
LRU over a run is bounded by what was measured on the real tier itself.

Both see a spatial sample of the keys (a fixed hash subset, as in miniature simulation /
SHARDS) scaled to ``MINI_BLOCKS`` slots, so the cost per block is O(1) and the memory is
bounded whatever the tier's size; small tiers are simulated in full. A sampled block counts as
a hit only while every earlier sampled block of its lookup hit too (prefix semantics)."""

from __future__ import annotations

from typing import Hashable, Sequence

from kvtier.manager.index.keyed_list import KeyedList

MINI_BLOCKS = 4096  # slots of each miniature cache (a tier up to this size is simulated whole)
TOLERANCE = 0.005  # gating stops once it trails by this share of lookups (0.5 point)
ON_MARGIN = 0.002  # gating starts once it leads by this share of lookups (0.2 point)
SIGMAS = 3.0  # ... and by this many standard deviations of the per-lookup differences
WARMUP = 2  # no gating before this many miniature capacities of sampled lookups were compared
FAST_WINDOW = 16  # a second, short comparison that only ever stops gating ...
FAST_TOLERANCE = 0.02  # ... once gating trails by this share of its lookups (2 points)
BUDGET = 0.0005  # the real tier may trail LRU by this share of all sampled lookups (0.05 point)
BUDGET_HORIZON = 1 << 22  # sampled lookups the budget's counts span (a server runs for ever)
WINDOW = 256  # decay: the comparison spans about WINDOW miniature capacities of sampled lookups
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_SCALE = 1 << 16


class ShadowCaches:
    """The admit-all and gated miniature caches and their decayed hit counts."""

    def __init__(self, capacity_blocks: int, mini_blocks: int = MINI_BLOCKS,
                 window: float = WINDOW, budget_horizon: float = BUDGET_HORIZON) -> None:
        capacity = max(1, capacity_blocks)
        share = min(1.0, mini_blocks / capacity)
        self._threshold = max(1, round(share * _SCALE))  # sample: hash bits below this
        mini = max(1, round(capacity * self._threshold / _SCALE))
        self.mini_blocks = mini
        self._all = KeyedList(mini)
        self._gated = KeyedList(mini)
        self._keep = 1.0 - 1.0 / (window * mini)
        self.hits_all = 0.0  # decayed hits of each cache, decayed sampled lookups
        self.hits_gated = 0.0
        self.looked_up = 0.0
        self._keep_fast = 1.0 - 1.0 / (FAST_WINDOW * mini)
        self.fast_diff = 0.0
        self.fast_looked_up = 0.0
        self.spread = 0.0  # decayed sum of squared per-lookup differences (noise of the lead)
        # The loss budget: the target is the hit rate over a whole run, so these counts decay
        # only over ``BUDGET_HORIZON`` sampled lookups (far longer than any trace we replay),
        # which keeps a server's budget from growing without bound.
        self.lru_hits = 0.0  # hits of the admit-all cache (LRU's hits on the sample)
        self.real_hits = 0.0  # sampled blocks the real tier hit
        self.lookups = 0.0  # sampled blocks looked up
        self._lru_pending = self._lookups_pending = 0  # the lookup whose hits are not in yet
        self._balance_at_start = 0.0  # real - LRU hits when the current gating period began
        self._keep_budget = 1.0 - 1.0 / budget_horizon
        self.strikes = 0  # gating periods stopped for losing their budget

    def note_real_hit(self, key: Hashable) -> None:
        """The real tier hit ``key`` (the gate's ``on_hit``)."""
        if ((hash(key) * _MIX) & _MASK64) >> 48 < self._threshold:
            self.real_hits += 1

    def observe(self, keys: Sequence[Hashable], refuse_from: int) -> None:
        """One lookup: ``keys[refuse_from:]`` are not stored by the gated cache when missed.
        Recency follows the replay convention: hits touched last-to-first, then the missed
        blocks stored in prompt order."""
        threshold = self._threshold
        sample = [(i, key) for i, key in enumerate(keys)
                  if ((hash(key) * _MIX) & _MASK64) >> 48 < threshold]
        if not sample:
            return
        hits_all = self._replay(self._all, sample, len(keys))
        hits_gated = self._replay(self._gated, sample, refuse_from)
        # The real tier reports this lookup's hits after it: compare through the last one.
        keep = self._keep_budget ** len(sample)
        self.lru_hits = self.lru_hits * keep + self._lru_pending
        self.real_hits *= keep
        self.lookups = self.lookups * keep + self._lookups_pending
        self._balance_at_start *= keep
        self._lru_pending, self._lookups_pending = hits_all, len(sample)
        decay = self._keep ** len(sample)
        self.hits_all = self.hits_all * decay + hits_all
        self.hits_gated = self.hits_gated * decay + hits_gated
        self.looked_up = self.looked_up * decay + len(sample)
        self.spread = self.spread * decay + (hits_gated - hits_all) ** 2
        fast = self._keep_fast ** len(sample)
        self.fast_diff = self.fast_diff * fast + hits_gated - hits_all
        self.fast_looked_up = self.fast_looked_up * fast + len(sample)

    @staticmethod
    def _replay(cache: KeyedList, sample: list, store_before: int) -> int:
        k = 0
        while k < len(sample) and sample[k][1] in cache:
            k += 1
        for j in range(k - 1, -1, -1):
            cache.move_to_end(sample[j][1])
        for i, key in sample[k:]:
            if not cache.move_to_end(key) and i < store_before:
                cache.push_bounded(key)
        return k

    def within_budget(self, gating: bool) -> bool:
        """May the real tier (still) gate without losing more than ``BUDGET`` of the lookups
        so far against LRU? The real tier's own hits on the sample are compared with the
        admit-all cache's (an exact LRU when the tier is simulated whole), so every cost of
        gating counts: refused blocks that came back, the lag after a switch, a shadow that
        models the tier imperfectly. Each period of gating starts from the balance it finds
        and is stopped once it lost ``BUDGET`` of all lookups so far (the tier then admits
        everything, i.e. becomes LRU, and stops losing); each such stop doubles the lead the
        shadow must show before gating again, so a tie costs a few budgets, not a steady
        loss."""
        balance = self.real_hits - self.lru_hits
        if not gating:
            self._balance_at_start = balance
            return True
        if balance - self._balance_at_start >= -BUDGET * self.lookups:
            return True
        self.strikes += 1
        return False

    def gating_pays(self, gating: bool) -> bool:
        """Hysteresis: start admitting all (LRU's hits are the floor to protect); gate once the
        gated cache leads by ``ON_MARGIN`` of the lookups, stop once it trails by
        ``TOLERANCE``. Flapping costs more than either mode: a switch pays at once (refused
        blocks come back, or first-timers flush proven blocks) and is repaid only after a
        turnover of the tier. Nothing is decided before ``WARMUP`` miniature capacities of
        lookups were compared."""
        diff = self.hits_gated - self.hits_all
        if gating:
            return (diff >= -TOLERANCE * self.looked_up
                    and self.fast_diff >= -FAST_TOLERANCE * self.fast_looked_up)
        # A lead right after the first fill is a handful of hits: wait for evidence.
        return (diff >= ON_MARGIN * 2 ** self.strikes * self.looked_up
                and diff >= SIGMAS * self.spread ** 0.5
                and self.looked_up >= WARMUP * self.mini_blocks)
