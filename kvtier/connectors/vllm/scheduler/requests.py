"""Per-request bookkeeping on the scheduler side, and how a request's blocks become kvtier keys.

Keys are vLLM's own block hashes (``request.block_hashes``; sha256 bytes by default), so the
same prefix maps to the same key in every request, process and restart. A kvtier block of
``block_tokens`` covers several hash blocks when ``block_tokens`` is larger than vLLM's hash
block; its key is then the hash of its last hash block (which chains over every token up to
it, like vLLM's offloading keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvtier.manager.specs import BlockKey


def to_key(block_hash: Any) -> BlockKey:
    """vLLM block hash -> kvtier key: bytes as is, ints as 32-byte big-endian (deterministic)."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash)
    if isinstance(block_hash, int):
        return (block_hash % (1 << 256)).to_bytes(32, "big")
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")


@dataclass(frozen=True)
class RequestParams:
    """Per-request overrides from ``kv_transfer_params={"kvtier": {...}}``."""

    offload_ratio: float | None = None
    max_offload_tokens: int | None = None
    skip_load: bool = False
    skip_store: bool = False

    @staticmethod
    def parse(kv_transfer_params: Mapping[str, Any] | None) -> "RequestParams":
        raw = (kv_transfer_params or {}).get("kvtier") if kv_transfer_params else None
        if not isinstance(raw, Mapping):
            return RequestParams()
        ratio = raw.get("offload_ratio")
        max_tokens = raw.get("max_offload_tokens")
        ok_ratio = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1
        ok_max = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 0
        return RequestParams(
            offload_ratio=float(ratio) if ok_ratio else None,
            max_offload_tokens=max_tokens if ok_max else None,
            skip_load=raw.get("skip_load") is True,
            skip_store=raw.get("skip_store") is True,
        )


@dataclass
class RequestTrack:
    """What the connector remembers about one live (or finished, still storing) request."""

    request: Any  # vllm.v1.request.Request
    params: RequestParams
    lookup_start: int = 0  # the block-aligned local hit the last lookup started from (tokens)
    next_store: int = 0  # kvtier blocks below this index were stored, skipped or loaded
    load_job: int | None = None  # our load for it, until settled
    sync_load: bool = False  # the last lookup promised a synchronous (same-step) load
    load_failed: bool = False  # vLLM restarted it after a failed load: recompute, no reload
    load_first_index: int = 0  # kvtier block index of the load's first key
    hit_tokens: dict[str, int] = field(default_factory=dict)  # tier -> tokens of the last load
    store_jobs: set[int] = field(default_factory=set)  # unsettled stores of its blocks
    store_due: bool = False  # computed by the last step: its new blocks are planned next step
    finished: bool = False
    sighted: bool = False  # its blocks were counted once for admission (vLLM asks every step)
    # its last lookup found a hit that no load was planned for yet: vLLM could not allocate
    # its blocks (a full engine), so it will ask again next step
    hit_unplanned: bool = False
    hints: tuple = ()  # the request's kv_hints (compat.hints.KvHint), for placement

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @property
    def idle(self) -> bool:
        return self.load_job is None and not self.store_jobs and not self.store_due


def drop_if_done(tracks: dict[str, RequestTrack], t: RequestTrack) -> None:
    """Forget a finished request once nothing of it is in flight or still to be planned."""
    if t.finished and t.idle:
        tracks.pop(t.req_id, None)


class KeyMap:
    """Maps a request's kvtier block index to its key and to its engine block ids.

    ``per_block``: kvtier blocks per token block (1 here; one per KV cache group in
    :class:`~kvtier.connectors.vllm.group_keys.GroupKeyMap`)."""

    per_block = 1

    def __init__(self, block_tokens: int, hash_block_size: int, block_size: int) -> None:
        self.block_tokens = block_tokens
        self.hashes_per_block = block_tokens // hash_block_size
        self.engine_per_block = block_tokens // block_size

    def parent_index(self, index: int) -> int:
        """The kvtier block before ``index`` in the same chain (-1: none)."""
        return index - 1

    def table(self, block_id_groups: Any) -> Any:
        """The block table(s) ``gpu_ids`` reads, from vLLM's per-group block ids."""
        return block_id_groups[0]

    def num_keyed(self, request: Any) -> int:
        """Full kvtier blocks whose key exists (hashes appear once a block's tokens are known)."""
        return len(request.block_hashes) // self.hashes_per_block

    def key(self, request: Any, index: int) -> BlockKey:
        return to_key(request.block_hashes[(index + 1) * self.hashes_per_block - 1])

    def keys(self, request: Any, start: int, stop: int) -> list[BlockKey]:
        if stop <= start:
            return []
        h = self.hashes_per_block  # one slice, no per-block call: a 32k hit has 2k keys
        hashes = request.block_hashes[(start + 1) * h - 1:stop * h:h]
        return [x if type(x) is bytes else to_key(x) for x in hashes]

    def engine_ids(self, block_ids: Any, start: int, count: int) -> list[int]:
        """Engine block ids of kvtier blocks ``start .. start + count - 1``, flat."""
        k = self.engine_per_block
        return list(block_ids[start * k:(start + count) * k])

    def gpu_ids(self, block_ids: Any, index: int) -> list[int]:
        return self.engine_ids(block_ids, index, 1)

    def allocated(self, block_ids: Any, start: int, stop: int) -> list[int]:
        """Indices in ``start .. stop - 1`` whose engine blocks are all allocated (none is the
        null block 0). One slice and one scan for the usual all-allocated run: a store plans
        every block of a prompt in one scheduler step, on the first token's path."""
        k = self.engine_per_block
        ids = block_ids[start * k:stop * k]
        if 0 not in ids:
            return list(range(start, stop))
        return [i for i in range(start, stop)
                if 0 not in ids[(i - start) * k:(i - start + 1) * k]]

    def gpu_ids_of(self, block_ids: Any, indices: list[int]) -> tuple[int, ...]:
        """Engine block ids of the kvtier blocks ``indices``, flat, in ``indices``' order."""
        if indices and indices == list(range(indices[0], indices[0] + len(indices))):
            return tuple(self.engine_ids(block_ids, indices[0], len(indices)))  # one run
        return tuple(b for i in indices for b in self.gpu_ids(block_ids, i))

    def tokens(self, request: Any, index: int) -> list[int]:
        bt = self.block_tokens
        return list(request.all_token_ids[index * bt:(index + 1) * bt])
