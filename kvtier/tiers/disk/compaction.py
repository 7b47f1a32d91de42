"""Giving dead bytes back: unlink empty segments, compact mostly-dead ones.

Deletes and overwrites only touch the index; the records they orphan stay in their segment as
dead bytes. A sealed segment with no live record left is simply unlinked. A sealed segment whose
live share falls under the threshold is compacted: its live records are read, verified, copied
verbatim (header and sequence number included, so age order is kept) to the active segment,
made durable, re-pointed in one index commit, and the old file is unlinked once nothing live
remains in it. Readers racing the move see their entry change and retry at the new place.

Every method runs with the writer's commit lock held; ``run`` with both locks (exclusive).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.tiers.disk.catalog.index import IndexEntry, IndexWriter
from kvtier.tiers.disk.reader import ReadFailure, read_record

if TYPE_CHECKING:
    from kvtier.tiers.disk.writer import SegmentWriter

log = logging.getLogger(__name__)

_PASS_BYTES = 32 << 20  # records copied per pass: bounds the memory one pass holds


class Compactor:
    def __init__(self, writer: "SegmentWriter", threshold: float, budget: int) -> None:
        self.writer = writer
        self.threshold = threshold
        self.budget = budget  # bytes copied per inline run (after deletes)
        self._copied_out: dict[int, int] = {}  # live bytes moved out of a not-yet-removed segment

    def _sealed_and_idle(self, segs: set[int]) -> set[int]:
        """Segments that no append can reach: below the active id (ids only grow, so a stale
        read of it errs on the safe side) and holding no uncommitted records."""
        active = self.writer.files.active_id
        return {s for s in segs if s < active} - self.writer.in_flight()

    def drop_empty(self, segs: set[int]) -> int:
        """Unlink the sealed segments among ``segs`` with no live record; net bytes freed."""
        w = self.writer
        segs = self._sealed_and_idle(segs)
        if not segs:
            return 0
        with w.index.read() as v:
            empties = {
                s: info.end for s in segs
                if (info := v.segment(s)) is not None and info.live_records == 0
            }
        if not empties:
            return 0
        freed = sum(max(0, end - self._copied_out.pop(s, 0)) for s, end in empties.items())

        def drop(ix: IndexWriter) -> None:
            for s in empties:
                ix.drop_segment(s)
            ix.add_meta_int("reclaimed_bytes", freed)

        w.commit(drop, "segment removal")
        for s in empties:
            w.files.remove(s)
        return freed

    def _candidates(self, skip: set[int]) -> list[int]:
        with self.writer.index.read() as v:
            segs = v.segments()
        sealed = self._sealed_and_idle(set(segs))
        empties = {s for s in sealed if segs[s].live_records == 0}
        if empties:
            self.drop_empty(empties)
        found = [
            (i.live_bytes / i.end, s) for s, i in segs.items()
            if s in sealed and s not in skip and s not in empties
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
        w = self.writer
        items: list[tuple[bytes, IndexEntry]] = []
        used = 0
        finished = True
        with w.index.read() as v:
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
            r = read_record(w.files, key, e, w.block_bytes)
            if isinstance(r, ReadFailure) and r.transient:  # may be intact: leave it in place
                log.warning("kvtier disk tier: compaction skips block %s for now: %s",
                            key.hex()[:32], r.reason)  # (no retry in this run: no loop)
            elif isinstance(r, ReadFailure):
                log.warning(
                    "kvtier disk tier: compaction drops block %s (segment %d @ %d): %s",
                    key.hex()[:32], e.segment, e.offset, r.reason,
                )
                bad.append((key, e, r))
            else:
                good.append((key, e, r))
        places: list[tuple[int, int]] = []
        sealed: set[int] = set()
        if good:
            places, sealed = w.append([([buf], e.length) for _k, e, buf in good])

        def repoint(ix: IndexWriter) -> None:
            for (key, e, _buf), (s, off) in zip(good, places):
                if ix.entry(key) == e:
                    ix.put(key, e._replace(segment=s, offset=off))
            for key, e, failure in bad:
                ix.delete(key, expect=e)
                ix.add_meta_int(failure.kind, 1)

        try:
            w.commit(repoint, "compaction")
        finally:
            w.settle(sealed)
        copied = sum(e.length for _k, e, _b in good)
        self._copied_out[seg] = self._copied_out.get(seg, 0) + copied
        return copied, self.drop_empty({seg} | sealed), finished
