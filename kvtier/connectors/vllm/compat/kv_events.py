"""vLLM ``BlockStored`` / ``BlockRemoved`` built with the fields this vLLM's structs have.

Both 0.32 and 0.33 carry ``medium``, ``group_idx``, ``kv_cache_spec_kind`` and ``locality``;
0.33 adds ``lookahead_token_ids`` (kvtier has none to give). Fields are filled by name and
only when the struct declares them, so an older or newer vLLM gets what it understands.

``locality`` says where the bytes live relative to the publisher. kvtier's CPU and disk tiers
are on this host: ``LOCAL``. The shared tier (Redis / Valkey, kvtier's medium ``REMOTE``) is
off-host storage that every instance reads: vLLM names such a tier (its object-store tier)
medium ``STORAGE`` with ``locality="REMOTE"``, and so does kvtier, since vLLM's mediums are
GPU / CPU / STORAGE only and an indexer keys on them.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored

LOCAL, REMOTE = "LOCAL", "REMOTE"
SHARED_TIER = "REMOTE"  # kvtier's wire medium of the shared tier (events.convert.wire_medium)
_STORED_FIELDS = frozenset(getattr(BlockStored, "__struct_fields__", ()))
_REMOVED_FIELDS = frozenset(getattr(BlockRemoved, "__struct_fields__", ()))


def _known(fields: frozenset[str], values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in fields and v is not None}


def vllm_medium(medium: str | None) -> tuple[str | None, str]:
    """``(medium, locality)`` of a kvtier wire medium as vLLM's events name it."""
    if medium == SHARED_TIER:
        return "STORAGE", REMOTE
    return medium, LOCAL


def block_stored(*, block_hashes: list, parent_block_hash: Any, token_ids: list[int],
                 block_size: int, lora_id: int | None, medium: str | None,
                 lora_name: str | None, extra_keys: Any = None, group_idx: int | None = None,
                 spec_kind: str | None = None, sliding_window: int | None = None) -> BlockStored:
    medium, locality = vllm_medium(medium)
    optional = _known(_STORED_FIELDS, {
        "extra_keys": extra_keys, "group_idx": group_idx, "kv_cache_spec_kind": spec_kind,
        "kv_cache_spec_sliding_window": sliding_window, "locality": locality,
    })
    return BlockStored(block_hashes=block_hashes, parent_block_hash=parent_block_hash,
                       token_ids=token_ids, block_size=block_size, lora_id=lora_id,
                       medium=medium, lora_name=lora_name, **optional)


def block_removed(*, block_hashes: list, medium: str | None,
                  group_idx: int | None = None) -> BlockRemoved:
    medium, locality = vllm_medium(medium)
    optional = _known(_REMOVED_FIELDS, {"group_idx": group_idx, "locality": locality})
    return BlockRemoved(block_hashes=block_hashes, medium=medium, **optional)
