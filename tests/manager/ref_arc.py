"""A reference ARC for tests: four OrderedDicts, one key at a time, the rules kvtier's
ARC follows (the manager decides when to evict; a removed key becomes a ghost). The pooled,
inline ARC (kvtier/manager/policies/arc.py) is checked against it step by step."""

from __future__ import annotations

from collections import OrderedDict


class RefARC:
    """ARC on four OrderedDicts, one key at a time (the rules of kvtier's ARC)."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def insert(self, key) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        if key in self.b1:
            del self.b1[key]
            self.p = min(float(self.c), self.p + max(len(self.b2) / (len(self.b1) + 1), 1.0))
            self.t2[key] = None
        elif key in self.b2:
            del self.b2[key]
            self.p = max(0.0, self.p - max(len(self.b1) / (len(self.b2) + 1), 1.0))
            self.t2[key] = None
        else:
            self.t1[key] = None
        self.trim()

    def access(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self.trim()

    def trim(self) -> None:
        t1, t2, b1, b2, c = self.t1, self.t2, self.b1, self.b2, self.c
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)
        while b1 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b1.popitem(last=False)

    def victims(self, n: int, ok=lambda key: True) -> list:
        out: list = []
        it1 = (k for k in self.t1 if ok(k))
        it2 = (k for k in self.t2 if ok(k))
        left = len(self.t1)
        while len(out) < n:
            order = (it1, it2) if left > self.p else (it2, it1)
            key = src = None
            for src in order:
                key = next(src, None)
                if key is not None:
                    break
            if key is None:
                break
            if src is it1:
                left -= 1
            out.append(key)
        return out

    def lists(self) -> tuple:
        """The four lists, oldest first, and the target ``p``."""
        return [list(x) for x in (self.t1, self.t2, self.b1, self.b2)], self.p
