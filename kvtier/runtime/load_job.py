"""How one load becomes transfer hops, and how its result becomes failed keys: both here.

A load's stages, one name each, from plan to completion:

1. ``LoadPlan`` (:mod:`kvtier.manager`): the keys the manager pinned, their CPU slots, which
   ones it promotes from disk / the shared tier and which join another load's promotion;
2. the vLLM connector's scheduler hands it to every worker as a ``LoadJob``
   (:mod:`kvtier.connectors.vllm.metadata`) and keeps a ``HandedJob`` in its ledger
   (:mod:`kvtier.connectors.vllm.scheduler.ledger`) until all workers reported it;
3. a worker (or ``kvtier bench``, or the reliability rig) turns it into chained hops
   (``load_hops``, after ``excluded_keys``) and submits them as one transfer job;
4. the transfer engine answers with a ``JobResult`` (:mod:`kvtier.transfer.jobs`);
5. ``load_outcome`` reads that result as a ``LoadOutcome``: keys failed (transiently or not),
   engine blocks not to trust, what a joined load must not copy, what the hops measured.

The vLLM connector's worker side, ``kvtier bench`` and the reliability rig all load through
these functions, so the bytes that the benchmark and the fault-injection figures check
move along exactly the path vLLM runs (one production path):

* ``load_hops``: DISK -> CPU for the keys a plan promotes, then CPU -> GPU for every key
  except ``excluded`` ones (joined keys whose promotion failed), as one chained job;
* ``failed_load_keys``: the keys the manager must be told could not be *read from their
  tier*. A hop error in DISK -> CPU fails every promoted key (nothing reached the CPU
  slots); an error in CPU -> GPU fails none: the disk record and the CPU copy are fine, only
  the engine's blocks are untrusted (``gpu_untrusted``) and get recomputed. Treating that
  as a bad disk record made the manager forget (and leak) a block that was intact;
* ``transient_load_keys``: which of those failed transiently (the record may be intact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from kvtier.manager.cost import MIN_SAMPLE_BYTES
from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.transfer.jobs import Hop, JobResult

PROGRESS_SAMPLES = 2  # points of one read kept as cost samples (see measured_hops)


def load_hops(keys: Sequence[BlockKey], cpu_slots: Sequence[int], from_disk: Sequence[bool],
              gpu_ids: Sequence[int], per_block: int, excluded: Collection[BlockKey] = (),
              from_remote: Sequence[bool] = (), whole: bool = False) -> list[Hop]:
    """The chained hops of one load: promotions first (disk, then the shared tier), then the
    copies to the engine. ``gpu_ids``: ``per_block`` engine block ids per key, in key order.
    ``whole``: the engine reads the blocks only once all are there (``LoadStoreSpec.whole``).
    Without promotions or exclusions (nearly every CPU hit) no per-key work is done: a 32k
    hit has 2k keys."""
    hops: list[Hop] = []
    for flags, spec in ((from_disk, LoadStoreSpec.disk), (from_remote, LoadStoreSpec.remote)):
        if any(flags):
            moved = [(key, slot) for key, slot, f in zip(keys, cpu_slots, flags) if f]
            hops.append((spec([key for key, _ in moved]),
                         LoadStoreSpec.cpu([slot for _, slot in moved])))
    if not excluded:
        if keys:
            hops.append((LoadStoreSpec.cpu(cpu_slots), LoadStoreSpec.gpu(gpu_ids, whole)))
        return hops
    copy = [i for i, key in enumerate(keys) if key not in excluded]
    if copy:
        hops.append((LoadStoreSpec.cpu([cpu_slots[i] for i in copy]),
                     LoadStoreSpec.gpu([b for i in copy
                                        for b in gpu_ids[i * per_block:(i + 1) * per_block]],
                                       whole)))
    return hops


def failed_load_keys(result: JobResult, disk_keys: Collection[BlockKey],
                     excluded: Collection[BlockKey] = (),
                     remote_keys: Collection[BlockKey] = ()) -> set[BlockKey]:
    """Keys of a finished load that could not be read from their tier (see the module
    docstring); ``disk_keys`` / ``remote_keys``: the keys the job promoted from disk / from
    the shared tier. The remote hop runs after the disk hop: a disk hop that raised left the
    remote keys unread too."""
    failed = set(result.failed_keys) | set(excluded)
    if result.error is not None and result.direction == (Medium.DISK, Medium.CPU):
        failed |= set(disk_keys) | set(remote_keys)  # nothing reached the CPU slots
    elif result.error is not None and result.direction == (Medium.REMOTE, Medium.CPU):
        failed |= set(remote_keys)
    return failed


def transient_load_keys(result: JobResult, failed: Collection[BlockKey]) -> set[BlockKey]:
    """Those of ``failed`` whose read failed for a reason that says nothing about the record
    (EIO, EMFILE, ENOMEM ...; the store kept it): the manager counts them apart from
    corruption (it forgets and deletes both kinds on every rank all the same)."""
    return set(result.transient_keys) & set(failed) if result.transient_keys else set()


def gpu_untrusted(result: JobResult) -> bool:
    """Whether none of the job's engine blocks may be trusted (a hop raised)."""
    return result.error is not None


