"""Copies of a chained job's next (immediate) hop that start before the hop in front of it ends.

A shared-tier load is two hops: REMOTE -> CPU (the I/O processes read and verify blocks into
CPU slots), then CPU -> GPU. Run strictly in turn, the GPU copy of a 32k-token hit waited for
the whole read and then took as long as a CPU hit's load. But the read verifies blocks all
along its length, and a verified slot does not change again while its load holds it (prepare
-> complete). So while the read goes on, its handler reports the slots that are final
(``TransferHandler.run_reporting``), and the caller's next call into the engine starts the GPU
copies of those (``EarlyCopies.take``: a *piece*, an ordinary hop of the same route over fewer
blocks); when the read ends only the rest is copied (``EarlyCopies.rest``). Blocks the read
does not write (CPU hits in the same load) are ready from the start.

What holds:

* a piece copies only blocks the read reported, or blocks it does not write;
* every block is copied once: the rest excludes what the pieces took;
* the job ends only after its pieces are done, also when the read fails: vLLM recomputes the
  blocks of a failed load, and a piece landing after that would overwrite them
  (``ImmediateHops.end_early``). A block reported ready that the read then fails (its I/O
  process lost before it answered) was copied from a verified slot; the job's result still
  fails it, so the engine distrusts it: safe, only wasted.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kvtier.manager.specs import LoadStoreSpec
from kvtier.transfer.handlers import ImmediateHandler
from kvtier.transfer.jobs import Hop, TransferOutcome

PIECES = 8  # a piece holds at least this fraction of the hop: each costs a launch and events
MIN_PIECE_BLOCKS = 16  # ... and at least this many blocks


class EarlyCopies:
    """One job's next hop (CPU slots -> GPU blocks), taken apart as its source slots become
    final. Not thread-safe: :class:`~kvtier.transfer.immediate.ImmediateHops` holds a lock."""

    def __init__(self, hop: Hop, written: Iterable[int], handler: ImmediateHandler) -> None:
        """``hop``: the next hop; ``written``: the CPU slots the running hop writes (the
        others are final already)."""
        src, dst = hop
        self.src, self.dst = src, dst
        self.handler = handler
        self.per = len(dst.ids) // len(src.ids) if src.ids else 0
        self._where: dict[int, list[int]] = {}
        for i, slot in enumerate(src.ids):
            self._where.setdefault(slot, []).append(i)
        self._started = bytearray(len(src.ids))
        busy = set(written)
        self._ready = [i for i, slot in enumerate(src.ids) if slot not in busy]
        self.min_blocks = max(MIN_PIECE_BLOCKS, -(-len(src.ids) // PIECES))
        self.pieces: list[Any] = []  # handles of the pieces started
        self.open = True  # pieces may still start

    @staticmethod
    def fits(hop: Hop) -> bool:
        """Whether a hop can be taken apart by source slot: ``per`` GPU ids per slot."""
        src, dst = hop
        return bool(src.ids) and len(dst.ids) % len(src.ids) == 0

    def add_ready(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._ready.extend(self._where.get(int(slot), ()))

    def take(self) -> tuple[list[int], Hop] | None:
        """A piece of the blocks that became final and are not copied yet, once enough are:
        (its positions in the hop, the hop). Mark it ``started`` once it is enqueued."""
        if not self.open or len(self._ready) < self.min_blocks:
            return None
        todo = sorted({i for i in self._ready if not self._started[i]})
        self._ready = todo
        if len(todo) < self.min_blocks:
            return None
        return todo, self._hop(todo)

    def started(self, indices: list[int], handle: Any) -> None:
        """The piece at ``indices`` was enqueued: the rest leaves it out."""
        for i in indices:
            self._started[i] = 1
        self._ready = [i for i in self._ready if not self._started[i]]
        self.pieces.append(handle)

    def rest(self) -> Hop | None:
        """What no piece copied (the hop ran in front of it ended): None if nothing."""
        self.open = False
        todo = [i for i, s in enumerate(self._started) if not s]
        return self._hop(todo) if todo else None

    def _hop(self, indices: list[int]) -> Hop:
        per, src, dst = self.per, self.src.ids, self.dst.ids
        return (LoadStoreSpec.cpu([src[i] for i in indices]),
                LoadStoreSpec.gpu([b for i in indices for b in dst[i * per:(i + 1) * per]],
                                  self.dst.whole))


class Pieces:
    """An immediate hop's handles, run as one: a hop started whole is one piece."""

    def __init__(self, handler: ImmediateHandler, handles: list[Any]) -> None:
        self.handler = handler
        self.handles = handles

    def poll(self) -> TransferOutcome | None:
        outcomes = []
        for h in self.handles:
            out = self.handler.poll(h)
            if out is None:
                return None
            outcomes.append(out)
        return self._sum(outcomes)

    def finish(self) -> TransferOutcome:
        return self._sum([self.handler.finish(h) for h in self.handles])

    def fence(self) -> None:
        for h in self.handles:
            self.handler.fence(h)

    def fence_layer(self, layer: int) -> None:
        for h in self.handles:
            self.handler.fence_layer(h, layer)

    @staticmethod
    def _sum(outcomes: list[TransferOutcome]) -> TransferOutcome:
        """Bytes and device seconds add up (the pieces' copies, not the read they overlapped:
        what the cost model learns the CPU -> GPU bandwidth from)."""
        if len(outcomes) == 1:
            return outcomes[0]
        seconds = [o.seconds for o in outcomes]
        return TransferOutcome(
            bytes=sum(o.bytes for o in outcomes),
            seconds=None if any(s is None for s in seconds) else sum(seconds),
            failed_keys=tuple(k for o in outcomes for k in o.failed_keys),
            transient_keys=tuple(k for o in outcomes for k in o.transient_keys))
