"""The bytes on the wire: vLLM's KV-event structs, plus kvtier's access events.

Shapes, field order, tags and struct options mirror ``vllm/distributed/kv_events.py`` (vLLM
0.3x), so a consumer written for vLLM decodes kvtier's frames unchanged (a test decodes them
with vLLM's own ``KVEventBatch`` decoder):

* events are msgspec structs tagged by class name (``{"type": "BlockStored", ...}``), encoded as
  maps, with ``omit_defaults``;
* a batch is an array ``[ts, events, data_parallel_rank]``;
* a ZMQ message is three frames: topic, 8-byte big-endian sequence number, msgpack batch.

Access events (a hit: which blocks, from which tier, how many tokens) have no vLLM
counterpart. vLLM's decoder rejects an unknown tag inside ``events`` but ignores trailing
elements of the batch array, so they travel as a fourth element, ``access``; a batch without
any is byte for byte what vLLM itself would send.

Decoding never runs code: msgspec only builds these declared types from msgpack.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvtier.manager.specs import Medium

HashValue = Union[bytes, int]
"""vLLM's ``ExternalBlockHash``: the engine's block hash as bytes or an integer."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

WIRE_MEDIUM = {Medium.GPU: MEDIUM_GPU, Medium.CPU: MEDIUM_CPU, Medium.DISK: MEDIUM_STORAGE}
"""kvtier's tiers as vLLM names them (the disk tier is vLLM's "STORAGE")."""

SEQ_BYTES = 8
END_SEQ = -1
"""Replay: the sequence number of the frame that ends a reply (vLLM's marker)."""
GAP_SEQ = -2
"""Replay: the sequence number of a ``ReplayGap`` notice (kvtier only; sent before the rest)."""


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """Blocks now readable from ``medium``: one chain, ``parent_block_hash`` before the first,
    ``token_ids`` the concatenated tokens (``block_size`` per block; empty when unknown)."""

    block_hashes: list[HashValue]
    parent_block_hash: HashValue | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[HashValue]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """Forget every block of this publisher (kvtier sends it before a full resync)."""


class BlockAccessed(msgspec.Struct, tag="BlockAccessed", omit_defaults=True, gc=False):
    """kvtier only: ``block_hashes`` were hit in ``medium`` and loaded (``num_tokens`` tokens)."""

    block_hashes: list[HashValue]
    medium: str | None
    num_tokens: int = 0


StateEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Exactly vLLM's ``KVEventBatch`` layout (sent when a batch has no access events)."""

    ts: float
    events: list[StateEvent]
    data_parallel_rank: int | None = None


class KvtierEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's layout plus a trailing ``access`` list; decodes both kinds of payload."""

    ts: float
    events: list[StateEvent]
    data_parallel_rank: int | None = None
    access: list[BlockAccessed] = msgspec.field(default_factory=list)


class ReplayGap(msgspec.Struct, array_like=True, gc=False):
    """Replay could not start at ``requested``: batches before ``first_available`` are gone
    (``first_available`` is -1 when nothing is buffered). What follows is a partial history."""

    requested: int
    first_available: int


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KvtierEventBatch)
_gap_decoder = msgspec.msgpack.Decoder(ReplayGap)

DecodeError = (msgspec.DecodeError, msgspec.ValidationError)
"""What decoding a malformed or foreign payload raises (never anything else)."""


def encode_batch(batch: KvtierEventBatch) -> bytes:
    if not batch.access:
        return _encoder.encode(VllmEventBatch(batch.ts, batch.events, batch.data_parallel_rank))
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KvtierEventBatch:
    return _batch_decoder.decode(payload)


def encode_gap(gap: ReplayGap) -> bytes:
    return _encoder.encode(gap)


def decode_gap(payload: bytes) -> ReplayGap:
    return _gap_decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """Sequence number of a frame: publishing never reaches 2**63, so signed reading keeps
    vLLM's unsigned counters intact and still shows the -1 / -2 markers."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
