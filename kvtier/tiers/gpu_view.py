"""The engine's KV tensors, seen as pages addressed by engine block id.

vLLM registers one tensor per layer. Depending on the attention backend a layer tensor is
``[2, num_blocks, block_size, heads, dim]`` (K/V first), ``[num_blocks, 2, block_size, heads,
dim]`` (blocks first) or ``[num_blocks, block_size, dim]`` (MLA, one latent part). Since vLLM
0.32 every layer is a view ``[num_blocks, heads, block_size, 2*dim]`` of one allocation whose
physical dim order depends on ``KVCacheLayout`` (K and V side by side, no K/V axis): layout
``block_pages`` takes each block's bytes as one page, in physical order, whatever the strides,
and refuses layouts where a block's bytes are not one contiguous run (heads outside blocks).
Layers may live at unrelated addresses (kvcached's elastic pool), so nothing here assumes one
cross-layer allocation. Every layer is normalised to a uint8 view ``[kv_parts, num_blocks,
page_bytes]`` (possibly strided) without copying; transfer code only ever sees that view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from kvtier.tiers.layout import BlockGeometry

LAYOUTS = ("auto", "kv_first", "blocks_first", "mla", "block_pages")


class UnsupportedKVLayout(ValueError):
    """A registered KV tensor cannot be addressed as pages; the message says what was seen."""


@dataclass(frozen=True)
class LayerPages:
    name: str
    pages: torch.Tensor  # uint8 [kv_parts, num_blocks, page_bytes]
    layout: str


def _block_pages(name: str, t: torch.Tensor) -> LayerPages:
    """``[num_blocks, ...]`` with each block one contiguous run of bytes -> ``[1, blocks, page]``.

    The non-block dims are put in physical (descending stride) order first, so a page holds the
    block's bytes exactly as they lie in memory (vLLM's LBNHC/BLHNC views are permuted)."""
    if t.dim() < 2:
        raise UnsupportedKVLayout(f"layer {name}: KV tensor of shape {tuple(t.shape)} has < 2 dims")
    inner = sorted(range(1, t.dim()), key=lambda d: (-t.stride(d), d))
    phys = t.permute(0, *inner)
    if phys.stride(-1) != 1 and phys.shape[-1] != 1:
        raise UnsupportedKVLayout(f"layer {name}: innermost KV dim is not contiguous")
    raw = phys.view(torch.uint8) if phys.dtype != torch.uint8 else phys
    page_elems = 1
    for size in raw.shape[1:]:
        page_elems *= int(size)
    expect = 1
    for d in range(raw.dim() - 1, 0, -1):  # each block must be one dense run of bytes
        if raw.shape[d] != 1 and raw.stride(d) != expect:
            raise UnsupportedKVLayout(
                f"layer {name}: the bytes of one block of {tuple(t.shape)} (strides "
                f"{tuple(t.stride())}) are not one contiguous run; use a block-compact KV cache "
                "layout (vLLM: VLLM_KV_CACHE_LAYOUT=LBHNC, LBNHC, BLHNC or BLNHC)"
            )
        expect *= int(raw.shape[d])
    pages = raw.as_strided((1, raw.shape[0], page_elems), (0, raw.stride(0), 1))
    return LayerPages(name=name, pages=pages, layout="block_pages")


def _as_pages(name: str, t: torch.Tensor, layout: str) -> LayerPages:
    if layout == "block_pages":
        return _block_pages(name, t)
    if layout not in LAYOUTS:
        raise UnsupportedKVLayout(f"layer {name}: unknown layout {layout!r}; allowed: {LAYOUTS}")
    if t.dim() < 3:
        raise UnsupportedKVLayout(f"layer {name}: KV tensor of shape {tuple(t.shape)} has < 3 dims")
    if layout == "auto":
        if t.dim() == 3:
            layout = "mla"
        elif t.shape[0] == 2 and t.shape[1] != 2:
            layout = "kv_first"
        elif t.shape[1] == 2 and t.shape[0] != 2:
            layout = "blocks_first"
        else:
            raise UnsupportedKVLayout(
                f"layer {name}: cannot tell K/V-first from blocks-first for shape "
                f"{tuple(t.shape)}; pass layout='kv_first' or 'blocks_first'"
            )
    if t.stride(-1) != 1:
        raise UnsupportedKVLayout(f"layer {name}: innermost KV dim is not contiguous")
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    try:
        if layout == "mla":
            pages = raw.reshape(raw.shape[0], -1).unsqueeze(0)
        elif layout == "kv_first":
            pages = raw.reshape(raw.shape[0], raw.shape[1], -1)
        else:  # blocks_first
            pages = raw.reshape(raw.shape[0], raw.shape[1], -1).permute(1, 0, 2)
    except RuntimeError as exc:  # reshape would need a copy: pages are not contiguous
        raise UnsupportedKVLayout(f"layer {name}: pages of {tuple(t.shape)} not contiguous") from exc
    if pages.data_ptr() != raw.data_ptr() or pages.stride(-1) != 1:
        raise UnsupportedKVLayout(f"layer {name}: page view would copy; layout unsupported")
    return LayerPages(name=name, pages=pages, layout=layout)


class GpuKvView:
    """Per-layer page views of the engine's KV cache (on CUDA in production, CPU in tests)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layout: str = "auto") -> None:
        if not kv_caches:
            raise UnsupportedKVLayout("no KV cache tensors were registered")
        self.layers = [_as_pages(name, t, layout) for name, t in kv_caches.items()]
        first = self.layers[0].pages
        for layer in self.layers[1:]:
            if layer.pages.shape != first.shape:
                raise UnsupportedKVLayout(
                    f"layer {layer.name} pages {tuple(layer.pages.shape)} differ from "
                    f"{self.layers[0].name} {tuple(first.shape)}; mixed layer shapes need one "
                    "GpuKvView per KV cache group"
                )
        self.kv_parts, self.num_blocks, self.page_bytes = (int(x) for x in first.shape)
        self.device = first.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def geometry(self, engine_blocks_per_block: int, *, dtype: str = "", model: str = "") -> BlockGeometry:
        return BlockGeometry(
            num_layers=self.num_layers,
            kv_parts=self.kv_parts,
            engine_blocks_per_block=engine_blocks_per_block,
            page_bytes=self.page_bytes,
            dtype=dtype,
            model=model,
        )