def measured_hops(result: JobResult) -> list[tuple[Medium, int, float]]:
    """(source medium, bytes, seconds) of each hop of a load that worked: what feeds the
    manager's cost model (``OffloadingManager.record_load``). A shared-tier read also tells
    how long its first bytes took (``JobResult.progress``): points of at least
    ``MIN_SAMPLE_BYTES`` are samples too, so the first REMOTE hit already splits the tier's
    per-job latency from its bandwidth. Read as bytes over seconds, a first hit of 256 MiB
    made an 8k hit look slower than recomputing it. Smaller points are left out: the cost
    model reads small loads as a fixed cost, which a point within a hop does not measure.
    At most ``PROGRESS_SAMPLES`` points per hop are kept (a third and two thirds of the way):
    the model forgets per sample, and a read reports dozens of points, so all of them would
    make one job (a cold first one, say) outweigh the next several."""
    if result.error is not None:
        return []
    out = [(src, nbytes, seconds) for (src, _), nbytes, seconds in result.hops if nbytes > 0]
    by_route: dict = {}
    for route, nbytes, seconds in result.progress:
        if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            by_route.setdefault(route, []).append((nbytes, seconds))
    for (src, _), points in by_route.items():
        picks = sorted({len(points) * k // (PROGRESS_SAMPLES + 1)
                        for k in range(1, PROGRESS_SAMPLES + 1)})
        out += [(src, *points[i]) for i in picks]
    return out


def excluded_keys(keys: Sequence[BlockKey], joined: Sequence[bool],
                  promotion_failures: Iterable[Collection[BlockKey]]) -> frozenset[BlockKey]:
    """Joined keys (``joined[i]``: another load promotes ``keys[i]``) that a promotion they
    joined could not read: the load must not copy them (their CPU slots hold nothing) and
    fails them. ``promotion_failures``: what each joined promotion failed to read."""
    excluded: set[BlockKey] = set()
    for failed in promotion_failures:
        excluded |= set(failed)
    if excluded:
        excluded &= {key for key, j in zip(keys, joined or ()) if j}
    return frozenset(excluded)


@dataclass(frozen=True)
class LoadOutcome:
    """What one finished load means (``load_outcome``).

    ``failed``: keys not read from their tier, in key order (the manager forgets them), and
    ``transient``: those of them that failed transiently. ``untrusted_gpu_ids``: engine blocks
    the load did not fill (vLLM recomputes them). ``promotion_failed``: the promoted disk keys
    it failed to read, for loads that joined its promotion (None: it promoted none).
    ``measured``: (source medium, bytes, seconds) per hop, for the cost model."""

    failed: tuple[BlockKey, ...]
    transient: tuple[BlockKey, ...]
    untrusted_gpu_ids: frozenset[int]
    promotion_failed: frozenset[BlockKey] | None
    measured: tuple[tuple[Medium, int, float], ...]


def load_outcome(result: JobResult, keys: Sequence[BlockKey], from_disk: Sequence[bool],
                 gpu_ids: Sequence[int], per_block: int, excluded: Collection[BlockKey] = (),
                 from_remote: Sequence[bool] = (), unloaded_gpu_ids: Sequence[int] = ()
                 ) -> LoadOutcome:
    """Read the result of the load ``load_hops`` built from the same arguments.
    ``unloaded_gpu_ids``: engine blocks that no tier could supply in the first place."""
    disk_keys = {key for key, d in zip(keys, from_disk) if d} if any(from_disk) else set()
    remote_keys = ({key for key, d in zip(keys, from_remote) if d}
                   if any(from_remote) else set())
    failed = failed_load_keys(result, disk_keys, excluded, remote_keys)
    bad_gpu: set[int] = set(unloaded_gpu_ids)
    if gpu_untrusted(result):
        bad_gpu.update(gpu_ids)  # whatever reached the GPU is not trusted
    failed_keys: tuple[BlockKey, ...] = ()
    transient_keys: tuple[BlockKey, ...] = ()
    if failed:
        for i, key in enumerate(keys):
            if key in failed:
                bad_gpu.update(gpu_ids[i * per_block:(i + 1) * per_block])
        failed_keys = tuple(k for k in keys if k in failed)
        if transient := transient_load_keys(result, failed):
            transient_keys = tuple(k for k in keys if k in transient)
    return LoadOutcome(failed_keys, transient_keys, frozenset(bad_gpu),
                       frozenset(failed & disk_keys) if disk_keys else None,
                       tuple(measured_hops(result)))
