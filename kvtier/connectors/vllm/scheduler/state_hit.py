"""The hit rule of a model with Mamba/SSM state groups (:mod:`..state_groups`).

A recurrent state summarises every token before it, so a hit of ``L`` token blocks needs the
attention groups' blocks ``0 .. L - 1`` (from the local hit on) and, of each state group,
only the state after ``L`` blocks, i.e. its entry of block ``L - 1``. States exist only at
some boundaries (where vLLM materialised one), so the hit is the longest run of attention
blocks cut back to the last block whose state every state group holds: never past a state
kvtier does not have, which would run the model from a wrong state.

The hit also ends on a block boundary short of the prompt's last token (the caller caps
``stop``): a state cannot be loaded "whole" and one token recomputed over it, as
:func:`..side.claim` does for attention, because that token would advance the state twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.manager.abstract import OffloadingManager


@dataclass(frozen=True)
class StateHit:
    units: int  # kvtier blocks (token blocks x groups) from ``start``; a multiple of per_block
    pending: bool = False  # the shared tier is being asked: ask again next step


def state_lookup(manager: OffloadingManager, keymap: Any, request: Any, start: int,
                 stop: int, sighting: bool) -> StateHit:
    """The hit of ``request`` over units ``start .. stop - 1`` of ``keymap`` (a GroupKeyMap
    with ``state_groups``); ``sighting``: count the blocks for admission (first lookup)."""
    per, state = keymap.per_block, keymap.state_groups
    first, last = start // per, stop // per
    attention = [g for g in range(per) if g not in state]
    keys = [keymap.key(request, b * per + g) for b in range(first, last) for g in attention]
    found = manager.lookup(keys, sighting=sighting)
    if found.pending:
        return StateHit(0, pending=True)
    if sighting:  # states are looked up one boundary at a time: count them all once here
        manager.lookup([keymap.key(request, b * per + g) for b in range(first, last)
                        for g in state], sighting=True)
    end = first + found.num_hits // len(attention)
    while end > first:  # the longest run first; each step back drops one block
        got = manager.lookup([keymap.key(request, (end - 1) * per + g) for g in state],
                             sighting=False)
        if got.pending:
            return StateHit(0, pending=True)
        if got.num_hits == len(state):
            return StateHit((end - first) * per)
        end -= 1
    return StateHit(0)
