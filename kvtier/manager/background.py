"""The manager's own moves (demotions to disk, deletions, shared-tier writes) between being
planned and being reported.

A planned transfer waits in ``ready`` until the caller takes it
(``take_background_transfers``) and stays in ``pending`` until the caller reports it
(``complete_background``) once, after it ran on every worker. A pending transfer counts as a
pin: ``pins()`` is 0 only when nothing of the manager's own is in flight either.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec


class BackgroundQueue:
    """Background transfers by id, from ``queue`` to ``settle``; see the module docstring."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.pending: dict[int, BackgroundTransfer] = {}  # queued, not yet reported
        self.ready: list[BackgroundTransfer] = []  # queued, not yet taken by the caller

    def queue(self, src: LoadStoreSpec, dst: LoadStoreSpec, keys: Sequence[BlockKey]
              ) -> BackgroundTransfer:
        t = BackgroundTransfer(next(self._ids), src, dst, tuple(keys))
        self.pending[t.id] = t
        self.ready.append(t)
        return t

    def take(self) -> list[BackgroundTransfer]:
        """The transfers queued since the last call, oldest first."""
        out, self.ready = self.ready, []
        return out

    def settle(self, transfer_id: int) -> BackgroundTransfer | None:
        """The reported transfer, forgotten; None when no such transfer is pending."""
        return self.pending.pop(transfer_id, None)

    def __len__(self) -> int:
        return len(self.pending)
