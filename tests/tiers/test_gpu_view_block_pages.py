"""GpuKvView layout "block_pages": vLLM 0.32's per-layer views, one contiguous page per block.

vLLM 0.32 puts all layers in one allocation and registers per-layer views ``[B, H, N, 2D]``
whose physical dim order depends on the KV cache layout. Every block-compact layout must map
page ``b`` to exactly the bytes of block ``b`` in memory order, and a layout whose blocks are
not one contiguous run must be refused with a message naming the fix.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.manager.specs import LoadStoreSpec
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView, UnsupportedKVLayout
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler

L, B, H, N, C = 2, 6, 2, 4, 8


def layer_views(order: str, fill: bool) -> dict[str, torch.Tensor]:
    """Per-layer logical views [B, H, N, C] of one buffer laid out in ``order``."""
    numel = L * B * H * N * C
    buf = torch.randn(numel) if fill else torch.zeros(numel)
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    phys = buf.view(*(sizes[c] for c in order))
    logical = phys.permute(*(order.index(c) for c in "LBHNC"))  # [L, B, H, N, C]
    return {f"layer.{i}": logical[i] for i in range(L)}


def block_bytes_in_memory(t: torch.Tensor, b: int) -> torch.Tensor:
    blk = t[b]
    order = sorted(range(blk.dim()), key=lambda d: -blk.stride(d))
    return blk.permute(*order).contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_pages_are_the_blocks_bytes(order):
    views = layer_views(order, fill=True)
    view = GpuKvView(views, "block_pages")
    assert (view.kv_parts, view.num_blocks, view.page_bytes) == (1, B, H * N * C * 4)
    for layer, (name, t) in zip(view.layers, views.items()):
        for b in range(B):
            assert torch.equal(layer.pages[0, b], block_bytes_in_memory(t, b)), (name, b)


@pytest.mark.parametrize("order", ["LHBNC", "BHLNC"])
def test_layouts_with_heads_outside_blocks_are_refused(order):
    with pytest.raises(UnsupportedKVLayout, match="VLLM_KV_CACHE_LAYOUT"):
        GpuKvView(layer_views(order, fill=True), "block_pages")


@pytest.mark.parametrize("order", ["LBHNC", "BLNHC"])
def test_round_trip_through_cpu_pool_is_bit_exact(order):
    src, dst = layer_views(order, fill=True), layer_views(order, fill=False)
    sv, dv = GpuKvView(src, "block_pages"), GpuKvView(dst, "block_pages")
    pool = CpuBlockPool(sv.geometry(1), 4, pin=False)
    gpu_src, gpu_dst, slots = [4, 1, 5], [0, 3, 2], [2, 0, 3]

    async def go():
        await GpuToCpuHandler(sv, pool).run(LoadStoreSpec.gpu(gpu_src), LoadStoreSpec.cpu(slots))
        await CpuToGpuHandler(dv, pool).run(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(gpu_dst))

    asyncio.run(go())
    for name in src:
        for s, d in zip(gpu_src, gpu_dst):
            assert torch.equal(dst[name][d], src[name][s])
        untouched = [b for b in range(B) if b not in gpu_dst]
        assert all(torch.count_nonzero(dst[name][b]) == 0 for b in untouched)
