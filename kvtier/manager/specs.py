"""Plain data the manager hands out: where blocks live and what to move.

These are the only things that cross from the scheduler side (manager) to the worker side
(transfer engine): media, slot ids, block keys, engine block ids. No tensors, picklable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

BlockKey = bytes
"""The engine's block hash, as bytes. Integer hashes are converted by the caller."""


class Medium(str, Enum):
    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"  # the shared tier (Redis / Valkey), addressed by key
    DROP = "DROP"  # destination of deletions: the bytes are discarded

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


@dataclass(frozen=True)
class LoadStoreSpec:
    """Addresses of blocks on one medium.

    GPU: ``ids`` are engine block ids (``engine_blocks_per_block`` per kvtier block, in order).
    CPU: ``ids`` are CPU pool slot ids, one per block.
    DISK / REMOTE / DROP: ``keys`` name the blocks.

    ``whole`` (a load's GPU destination only): whatever reads these blocks waits for all of
    them at once (the forward computes only the prompt's last token, a full CUDA graph that
    runs no per-layer hook), so a handler need not copy them layer by layer.
    """

    medium: Medium
    ids: tuple[int, ...] = ()
    keys: tuple[BlockKey, ...] = ()
    whole: bool = False

    @staticmethod
    def gpu(ids: Sequence[int], whole: bool = False) -> "LoadStoreSpec":
        return LoadStoreSpec(Medium.GPU, ids=tuple(map(int, ids)), whole=whole)

    @staticmethod
    def cpu(slots: Sequence[int]) -> "LoadStoreSpec":
        return LoadStoreSpec(Medium.CPU, ids=tuple(map(int, slots)))

    @staticmethod
    def disk(keys: Sequence[BlockKey]) -> "LoadStoreSpec":
        return LoadStoreSpec(Medium.DISK, keys=tuple(keys))

    @staticmethod
    def remote(keys: Sequence[BlockKey]) -> "LoadStoreSpec":
        return LoadStoreSpec(Medium.REMOTE, keys=tuple(keys))

    @staticmethod
    def drop(keys: Sequence[BlockKey]) -> "LoadStoreSpec":
        return LoadStoreSpec(Medium.DROP, keys=tuple(keys))


@dataclass(frozen=True)
class RequestContext:
    """What admission may know about the request a store belongs to."""

    request_id: str = ""
    first_block_index: int = 0  # position of the first key of this call within the prompt
    num_prompt_blocks: int = 0  # full blocks in the prompt (0 = unknown)
    offload_ratio: float | None = None  # per-request override of admission.offload_ratio
    max_offload_tokens: int | None = None
    block_tokens: int = 0
    parent_key: BlockKey | None = None  # block before the first key of this call, if any
    hints: tuple = ()  # per-request kv_hints passed through from vLLM (action objects)


@dataclass(frozen=True)
class LookupResult:
    """Leading run of ``keys`` that is ready in some tier, and where each hit lives."""

    tiers: tuple[Medium, ...]  # one per hit, in key order; len == num_hits
    pending: bool = False  # the shared tier's answer is on its way: ask again, don't settle

    @property
    def num_hits(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True)
class LoadPlan:
    """What ``prepare_load`` pinned: the leading READY CPU blocks of the keys asked, each in
    ``cpu_slots[i]`` (``keys`` may be shorter than asked: the caller loads only these and
    recomputes the rest). A load is one CPU -> GPU copy; blocks held below the CPU tier were
    promoted into it first (the lookup's "not yet").

    ``sources[i]`` (empty when every block was a CPU hit): the tier block i was promoted from
    for this load (DISK, REMOTE) or CPU: where the hit came from, for stats and vLLM's hit
    sources.
    """

    keys: tuple[BlockKey, ...]
    cpu_slots: tuple[int, ...]
    sources: tuple[Medium, ...] = ()

    @property
    def src(self) -> LoadStoreSpec:
        return LoadStoreSpec.cpu(self.cpu_slots)


@dataclass(frozen=True)
class StorePlan:
    """What ``prepare_store`` reserved: copy ``keys`` (a subset of those asked, in order) into
    ``cpu_slots``; ``evicted`` lists blocks dropped from each tier to make room."""

    keys: tuple[BlockKey, ...]
    cpu_slots: tuple[int, ...]
    evicted: dict[Medium, tuple[BlockKey, ...]] = field(default_factory=dict)

    @property
    def dst(self) -> LoadStoreSpec:
        return LoadStoreSpec.cpu(self.cpu_slots)


@dataclass(frozen=True)
class BackgroundTransfer:
    """A move the manager wants done on its own account (demotion to disk, deletion).

    The caller submits ``src -> dst`` to the transfer engine and reports the outcome with
    ``complete_background(transfer, success)``.
    """

    id: int
    src: LoadStoreSpec
    dst: LoadStoreSpec
    keys: tuple[BlockKey, ...]
