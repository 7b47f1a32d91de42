"""What the transfer engine reports: per-job results and per-direction statistics.

A job is one or more hops (``src -> dst`` spec pairs) run in order. Its result is the only
thing the synchronous caller ever sees of it, so the result carries everything the caller
needs to settle the manager's prepare/complete pairs: whether it worked, which blocks could not
be read (those become ``complete_load(..., failed=...)``), and enough numbers for metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium

Route = tuple[Medium, Medium]
"""(source medium, destination medium): the key a job's hop is routed by."""

Hop = tuple[LoadStoreSpec, LoadStoreSpec]


def route_name(route: Route) -> str:
    """``(Medium.GPU, Medium.CPU)`` -> ``"GPU->CPU"`` (the key used by ``stats()``)."""
    return f"{Medium(route[0]).value}->{Medium(route[1]).value}"


def route_of(hop: Hop) -> Route:
    return (hop[0].medium, hop[1].medium)


@dataclass
class TransferOutcome:
    """What a handler returns for one hop. Handlers raise instead of returning on failure;
    ``failed_keys`` is for blocks that individually could not be read (disk miss or corruption),
    which is an expected event, not an error of the handler."""

    bytes: int = 0
    failed_keys: tuple[BlockKey, ...] = ()
    seconds: float | None = None
    """Device time of the hop when the handler measured it (CUDA events); else the engine
    uses the wall time it saw the hop run."""
    transient_keys: tuple[BlockKey, ...] = ()
    """Those of ``failed_keys`` whose read failed for a reason that says nothing about the
    record (EIO, EMFILE, ENOMEM ...): kept by the store, not counted as corruption."""
    progress: tuple[tuple[int, float], ...] = ()
    """(bytes final so far, seconds since the hop started), reported while it ran (the shared
    tier's read): one hop then shows its per-job latency apart from its bandwidth."""


@dataclass(frozen=True)
class JobResult:
    """The outcome of one submitted job.

    ``error`` is the message of the hop that raised (``None`` if no hop raised); a job whose hops
    all ran but reported ``failed_keys`` has ``ok=False`` and ``error=None``, so the caller can
    tell "some blocks missing" from "the whole job failed". ``bytes`` and ``seconds`` sum the
    hops that ran (``seconds`` is time spent running, not waiting in a queue). ``direction`` is
    the route of the last hop that ran (the first hop if the job was cancelled before running).
    """

    job_id: int
    ok: bool
    error: str | None
    failed_keys: tuple[BlockKey, ...]
    bytes: int
    seconds: float
    direction: Route
    hops: tuple[tuple[Route, int, float], ...] = ()
    """(route, bytes, seconds) of every hop that ran, in order: what feeds per-tier load
    bandwidth estimates (a promotion's DISK->CPU hop and its CPU->GPU hop differ ~30x)."""
    transient_keys: tuple[BlockKey, ...] = ()
    """Those of ``failed_keys`` a hop reported as transient failures (``TransferOutcome``)."""
    progress: tuple[tuple[Route, int, float], ...] = ()
    """(route, bytes, seconds) of the hops' ``TransferOutcome.progress`` points, in order."""


@dataclass
class DirectionStats:
    """Running totals of one direction. ``jobs`` counts hops run in this direction (a chain
    counts once in each direction it crosses); ``failed_jobs`` those that raised or reported
    failed keys. ``seconds`` is busy wall time: time during which at least one hop of this
    direction was running, so overlapping hops are not double counted and ``gbps`` is the
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
