"""Group commit: concurrent ``put_many`` calls share one append, one sync and one commit.

Several transfer threads store batches at once. Syncing each batch on its own serialises them
behind one ``fdatasync`` each; instead the first caller becomes the *leader* and writes every
batch queued at that moment as one group, while later callers queue for the next group. The
leader calls ``handoff()`` once its data is appended (its index commit may still be running),
which lets the next group's leader start: appends of group N+1 overlap the commit of group N.
Each caller returns only once its own batch is durable and indexed, or raises its group's
error. With a single caller this is exactly one write/sync/commit per call.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class _Ticket(Generic[T]):
    __slots__ = ("batch", "taken", "done", "error")

    def __init__(self, batch: T) -> None:
        self.batch = batch
        self.taken = False  # a leader has picked it up
        self.done = False
        self.error: BaseException | None = None


class GroupCommit(Generic[T]):
    def __init__(self, write_group: Callable[[Sequence[T], Callable[[], None]], None]) -> None:
        self._write_group = write_group
        self._cv = threading.Condition()
        self._queue: list[_Ticket[T]] = []
        self._leading = False  # a leader is between taking its group and its handoff

    def submit(self, batch: T) -> None:
        """Return once ``batch`` has been written as part of some group; re-raise its error."""
        ticket = _Ticket(batch)
        with self._cv:
            self._queue.append(ticket)
            while not ticket.done and (ticket.taken or self._leading):
                self._cv.wait()
            if ticket.done:
                if ticket.error is not None:
                    raise ticket.error
                return
            self._leading = True
            group, self._queue = self._queue, []
            for t in group:
                t.taken = True
        handed_off = False

        def handoff() -> None:
            nonlocal handed_off
            if not handed_off:
                handed_off = True
                with self._cv:
                    self._leading = False
                    self._cv.notify_all()

        error: BaseException | None = None
        try:
            self._write_group([t.batch for t in group], handoff)
        except BaseException as exc:  # noqa: BLE001 - handed to every caller of the group
            error = exc
        with self._cv:
            if not handed_off:
                handed_off = True
                self._leading = False
            for t in group:
                t.error = error
                t.done = True
            self._cv.notify_all()
        if error is not None:
            raise error
