"""A transfer job, the lane of its route, what the engine reports and how a finished load or
promotion reads.

A job is one (source spec, destination spec) pair (:class:`Job`; the engine keeps one
:class:`Lane` per route: its queue, worker and running jobs). Its result is the only thing the
synchronous caller ever sees of it, so the result carries everything the caller needs to settle
the manager's prepare/complete pairs: whether it worked, which blocks could not be read (a
promotion's become ``complete_background(..., failed=...)``), and enough numbers for metrics.

The vLLM connector's worker side, ``kvtier bench`` and the reliability rig all read results
through the functions below, so what the benchmark and the fault-injection figures check is
the path vLLM runs:

* ``untrusted_gpu_ids``: a CPU -> GPU copy fails no key (the CPU copy is intact, whatever
  happened to the copy); when it raised, none of its engine blocks may be trusted and vLLM
  recomputes them. Treating that as a bad record would make the manager forget (and leak) an
  intact block;
* ``promotion_outcome``: the keys a promotion (DISK or REMOTE -> CPU) could not read from
  their tier, and which of those failed transiently (the record may be intact); a read that
  raised failed all of them, since nothing reached the CPU slots;
* ``measured_hops``: what a transfer that worked measured, for the manager's cost model.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from kvtier.manager.cost import MIN_SAMPLE_BYTES
from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium


Route = tuple[Medium, Medium]
"""(source medium, destination medium): the key a job is routed by."""


def route_name(route: Route) -> str:
    """``(Medium.GPU, Medium.CPU)`` -> ``"GPU->CPU"`` (the key used by ``stats()``)."""
    return f"{Medium(route[0]).value}->{Medium(route[1]).value}"


@dataclass
class TransferOutcome:
    """What a handler returns for one job. Handlers raise instead of returning on failure;
    ``failed_keys`` is for blocks that individually could not be read (disk miss or corruption),
    which is an expected event, not an error of the handler."""

    bytes: int = 0
    failed_keys: tuple[BlockKey, ...] = ()
    seconds: float | None = None
    """Device time of the job when the handler measured it (CUDA events); else the engine
    uses the wall time it saw the job run."""
    transient_keys: tuple[BlockKey, ...] = ()
    """Those of ``failed_keys`` whose read failed for a reason that says nothing about the
    record (EIO, EMFILE, ENOMEM ...): kept by the store, not counted as corruption."""
    progress: tuple[tuple[int, float], ...] = ()
    """(bytes final so far, seconds since the job started), reported while it ran (the shared
    tier's read): one job then shows the tier's per-job latency apart from its bandwidth."""


@dataclass(frozen=True)
class JobResult:
    """The outcome of one submitted job.

    ``error`` is the message of the handler that raised (``None`` if it did not); a job that
    ran but reported ``failed_keys`` has ``ok=False`` and ``error=None``, so the caller can
    tell "some blocks missing" from "the whole job failed". ``bytes`` and ``seconds`` are what
    it moved and how long it ran (not the time it waited in a queue; device time where the
    handler measured it). ``direction`` is the job's route.
    """

    job_id: int
    ok: bool
    error: str | None
    failed_keys: tuple[BlockKey, ...]
    bytes: int
    seconds: float
    direction: Route
    transient_keys: tuple[BlockKey, ...] = ()
    """Those of ``failed_keys`` the handler reported as transient failures (``TransferOutcome``)."""
    progress: tuple[tuple[int, float], ...] = ()
    """(bytes final so far, seconds since the job started): ``TransferOutcome.progress``."""


@dataclass
class DirectionStats:
    """Running totals of one direction. ``jobs`` counts jobs run in this direction;
    ``failed_jobs`` those that raised or reported failed keys. ``seconds`` is busy wall time:
    time during which at least one job of this direction was running, so overlapping jobs are
    not double counted and ``gbps`` is the
    direction's real throughput while busy."""

    jobs: int = 0
    failed_jobs: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) over busy time; 0 when never busy."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "gbps": self.gbps}


PROGRESS_SAMPLES = 2  # points of one read kept as cost samples (see measured_hops)


def gpu_untrusted(result: JobResult) -> bool:
    """Whether none of the job's engine blocks may be trusted (the copy raised)."""
    return result.error is not None


def measured_hops(result: JobResult) -> list[tuple[Medium, int, float]]:
    """(source medium, bytes, seconds) of a transfer that worked: what feeds the manager's
    cost model (``OffloadingManager.record_load``). A shared-tier read also tells how long its
    first bytes took (``JobResult.progress``): points of at least ``MIN_SAMPLE_BYTES`` are samples
    too, so the first REMOTE hit already splits the tier's per-job latency from its bandwidth.
    Smaller points are left out (the cost model reads small loads as a fixed cost, which a point
    within a read does not measure). At most ``PROGRESS_SAMPLES`` points per read are kept: the
    model forgets per sample, so dozens of points would make one job outweigh the next several
    (docs/design-measurements.md)."""
    if result.error is not None or result.bytes <= 0:
        return []
    src = result.direction[0]
    out = [(src, result.bytes, result.seconds)]
    points = [(n, s) for n, s in result.progress if n >= MIN_SAMPLE_BYTES and s > 0]
    if points:
        picks = sorted({len(points) * k // (PROGRESS_SAMPLES + 1)
                        for k in range(1, PROGRESS_SAMPLES + 1)})
        out += [(src, *points[i]) for i in picks]
    return out


def untrusted_gpu_ids(result: JobResult, gpu_ids: Sequence[int],
                      unloaded_gpu_ids: Sequence[int] = ()) -> frozenset[int]:
    """The engine blocks a finished load into ``gpu_ids`` did not fill (vLLM recomputes
    them): ``unloaded_gpu_ids``, those no tier could supply in the first place, and all of
    ``gpu_ids`` when the copy raised (whatever reached the GPU is not trusted)."""
    if gpu_untrusted(result):
        return frozenset(gpu_ids) | frozenset(unloaded_gpu_ids)
    return frozenset(unloaded_gpu_ids)


@dataclass(frozen=True)
class PromotionOutcome:
    """What one finished promotion means: ``failed``, keys not read from their tier, in key
    order (the manager forgets them), ``transient`` those of them that failed transiently;
    ``measured``: ``measured_hops`` of the read."""

    failed: tuple[BlockKey, ...]
    transient: tuple[BlockKey, ...]
    measured: tuple[tuple[Medium, int, float], ...]


def promotion_outcome(result: JobResult, keys: Sequence[BlockKey]) -> PromotionOutcome:
    """Read the result of a promotion of ``keys`` into CPU slots."""
    failed = set(keys) if result.error is not None else set(result.failed_keys)
    transient = set(result.transient_keys) & failed if result.transient_keys else set()
    return PromotionOutcome(tuple(k for k in keys if k in failed),
                            tuple(k for k in keys if k in transient),
                            tuple(measured_hops(result)))


def is_promotion(src: Medium, dst: Medium) -> bool:
    """Whether a transfer ``src -> dst`` promotes blocks into the CPU tier."""
    return dst is Medium.CPU and src in (Medium.DISK, Medium.REMOTE)


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
    handler: Any  # the route's TransferHandler (handlers import this module)
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


def check_handler(h: Any) -> Route:
    """The route of a TransferHandler ``h``, checked."""
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
