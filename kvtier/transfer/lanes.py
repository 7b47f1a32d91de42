"""What the transfer engine keeps per job and per route (see :mod:`kvtier.transfer.engine`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import DirectionStats, Route, route_name


@dataclass
class Job:
    """One submitted job: a source spec and a destination spec (one hop: the engine never
    chains jobs); its result is built from the handler's outcome when it ends."""

    job_id: int
    src: LoadStoreSpec
    dst: LoadStoreSpec
    pending: object = None  # an immediate job's handle (while :class:`ImmediateHops` runs it)
    started: float = 0.0

    @property
    def route(self) -> Route:
        return (self.src.medium, self.dst.medium)


@dataclass
class Lane:
    """One route's queue, worker and running jobs (loop-thread state, except ``stats``)."""

    route: Route
    handler: TransferHandler
    queue: asyncio.Queue
    slots: asyncio.Semaphore
    stats: DirectionStats = field(default_factory=DirectionStats)
    active: int = 0
    busy_since: float = 0.0
    worker: asyncio.Task | None = None
    running: dict = field(default_factory=dict)  # task -> its job

    @property
    def name(self) -> str:
        return route_name(self.route)


def check_handler(h: TransferHandler) -> Route:
    try:
        src, dst = h.direction
        route = (Medium(src), Medium(dst))
    except (AttributeError, TypeError, ValueError):
        raise ValueError(
            f"{type(h).__name__}.direction must be a (Medium, Medium) pair, "
            f"got {getattr(h, 'direction', None)!r}"
        ) from None
    if not isinstance(h.concurrency, int) or h.concurrency < 1:
        raise ValueError(f"{type(h).__name__}.concurrency must be an int >= 1, got {h.concurrency!r}")
    return route
