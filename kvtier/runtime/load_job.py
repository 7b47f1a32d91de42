"""How one load job becomes transfer hops, and how its result becomes failed keys.

The vLLM connector's worker side, ``kvtier bench`` and the reliability rig all load through
these two functions, so the bytes that the benchmark and the fault-injection figures check
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

from typing import Collection, Sequence

from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.transfer.jobs import Hop, JobResult


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
    manager's cost model (``OffloadingManager.record_load``)."""
    if result.error is not None:
        return []
    return [(src, nbytes, seconds) for (src, _), nbytes, seconds in result.hops if nbytes > 0]
