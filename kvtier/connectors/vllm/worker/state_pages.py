"""A Mamba/SSM state layer's registered cache, seen as whole pages of the attention page size.

vLLM views a state layer's slots as ``[num_blocks, ...]`` tensors of the state's own size,
while each slot occupies one padded page (the hybrid allocator pads state pages to the
attention page, so every group's blocks share one pool). kvtier copies pages of one size for
every layer, so a state layer is seen as ``[num_blocks, page_bytes]``: each slot's state and
its padding, exactly the page vLLM reserved for it, nothing of a neighbour's.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.tiers.gpu_view import UnsupportedKVLayout


def _first_tensor(cache: Any) -> torch.Tensor:
    """The layer's cache tensor (vLLM gives some state layers a list: conv, ssm states)."""
    if isinstance(cache, torch.Tensor):
        return cache
    if isinstance(cache, (list, tuple)) and cache and all(isinstance(t, torch.Tensor)
                                                           for t in cache):
        return min(cache, key=lambda t: t.storage_offset() * t.element_size())
    raise UnsupportedKVLayout(f"state layer cache of type {type(cache).__name__}")


def state_pages(name: str, cache: Any, page_bytes: int) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 over the slots of state layer ``name``; refuses a
    layout whose slots are not ``page_bytes`` apart (the page would reach a neighbour)."""
    t = _first_tensor(cache)
    stride = t.stride(0) * t.element_size()
    if stride != page_bytes:
        raise UnsupportedKVLayout(
            f"state layer {name}: slots are {stride} B apart, the hybrid page is {page_bytes} B"
            " (a layout with layers inside blocks); unsupported")
    storage = t.untyped_storage()
    offset = t.storage_offset() * t.element_size()
    if offset + t.shape[0] * page_bytes > storage.nbytes():
        raise UnsupportedKVLayout(f"state layer {name}: its last page would pass the cache end")
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, offset, (t.shape[0], page_bytes), (page_bytes, 1))
