"""Experimental placement policy for issue 7, kept as a lab script (not a plug-in; see
benchmarks/results/placement_policies.md for its results and why it stays out of the manager).

``HazardCache``: eviction *and* admission driven by a reuse hazard learned online from the
lookup stream (not from the cache's own hits, so refusing or evicting never blinds it).

Why: on the Mooncake trace the chance that a prefix returns depends little on how long it has
been idle, but strongly on how often it was used: P(root reused within 100 requests) is 0.02
after its first request, 0.13 after the 2nd, 0.26 after the 4th, 0.57 after the 8th. Chats are
the opposite (recency). So each block gets a *class* at every sighting (its own sighting count,
the lookup's root count for new blocks, last-block-of-lookup), and per class a histogram of
"reached idle age bucket b" (S) and "re-sighted at idle age bucket b" (H) is kept (log2 age
buckets in requests). score(class, age) = P(sighted again within the next T requests | class,
idle >= age), T = the recent residency time of victims. Resident blocks sit in one LRU list per
class; the victim is the list head with the lowest score (a constant number of lists, so O(1)
per block). Admission: a block is written only if its score at age 0 beats the current victim's.

Run: ``python benchmarks/policy_lab.py --trace FILE | --shape S --seed N [--summary]``.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict, deque
from typing import Sequence

from policy_sim import SimResult, compare, format_summary, format_table, infinite
from policy_sim import simulate as sim_simulate
from kvtier.manager.admission import AdmissionPolicy, make_admission
from kvtier.manager.admission import reuse_gate as _rg  # noqa: F401
from kvtier.manager.policies import EvictionPolicy

NB = 17  # age buckets: bucket(a) = a.bit_length(), a in requests, capped
_CNT_B = (0, 1, 2, 3, 3, 4, 4, 4, 4)  # sighting count -> bucket (9+ -> 5)


def _cb(n: int) -> int:
    return _CNT_B[n] if n < 9 else 5


def _ab(a: int) -> int:
    b = a.bit_length()
    return b if b < NB else NB - 1


def _bstart(b: int) -> int:
    return 0 if b == 0 else 1 << (b - 1)


class HazardCache(EvictionPolicy, AdmissionPolicy):
    name = "hz"

    def __init__(self, capacity: int, admit_mode: str = "all", prior: float = 20.0,
                 history: int = 8, use_root: bool = True, use_last: bool = True,
                 t_mult: float = 1.0, monotone: bool = True, age_mono: bool = True) -> None:
        self.age_mono = age_mono
        self.monotone = monotone
        self.capacity = capacity
        self.admit_mode = admit_mode  # all | self | gate | self+gate
        self.gate = make_admission("reuse_gate", capacity_blocks=capacity) if "gate" in admit_mode else None
        self.prior = prior
        self.use_root, self.use_last = use_root, use_last
        self.t_mult = t_mult
        self.now = 0
        self.hist_bound = history * max(1024, capacity)
        self.hist: OrderedDict = OrderedDict()  # key -> [last_seen, count, class]
        self.H: dict = {}  # class -> [hits per age bucket]
        self.S: dict = {}  # class -> [reached age bucket]
        self.q: list[deque] = [deque() for _ in range(NB)]  # (key, t) waiting to reach bucket b
        self.score: dict = {}
        self.lists: dict = {}  # class -> OrderedDict(key -> last_access)
        self.where: dict = {}  # resident key -> class
        self.T = 64.0
        self.pending_cls: dict = {}  # keys of the current lookup -> class (for insert)
        self.wpr = 0.0  # EMA of blocks written per request
        self._writes = 0
        self._recompute()

    # -- learning -----------------------------------------------------------------------
    def _cls(self, cnt: int, root_cnt: int, last: bool):
        if cnt > 1:
            return (_cb(cnt), 0, last and self.use_last)
        return (1, _cb(root_cnt) if self.use_root else 0, last and self.use_last)

    def _arr(self, d, c):
        a = d.get(c)
        if a is None:
            a = d[c] = [0.0] * NB
        return a

    def record_lookup(self, keys: Sequence) -> None:
        if self.gate is not None:
            self.gate.record_lookup(keys)
        self.now += 1
        now = self.now
        self.wpr += 0.01 * (self._writes - self.wpr)
        self._writes = 0
        self.T = self.capacity / max(self.wpr, 1e-3)
        self._advance()
        hist = self.hist
        root = hist.get(keys[0])
        root_cnt = (root[1] if root else 0) + 1
        last = len(keys) - 1
        pend = self.pending_cls = {}
        for i, k in enumerate(keys):
            e = hist.get(k)
            if e is not None:
                b = _ab(now - e[0])
                self._arr(self.H, e[2])[b] += 1
                cnt = e[1] + 1
                hist.move_to_end(k)
            else:
                cnt = 1
            c = self._cls(cnt, root_cnt, i == last)
            hist[k] = [now, cnt, c]
            self._arr(self.S, c)[0] += 1
            self.q[1].append((k, now))
            pend[k] = c
        while len(hist) > self.hist_bound:
            hist.popitem(last=False)
        if now % 64 == 0:
            self._recompute()

    def _advance(self) -> None:
        """Entries whose idle age crossed a bucket start are counted as having reached it."""
        now, hist = self.now, self.hist
        for b in range(1, NB):
            q = self.q[b]
            lim = now - _bstart(b)
            while q and q[0][1] <= lim:
                k, t = q.popleft()
                e = hist.get(k)
                if e is None or e[0] != t:
                    continue  # re-sighted or forgotten
                self._arr(self.S, e[2])[b] += 1
                if b + 1 < NB:
                    self.q[b + 1].append((k, t))

    def _recompute(self) -> None:
        # global prior per bucket
        T = max(1, min(1 << 20, int(self.T * self.t_mult)))
        gH, gS = [0.0] * NB, [0.0] * NB
        for c, s in self.S.items():
            h = self.H.get(c, [0.0] * NB)
            for b in range(NB):
                gH[b] += h[b]
                gS[b] += s[b]

        def table(h, s, prior_tab):
            out = []
            for b in range(NB):
                a = max(1, _bstart(b))
                lo, hi = a, a + T  # window of ages [lo, hi)
                num = 0.0
                for j in range(max(1, b), _ab(hi) + 1):
                    jl, jh = _bstart(j), (1 << j)
                    ov = min(hi, jh) - max(lo, jl)
                    if ov > 0:
                        num += h[j] * ov / (jh - jl)
                den = s[b]
                if prior_tab is None:
                    out.append(num / den if den > 0 else 0.0)
                else:
                    out.append((num + self.prior * prior_tab[b]) / (den + self.prior))
            return out

        g = table(gH, gS, None)
        score = {c: table(self.H.get(c, [0.0] * NB), s, g) for c, s in self.S.items()}
        if self.age_mono:
            # Never value a block more for being older: old-age buckets have few samples, and
            # a noisy bump there would keep dead blocks (chat at C=6k lost 2.6 pt without this).
            for c, t in score.items():
                for b in range(1, NB):
                    if t[b] > t[b - 1]:
                        t[b] = t[b - 1]
        if self.monotone:
            # A parent is sighted whenever its child is, so its count is >= the child's; keep
            # scores non-decreasing in count so a chain is never cut above a kept block.
            run = [0.0] * NB
            for cb in range(1, 6):
                cs = [c for c in score if c[0] == cb]
                for c in cs:
                    run = [max(x, y) for x, y in zip(run, score[c])]
                for c in cs:
                    score[c] = [x + 1e-6 * cb for x in run] if cb > 1 else score[c]
        self.score = score
        self.g = g
        # decay for adaptivity
        if self.now % 4096 == 0:
            for d in (self.H, self.S):
                for a in d.values():
                    for b in range(NB):
                        a[b] *= 0.5

    def _sc(self, c, age: int) -> float:
        t = self.score.get(c)
        if t is None:
            t = self.g
        b = _ab(age)
        if b == 0 or b >= NB - 1:
            return t[b]
        lo = 1 << (b - 1)  # interpolate within the log2 bucket, so age still orders ties
        return t[b] + (t[b + 1] - t[b]) * (age - lo) / lo

    # -- eviction contract ----------------------------------------------------------------
    def insert(self, key, parent=None) -> None:
        c = self.pending_cls.get(key)
        if c is None:
            e = self.hist.get(key)
            c = e[2] if e else (1, 0, False)
        self._writes += 1
        self._place(key, c)

    def _place(self, key, c) -> None:
        old = self.where.get(key)
        if old is not None:
            del self.lists[old][key]
        lst = self.lists.get(c)
        if lst is None:
            lst = self.lists[c] = OrderedDict()
        lst[key] = self.now
        self.where[key] = c

    def access(self, key) -> None:
        if key not in self.where:
            return
        c = self.pending_cls.get(key) or self.where[key]
        self._place(key, c)

    def remove(self, key) -> None:
        c = self.where.pop(key, None)
        if c is not None:
            self.lists[c].pop(key)

    def _heads(self):
        return [(c, iter(l)) for c, l in self.lists.items() if l]

    def victims(self, n: int, evictable) -> list:
        out = []
        its = []
        for c, l in self.lists.items():
            if l:
                it = iter(l.items())
                its.append([c, it, next(it, None)])
        now = self.now
        while len(out) < n:
            best, bs = None, 2.0
            for e in its:
                if e[2] is None:
                    continue
                s = self._sc(e[0], now - e[2][1])
                if s < bs:
                    best, bs = e, s
            if best is None:
                break
            k = best[2][0]
            best[2] = next(best[1], None)
            if evictable(k):
                out.append(k)
        return out

    def victim_score(self) -> float:
        best = 2.0
        now = self.now
        for c, l in self.lists.items():
            if l:
                k, t = next(iter(l.items()))
                s = self._sc(c, now - t)
                if s < best:
                    best = s
        return best

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key) -> bool:
        return key in self.where

    # -- admission contract ---------------------------------------------------------------
    def on_hit(self, key) -> None:
        if self.gate is not None:
            self.gate.on_hit(key)

    def on_evict(self, key) -> None:
        if self.gate is not None:
            self.gate.on_evict(key)

    def admit(self, key) -> bool:
        if self.gate is not None and not self.gate.admit(key):
            return False
        if "self" in self.admit_mode and len(self.where) + 1 > self.capacity:
            c = self.pending_cls.get(key, (1, 0, False))
            if self._sc(c, 0) < self.victim_score():
                return False
        return True


def make(spec: str, capacity: int):
    """Lab spec: ``hz[:admit][,opt=val...]`` e.g. ``hz:self``, ``hz:gate``, ``hz:self+gate``."""
    head, *opts = spec.split("/")
    _, _, mode = head.partition(":")
    kw = {}
    for o in opts:
        k, _, v = o.partition("=")
        kw[k] = type({"prior": 1.0, "history": 1, "use_root": True, "use_last": True,
                      "t_mult": 1.0, "monotone": True, "age_mono": True}[k])(v in ("1", "True") if k.startswith("use") or k in ("monotone", "age_mono") else v)
    return HazardCache(capacity, mode or "all", **kw)


def run(trace, capacity: int, spec: str) -> SimResult:
    if spec.startswith("hz"):
        p = make(spec, capacity)
        r = sim_simulate(trace, capacity, "x", policy=p, admission=p)
        r.policy = spec
        return r
    return sim_simulate(trace, capacity, spec)


def main(argv=None) -> int:
    from trace_gen import SHAPES, generate

    from kvtier.bench.trace import load_trace

    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace")
    src.add_argument("--shape", choices=SHAPES)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--capacity-blocks", default="1000,4000,16000")
    ap.add_argument("--policies", default="lru+reuse_gate,hz,hz:self,hz:gate")
    ap.add_argument("--no-belady", action="store_true")
    ap.add_argument("--summary", action="store_true")
    a = ap.parse_args(argv)
    trace = load_trace(a.trace) if a.trace else generate(a.shape, 4000, a.seed)
    caps = [int(c) for c in a.capacity_blocks.split(",")]
    specs = [s for s in a.policies.split(",") if s]
    res = compare(trace, caps, specs, with_belady=not a.no_belady, run=run)
    print(format_summary(res) if a.summary else format_table(res, infinite(trace)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
