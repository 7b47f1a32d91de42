"""Keys and engine blocks of a hybrid model (vLLM's hybrid allocator, ``SupportsHMA``).

With the hybrid allocator each KV cache group (full attention, sliding window) has its own
block table; the same token block has a different engine block in each group, and a
sliding-window group frees the blocks that fell out of its window (they become the null
block, id 0). kvtier keeps one entry per (token block, group): the group's key is vLLM's
block hash with a group suffix (group 0 keeps the bare hash), and its bytes are the group's
engine block across the registered layers. A sliding-window group's blocks outside the
window are never loaded (their engine block is null), so a hit moves only what the window
still needs. A Mamba/SSM state group's entry of token block ``p`` is the recurrent state after
``(p + 1) * block_size`` tokens, kept where vLLM materialised it (:mod:`state_groups`); a hit
loads the state at its end only (:mod:`scheduler.state_hit`).

``GroupKeyMap`` has ``KeyMap``'s interface over *units*: unit ``u`` is token block
``u // groups`` of group ``u % groups``, so the scheduler's planning code runs unchanged on
units; ``per_block`` says how many units one token block has (1 without hybrid groups).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.connectors.vllm.scheduler.requests import KeyMap, to_key
from kvtier.manager.specs import BlockKey

GROUP_TAG = b"#kvtier-group:"


def group_key(block_hash: BlockKey, group: int) -> BlockKey:
    return block_hash if group == 0 else block_hash + GROUP_TAG + bytes([group])


def split_group_key(key: BlockKey) -> tuple[BlockKey, int]:
    """(vLLM block hash, group index) of a kvtier key."""
    cut = len(key) - len(GROUP_TAG) - 1
    if cut > 0 and key[cut:-1] == GROUP_TAG:
        return key[:cut], key[-1]
    return key, 0


class GroupKeyMap(KeyMap):
    """``KeyMap`` over (token block, group) units; needs block_tokens == vLLM's block size."""

    def __init__(self, block_tokens: int, hash_block_size: int, block_size: int,
                 groups: int, state_groups: Sequence[int] = ()) -> None:
        if block_tokens != block_size:
            raise ValueError("hybrid groups need kvtier block_tokens == vLLM block size")
        super().__init__(block_tokens, hash_block_size, block_size)
        self.per_block = groups
        self.state_groups = tuple(state_groups)  # Mamba/SSM state groups' indices

    def num_keyed(self, request: Any) -> int:
        return super().num_keyed(request) * self.per_block

    def key(self, request: Any, index: int) -> BlockKey:
        block, group = divmod(index, self.per_block)
        return group_key(to_key(request.block_hashes[(block + 1) * self.hashes_per_block - 1]),
                         group)

    def keys(self, request: Any, start: int, stop: int) -> list[BlockKey]:
        return [self.key(request, i) for i in range(start, stop)]  # not one hash slice

    def parent_index(self, index: int) -> int:
        return index - self.per_block

    def table(self, block_id_groups: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        return block_id_groups

    def gpu_ids(self, block_ids: Any, index: int) -> list[int]:
        block, group = divmod(index, self.per_block)
        return list(block_ids[group][block:block + 1])

    def allocated(self, block_ids: Any, start: int, stop: int) -> list[int]:
        return [i for i in range(start, stop) if all(self.gpu_ids(block_ids, i))]

    def gpu_ids_of(self, block_ids: Any, indices: list[int]) -> tuple[int, ...]:
        return tuple(b for i in indices for b in self.gpu_ids(block_ids, i))

    def tokens(self, request: Any, index: int) -> list[int]:
        return super().tokens(request, index // self.per_block)


def hybrid_notice(kinds: Sequence[str], flag: str) -> str:
    """The start-up line for a hybrid model: what kvtier does with its groups, what it costs,
    and what it does not support."""
    from kvtier.connectors.vllm.state_groups import STATE_KIND

    if STATE_KIND in kinds:
        cost = ("each entry holds every layer's page of its engine block; Mamba/SSM state "
                "entries exist only at the block boundaries where vLLM keeps a state")
        state = ("Mamba/SSM state groups: a hit ends at the last block boundary whose state "
                 "kvtier holds (attention blocks up to there, the state there only); "
                 "hits load asynchronously (vLLM zeroes a same-step hit's new blocks). "
                 "Not supported: Mamba without prefix caching, with speculative decoding or "
                 "with sub-block prefix matching (refused at start-up)")
    else:
        cost = f"{len(kinds)}x the bytes per block of {flag}"
        state = ("Mamba/SSM state groups are served with prefix caching on (align mode) and "
                 "refused otherwise")
    return (f"kvtier: hybrid model, {len(kinds)} KV cache groups ({', '.join(kinds)}): each "
            f"group's blocks are stored under their own keys ({cost}); sliding-window groups "
            f"load only their window. {state}")
