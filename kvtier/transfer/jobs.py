"""What the transfer engine reports: per-job results and per-direction statistics.

A job is one (source spec, destination spec) pair. Its result is the only thing the
synchronous caller ever sees of it, so the result carries everything the caller needs to settle
the manager's prepare/complete pairs: whether it worked, which blocks could not be read (a
promotion's become ``complete_background(..., failed=...)``), and enough numbers for metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtier.manager.specs import BlockKey, Medium

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
