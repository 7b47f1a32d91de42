"""How a finished load or promotion reads: failed keys, untrusted engine blocks, measurements.

The vLLM connector's worker side, ``kvtier bench`` and the reliability rig all read their
transfer results through these functions, so what the benchmark and the fault-injection
figures check is the path vLLM runs:

* ``untrusted_gpu_ids``: a CPU -> GPU copy fails no key (the CPU copy is intact, whatever happened
  to the copy); when it raised, none of its engine blocks may be trusted and vLLM recomputes
  them. Treating that as a bad record would make the manager forget (and leak) an intact block;
* ``promotion_outcome``: the keys a promotion (DISK or REMOTE -> CPU) could not read from
  their tier, and which of those failed transiently (the record may be intact); a read that
  raised failed all of them, since nothing reached the CPU slots;
* ``measured_hops``: what a transfer that worked measured, for the manager's cost model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtier.manager.cost import MIN_SAMPLE_BYTES
from kvtier.manager.specs import BlockKey, Medium
from kvtier.transfer.jobs import JobResult

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
