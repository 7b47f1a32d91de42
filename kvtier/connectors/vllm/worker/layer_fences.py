"""Per-layer ordering of a step's synchronous loads before the attention that reads them.

Why: a synchronous hit is copied layer by layer (:mod:`kvtier.transfer.cuda.direct`); if layer
``l``'s attention waits on the GPU only for layer ``l``'s pages, the forward's first layers run
while later layers are still on the wire, and a hit costs about the copy alone. That is only
safe when vLLM really calls ``wait_for_layer_load`` for every layer (not inside one full CUDA
graph, where no Python hook runs): the fences learn this from a forward that called every hook
before relying on it, and a forward that skipped the hook of a fenced layer is caught after it
ran: its loads' blocks are reported as load errors (vLLM recomputes them) and whole-load fences
are used from then on.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger(__name__)


class LayerFences:
    """Which loads the current forward fences per layer, and whether vLLM runs the hooks."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        self._layer_of = {n: i for i, n in enumerate(layer_names)}
        self.hooks_seen = False  # vLLM called wait_for_layer_load for every layer once
        self._hooked: set[int] = set()  # layers whose hook ran in this step's forward
        self._fenced: dict[int, tuple[int, ...]] = {}  # sync load -> its GPU blocks

    def begin_step(self) -> None:
        self._hooked = set()

    def arm(self, loads: dict[int, tuple[int, ...]]) -> bool:
        """Fence these synchronous loads (job id -> GPU blocks) per layer if the hooks are
        known to run; False: the caller fences them whole before the forward."""
        if not self.hooks_seen:
            return False
        self._fenced = dict(loads)
        return True

    def on_layer(self, layer_name: str, fence_layer: Callable[[list[int], int], None]) -> None:
        """vLLM's hook before a layer's attention: order it after that layer of the loads."""
        if self.hooks_seen and not self._fenced:
            return  # nothing to order, nothing left to learn (the hook runs every layer)
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        self._hooked.add(layer)
        if self._fenced:
            fence_layer(list(self._fenced), layer)

    def end_step(self, fence_whole: Callable[[list[int]], None]) -> dict[int, tuple[int, ...]]:
        """After the forward: learn whether vLLM ran every hook; return the loads (job id ->
        GPU blocks) whose layer the forward did not wait for (their KV is not trusted)."""
        hooked, self._hooked = self._hooked, set()
        complete = len(hooked) == len(self._layer_of) > 0
        fenced, self._fenced = self._fenced, {}
        if complete:
            self.hooks_seen = True
            return {}
        if not fenced:
            return {}
        self.hooks_seen = False
        log.error("kvtier: the forward skipped wait_for_layer_load for %d of %d layers; "
                  "%d loads are recomputed and loads are fenced whole from now on",
                  len(self._layer_of) - len(hooked), len(self._layer_of), len(fenced))
        fence_whole(list(fenced))
        return fenced
