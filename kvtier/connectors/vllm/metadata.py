"""What crosses between the two halves: scheduler -> workers each step, workers -> scheduler back.

The scheduler and the workers normally live in different processes, so these are plain
picklable dataclasses (ints, bytes, tuples, kvtier's frozen specs). The scheduler owns the
manager and decides everything; a worker only executes jobs and reports, per job id, that it
finished and which blocks it could not read. A job is done once every worker reported it
(``KVTierWorkerMetadata.aggregate`` sums the per-job counts across tensor-parallel workers).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec


@dataclass(frozen=True)
class LoadJob:
    """Copy the CPU slots ``cpu_slots`` (one per key, READY and pinned by the scheduler) into
    the request's engine blocks ``gpu_ids`` (k per key, in order): one CPU -> GPU copy.

    ``unloaded_gpu_ids``: blocks vLLM was told are external but that no tier could supply in
    the end (the plan came out shorter); the worker reports them as load errors, so vLLM
    recomputes them. ``sync``: vLLM computes the request in this step: the worker enqueues
    the copy before the forward and orders the forward after it (``TransferEngine.fence``),
    and never reports the request in ``finished_recving``. ``whole``: a synchronous load
    whose forward computes only the prompt's last token (:func:`..scheduler.side.claim`'s whole tail): that
    forward waits for all of it, so it need not be copied layer by layer.
    """

    job_id: int
    req_id: str
    keys: tuple[BlockKey, ...]
    cpu_slots: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    unloaded_gpu_ids: tuple[int, ...] = ()
    sync: bool = False
    whole: bool = False

    @property
    def src(self) -> LoadStoreSpec:
        return LoadStoreSpec.cpu(self.cpu_slots)

    @property
    def dst(self) -> LoadStoreSpec:
        return LoadStoreSpec.gpu(self.gpu_ids, self.whole)


@dataclass(frozen=True)
class StoreJob:
    """Copy engine blocks ``gpu_ids`` (k per key) of a request into CPU slots.

    ``this_step``: this step's forward computes the blocks, so the copy is submitted after it
    (``wait_for_save``); otherwise earlier steps did and it is submitted at ``bind``."""

    job_id: int
    req_id: str
    keys: tuple[BlockKey, ...]
    cpu_slots: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    this_step: bool = False


@dataclass(frozen=True)
class BackgroundJob:
    """A move the manager wants on its own account (a promotion into CPU memory, a CPU -> disk
    demotion, a deletion, a shared-tier write): the manager's ``transfer`` as it queued it."""

    job_id: int
    transfer: BackgroundTransfer

    @property
    def src(self) -> LoadStoreSpec:
        return self.transfer.src

    @property
    def dst(self) -> LoadStoreSpec:
        return self.transfer.dst


HandedJob = LoadJob | StoreJob | BackgroundJob  # one job, as the scheduler hands it over


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for every worker.

    ``flush``: store jobs whose source engine blocks are written this step (freed by a
    preemption or a sliding window and reallocated); workers finish them before the forward.
    ``watch``: finished requests whose blocks vLLM keeps until their stores are done; a worker
    reports each in ``finished_sending`` once it has no store of it in flight.
    ``untaint``: requests a worker reported ``tainted`` that the scheduler has seen since
    (with vLLM's rewind of them): this step's stores of them were planned after it.
    ``engine_saturated``: the scheduler left requests waiting in one of the last few steps;
    the worker's runtime keeps Python's GIL switch interval meanwhile (runtime/gil.py).
    """

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    background: list[BackgroundJob] = field(default_factory=list)
    flush: tuple[int, ...] = ()
    watch: tuple[str, ...] = ()
    step_tokens: int = 0  # tokens this step computes (workers time large forwards)
    untaint: tuple[str, ...] = ()
    engine_saturated: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.background or self.flush or self.watch
                    or self.untaint)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's report for one step (or the sum over workers after ``aggregate``).

    ``done``: job id -> number of workers that finished it. ``failed``: job id -> keys that
    could not be read (a promotion's miss or corruption; the manager forgets them), and
    ``transient`` those of them whose read failed transiently (EIO, EMFILE: counted apart from
    corruption; after ``aggregate``, only keys no worker failed otherwise). ``errors``: job id ->
    number of workers on which the job raised (a store or demotion that must not be published).
    ``load_hops``: (source medium, bytes, seconds) of each finished load (CPU) and promotion read
    (DISK, REMOTE), and ``forwards``: (tokens, seconds) of large forward passes: the scheduler's
    cost model learns load bandwidth and recompute time from them. ``tainted``: requests whose
    synchronous load failed on a worker after their forward ran on it (:mod:`worker.load_taint`);
    the scheduler acknowledges them in ``untaint``."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, tuple[BlockKey, ...]] = field(default_factory=dict)
    errors: dict[int, int] = field(default_factory=dict)
    load_hops: tuple[tuple[str, int, float], ...] = ()
    forwards: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of timed forwards
    transient: dict[int, tuple[BlockKey, ...]] = field(default_factory=dict)
    tainted: tuple[str, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate KVTierWorkerMetadata with {type(other).__name__}")
        done = dict(Counter(self.done) + Counter(other.done))
        errors = dict(Counter(self.errors) + Counter(other.errors))
        failed = dict(self.failed)
        for job, keys in other.failed.items():
            failed[job] = tuple(dict.fromkeys(failed.get(job, ()) + tuple(keys)))
        transient = {}
        for job in self.transient.keys() | other.transient.keys():
            hard = self.hard_failures(job) | other.hard_failures(job)
            keys = self.transient.get(job, ()) + tuple(other.transient.get(job, ()))
            kept = tuple(k for k in dict.fromkeys(keys) if k not in hard)
            if kept:
                transient[job] = kept
        return KVTierWorkerMetadata(done, failed, errors, self.load_hops + tuple(other.load_hops),
                                    self.forwards + tuple(other.forwards), transient,
                                    tuple(dict.fromkeys(self.tainted + tuple(other.tainted))))

    def hard_failures(self, job: int) -> set[BlockKey]:
        """Keys of ``job`` that failed for a reason other than a transient read error."""
        return set(self.failed.get(job, ())) - set(self.transient.get(job, ()))

    def is_empty(self) -> bool:
        return not (self.done or self.failed or self.errors or self.load_hops or self.forwards
                    or self.tainted)
