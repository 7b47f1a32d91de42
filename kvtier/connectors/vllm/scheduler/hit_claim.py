"""How much of a hit to report to vLLM, and whether its last block is loaded whole.

vLLM computes at least the prompt's last token. A hit that reaches it is reported one token
short and its last block is still loaded whole (the forward then rewrites that one token's KV,
ordered after the copy): the step computes one token, a batch vLLM runs as one full CUDA
graph. A hit cut at the block before would leave a block of tokens to a piecewise forward,
whose host time per layer exceeds a small hit's whole copy. Above ``whole_max_bytes`` (from
``whole_tail_layer_bytes`` per layer, a ``kv_connector_extra_config`` key) the cut is at the
block before instead, which lets the forward's layers follow a long copy layer by layer
(layer_fences.py). The default is where the two meet (figures: docs/design-measurements.md)."""

from __future__ import annotations


def claim(hits: int, per: int, block_tokens: int, room: int, block_bytes: int,
          whole_max_bytes: float) -> tuple[int, int]:
    """(kvtier blocks to load, tokens to report to vLLM) for a run of ``hits`` kvtier blocks
    (``per`` per token block) when vLLM may take ``room`` more tokens before the last one."""
    tokens = hits // per * block_tokens
    if tokens <= room:
        return hits, tokens
    if hits * block_bytes <= whole_max_bytes:
        return hits, room
    hits -= per * -(-(tokens - room) // block_tokens)
    return hits, hits // per * block_tokens
