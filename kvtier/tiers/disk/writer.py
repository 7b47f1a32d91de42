"""The write side of the disk tier: appends, syncs and index commits.

A batch is made durable in two steps: its records are appended to the active segment and
synced (``fdatasync``), then its index entries are committed in one LMDB transaction (which
syncs the index). Data is durable before the index names it, so the index only ever points
at complete records.

Two locks, always taken in this order:

- ``append_lock``: the active segment (appends, rotation), sequence numbers;
- ``commit_lock``: index commits, which land in the order their data was appended.

A put group appends and syncs under the append lock, then takes the commit lock *before* it
lets the append lock go (hand-over-hand). The next group's append and data sync therefore
overlap this group's index commit and sync, while commits still land in append order.
Deletes, compaction and the dropping of corrupt entries take both locks (``exclusive()``).

A sealed segment may hold records that are appended but not yet committed (the previous
group's commit may be running while this group rotates); such segments are *in flight* and are
never removed as empty until the records are published.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import lmdb

from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.errors import DiskWriteError
from kvtier.tiers.disk.group_commit import GroupCommit
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexEntry, IndexWriter
from kvtier.tiers.record import MAX_KEY_BYTES, data_checksum, encode_head, record_length
from kvtier.tiers.disk.segments import Buffer, SegmentFiles
from kvtier.tiers.layout import LAYOUT_VERSION

log = logging.getLogger(__name__)

Prepared = tuple[bytes, int, Buffer, int, int]  # key, codec, stored bytes, checksum, length
Record = tuple[list[Buffer], int]  # buffers written back to back, their total length


def as_bytes_view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def valid_key(key: object) -> bool:
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


class SegmentWriter:
    def __init__(
        self, files: SegmentFiles, index: BlockIndex, codec: BlockCodec, *, block_bytes: int,
        segment_bytes: int, fsync: bool, next_seq: int, next_seg: int, describe: str,
    ) -> None:
        self.files = files
        self.index = index
        self.codec = codec
        self.block_bytes = block_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.describe = describe
        self.next_seq = next_seq
        self.next_seg = next_seg
        self.append_lock = threading.Lock()
        self.commit_lock = threading.Lock()
        self._mutex = threading.Lock()  # guards the two dicts below
        self._unsaved: dict[str, int] = {}  # counters not yet written to the index
        self._inflight: dict[int, int] = {}  # segment -> groups appended, not yet committed
        self._group: GroupCommit[list[Prepared]] = GroupCommit(self._write_group)
        # set by the store: unlink those of the given segments left empty (the compactor's
        # drop_empty); a callable, so the writer needs nothing of compaction.py
        self.drop_empty: Callable[[set[int]], int] | None = None
        self.closed = False

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self.append_lock, self.commit_lock:
            yield

    # -- counters and in-flight segments -----------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._mutex:
            self._unsaved[name] = self._unsaved.get(name, 0) + n

    def unsaved(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._unsaved)

    def in_flight(self) -> set[int]:
        with self._mutex:
            return {s for s, n in self._inflight.items() if n > 0}

    def _mark_in_flight(self, segs: set[int], delta: int) -> None:
        with self._mutex:
            for s in segs:
                n = self._inflight.get(s, 0) + delta
                if n > 0:
                    self._inflight[s] = n
                else:
                    self._inflight.pop(s, None)

    # -- put ----------------------------------------------------------------------------------
    def prepare(self, key: bytes, payload: Buffer) -> Prepared:
        """Validate, compress and checksum one block (no lock: runs on the caller's thread)."""
        if not valid_key(key):
            raise ValueError(
                f"disk block key must be 1..{MAX_KEY_BYTES} bytes, got "
                f"{type(key).__name__} of length {len(key) if isinstance(key, bytes) else '?'}"
            )
        mv = as_bytes_view(payload)
        if mv.nbytes != self.block_bytes:
            raise ValueError(
                f"disk block payload must be {self.block_bytes} bytes ({self.describe}), "
                f"got {mv.nbytes}"
            )
        codec, stored = self.codec.encode(mv)
        return key, codec, stored, data_checksum(key, stored), record_length(len(key), len(stored))

    def put(self, prepared: list[Prepared]) -> None:
        """Append, sync and publish one batch (merged with concurrent callers' batches)."""
        self._group.submit(prepared)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("DiskStore is closed")

    def _write_group(self, batches: Sequence[list[Prepared]], handoff: Callable[[], None]) -> None:
        prepared = [p for batch in batches for p in batch]
        bb = self.block_bytes
        self.append_lock.acquire()
        try:
            self.check_open()
            seq0 = self.next_seq
            self.next_seq += len(prepared)
            records = [
                ([encode_head(key, codec=codec, layout_version=LAYOUT_VERSION, seq=seq0 + i,
                              raw_len=bb, stored_len=len(stored), checksum=csum), stored], length)
                for i, (key, codec, stored, csum, length) in enumerate(prepared)
            ]
            places, sealed = self.append(records)
            end = (self.files.active_id, self.files.active_end)
        except BaseException:
            self.append_lock.release()
            raise
        self.commit_lock.acquire()
        self.append_lock.release()
        handoff()  # the next group may append and sync while this one commits
        freed: set[int] = set(sealed)
        try:
            now = time.time()
            next_seq = seq0 + len(prepared)

            def publish(w: IndexWriter) -> None:
                for i, ((key, codec, _s, csum, length), (seg, off)) in enumerate(
                    zip(prepared, places)
                ):
                    old = w.put(key, IndexEntry(seg, off, length, csum, codec, LAYOUT_VERSION,
                                                seq0 + i, bb, now))
                    if old is not None:
                        freed.add(old.segment)
                if w.meta_int("next_seq") < next_seq:
                    w.set_meta_int("next_seq", next_seq)

            self.commit(publish, "index commit", end=end)
        finally:
            self.settle(sealed)
            try:
                if self.drop_empty is not None:
                    self.drop_empty(freed)
            finally:
                self.commit_lock.release()

    # -- appending (append lock held) ---------------------------------------------------------
    def append(self, records: list[Record]) -> tuple[list[tuple[int, int]], set[int]]:
        """Append records (rotating segments as needed) and make them durable.

        Returns ``(segment, offset)`` per record and the segments sealed on the way. Sealed
        segments stay *in flight* (never removed as empty) until the caller, after committing
        the records, passes them to :meth:`settle`: they may hold this or an earlier,
        still-committing group's records that the index does not show yet.

        On an I/O error the partial tail is cut off (or, if that fails too, left as dead bytes
        in a segment that gets sealed) and DiskWriteError is raised.
        """
        files = self.files
        places: list[tuple[int, int]] = []
        sealed: set[int] = set()
        pending: list[Buffer] = []
        start = end = files.active_end
        try:
            for bufs, length in records:
                if end > 0 and end + length > self.segment_bytes:
                    self._flush(pending)
                    pending = []
                    self._mark_in_flight({files.active_id}, +1)  # before it counts as sealed
                    sealed.add(files.active_id)
                    self._rotate()
                    start = end = 0
                places.append((files.active_id, end))
                pending.extend(bufs)
                end += length
            self._flush(pending)
        except OSError as exc:
            if not files.rollback(start):
                self._rotate_after_error()
            self.settle(sealed)
            self.count("write_errors")
            raise DiskWriteError.wrap(exc, f"writing to {files.path(files.active_id)}") from exc
        return places, sealed

    def settle(self, sealed: set[int]) -> None:
        """The records an append put into ``sealed`` segments are committed (or abandoned)."""
        self._mark_in_flight(sealed, -1)

    def _flush(self, bufs: list[Buffer]) -> None:
        if bufs:
            self.files.append(bufs, kick=self.fsync)
            if self.fsync:
                self.files.sync_active()

    def _rotate(self) -> int:
        """Seal the active segment and start the next one (registered in the index)."""
        old, end = self.files.active_id, self.files.active_end
        new = self.next_seg
        self.files.create(new, sync_dir=self.fsync)
        self.next_seg += 1

        def register(w: IndexWriter) -> None:
            w.set_segment_end(old, end)
            w.set_segment_end(new, 0)
            w.set_meta_int("next_segment", self.next_seg)

        self.commit(register, "segment registration", wrap=False)
        return old

    def _rotate_after_error(self) -> None:
        try:
            self._rotate()
        except (OSError, lmdb.Error) as exc:  # the next write tries again
            log.error("kvtier disk tier: cannot start a new segment after a write error: %s", exc)

    # -- index commits ------------------------------------------------------------------------
    def commit(
        self, fn: Callable[[IndexWriter], object], what: str, *, wrap: bool = True,
        end: tuple[int, int] | None = None,
    ) -> None:
        """Run ``fn`` in one index write txn; counters not yet saved ride along.

        ``end``: (segment, offset) up to which the active segment's bytes are accounted for;
        defaults to the current end (caller holds the append lock).
        """
        seg, off = end if end is not None else (self.files.active_id, self.files.active_end)
        with self._mutex:
            counts, self._unsaved = self._unsaved, {}
        try:
            with IndexWriter(self.index) as w:
                fn(w)
                w.set_segment_end(seg, off)
                for name, n in counts.items():
                    w.add_meta_int(name, n)
        except lmdb.Error as exc:
            with self._mutex:
                for name, n in counts.items():
                    self._unsaved[name] = self._unsaved.get(name, 0) + n
            self.count("write_errors")
            if wrap:
                raise DiskWriteError.wrap(exc, what) from exc
            raise OSError(f"kvtier disk tier: {what} failed: {exc}") from exc
