"""Giving dead bytes back: unlink empty segments, compact mostly-dead ones.

Deletes and overwrites only touch the index; the records they orphan stay in their segment as
dead bytes. A sealed segment with no live record left is simply unlinked. A sealed segment whose
live share falls under the threshold is compacted: its live records are read, verified, copied
verbatim (header and sequence number included, so age order is kept) to the active segment,
made durable, re-pointed in one index commit, and the old file is unlinked once nothing live
remains in it. Readers racing the move see their entry change and retry at the new place.

Every method runs with the store's writer lock held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.tiers.disk.index import IndexEntry, IndexWriter
from kvtier.tiers.disk.reader import ReadFailure, read_record

if TYPE_CHECKING:
    from kvtier.tiers.disk.store import DiskStore

log = logging.getLogger(__name__)

_PASS_BYTES = 32 << 20  # records copied per pass: bounds the memory one pass holds


class Compactor:
    def __init__(self, store: "DiskStore", threshold: float, budget: int) -> None:
        self.store = store
        self.threshold = threshold
        self.budget = budget  # bytes copied per inline run (after deletes)
        self._copied_out: dict[int, int] = {}  # live bytes moved out of a not-yet-removed segment

    def drop_empty(self, segs: set[int]) -> int:
        """Unlink the sealed segments among ``segs`` with no live record; net bytes freed."""
        store = self.store
        active = store._files.active_id
        with store._index.read() as v:
            empties = {
                s: info.end for s in segs
                if s != active and (info := v.segment(s)) is not None and info.live_records == 0
            }
        if not empties:
            return 0
        freed = sum(max(0, end - self._copied_out.pop(s, 0)) for s, end in empties.items())

        def drop(w: IndexWriter) -> None:
            for s in empties:
                w.drop_segment(s)
            w.add_meta_int("reclaimed_bytes", freed)

        store._commit(drop, "segment removal")
        for s in empties:
            store._files.remove(s)
        return freed

    def _candidates(self, skip: set[int]) -> list[int]:
        store = self.store
        active = store._files.active_id
        with store._index.read() as v:
            segs = v.segments()
        empties = {s for s, i in segs.items() if s != active and i.live_records == 0}
        if empties:
            self.drop_empty(empties)
        found = [
            (i.live_bytes / i.end, s) for s, i in segs.items()
            if s != active and s not in skip and s not in empties
            and i.end > 0 and i.live_bytes < self.threshold * i.end
        ]
        return [s for _, s in sorted(found)]

    def run(self, budget: int | None) -> int:
        """Compact candidates, most-dead first, copying at most ``budget`` bytes (None: all).

        Returns the net bytes given back to the file system.
        """
        freed = 0
        left = budget
        done: set[int] = set()
        while left is None or left > 0:
            candidates = self._candidates(done)
            if not candidates:
                break
            seg = candidates[0]
            limit = _PASS_BYTES if left is None else min(left, _PASS_BYTES)
            copied, freed_now, finished = self._compact_pass(seg, limit)
            freed += freed_now
            if left is not None:
                left -= max(copied, 1)
            if finished:
                done.add(seg)  # even if something stayed behind, never loop on one segment
        return freed

    def _compact_pass(self, seg: int, limit: int) -> tuple[int, int, bool]:
        """Move up to ``limit`` bytes of ``seg``'s live records; (copied, freed, reached end)."""
        store = self.store
        items: list[tuple[bytes, IndexEntry]] = []
        used = 0
        finished = True
        with store._index.read() as v:
            for off, key in v.live_in_segment(seg):
                if used >= limit:
                    finished = False
                    break
                e = v.entry(key)
                if e is None or (e.segment, e.offset) != (seg, off):
                    continue
                items.append((key, e))
                used += e.length
        good: list[tuple[bytes, IndexEntry, bytearray]] = []
        bad: list[tuple[bytes, IndexEntry, ReadFailure]] = []
        for key, e in items:
            r = read_record(store._files, key, e)
            if isinstance(r, ReadFailure):
                log.warning(
                    "kvtier disk tier: compaction drops block %s (segment %d @ %d): %s",
                    key.hex()[:32], e.segment, e.offset, r.reason,
                )
                bad.append((key, e, r))
            else:
                good.append((key, e, r))
        places = store._append([([buf], e.length) for _k, e, buf in good]) if good else []

        def repoint(w: IndexWriter) -> None:
            for (key, e, _buf), (s, off) in zip(good, places):
                if w.entry(key) == e:
                    w.put(key, e._replace(segment=s, offset=off))
            for key, e, failure in bad:
                w.delete(key, expect=e)
                w.add_meta_int(failure.kind, 1)

        store._commit(repoint, "compaction")
        copied = sum(e.length for _k, e, _b in good)
        self._copied_out[seg] = self._copied_out.get(seg, 0) + copied
        return copied, self.drop_empty({seg}), finished
