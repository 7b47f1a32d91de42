"""Mamba/SSM state groups of a hybrid model: what vLLM keeps of them, and what kvtier can serve.

With prefix caching a Mamba group runs in vLLM's ``mamba_cache_mode="align"``: the group has
the attention groups' block size, its page is padded to theirs, and slot ``p`` of a request's
block table holds the recurrent state after exactly ``(p + 1) * block_size`` tokens, or is the
null block (vLLM materialises only some boundaries: where a prefill chunk or its checkpoint
ends, and each block boundary decode crosses). kvtier keeps such a state under the group's
key of token block ``p`` (:mod:`group_keys`), stored when the slot is real and its boundary
computed; a hit then needs the attention groups' blocks up to its end and the state at its
end only (:mod:`scheduler.state_hit`).

That invariant only holds without the slot moves vLLM makes for speculative decoding and
without sub-block prefix matching (a checkpoint slot then holds a state inside its block):
those, and Mamba without prefix caching (no state is ever kept per prefix), are refused at
start-up with the setting to change.
"""

from __future__ import annotations

from typing import Any

STATE_KIND = "mamba"  # vLLM's KVCacheSpecKind value for every recurrent-state spec


def is_state_spec(spec: Any) -> bool:
    """A recurrent-state (Mamba, linear attention, short conv...) cache spec."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def state_spec_problem(spec: Any, block_size: int, hash_block_size: int) -> str | None:
    """Why kvtier cannot serve this state group (one line, with what to change), or None."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"kvtier: Mamba/SSM state group in mamba_cache_mode={mode!r}: vLLM keeps no "
                "state per prefix, there is nothing to offload; start vLLM with "
                "--enable-prefix-caching (mamba_cache_mode 'align'), or serve the model "
                "without kvtier's --kv-transfer-config")
    if int(getattr(spec, "num_speculative_blocks", 0) or 0) > 0:
        return ("kvtier: Mamba/SSM state groups with speculative decoding are not supported "
                "(vLLM moves state slots between positions); serve without speculative "
                "decoding or without kvtier's --kv-transfer-config")
    if int(spec.block_size) != block_size:
        return (f"kvtier: Mamba/SSM state group block size {spec.block_size} differs from "
                f"the attention block size {block_size}; start vLLM with "
                "--enable-prefix-caching (align mode makes them equal)")
    if hash_block_size != block_size:
        return (f"kvtier: Mamba/SSM state groups need prefix matching on whole blocks "
                f"(prefix_match_unit {hash_block_size} != block size {block_size}); unset "
                "--prefix-match-unit")
    return None


def state_page_bytes(spec: Any) -> int:
    """The bytes of one state slot as vLLM lays it out: the page padded to the attention
    groups' page (what a page copy moves), not the state's own size."""
    return int(spec.page_size_bytes)
