"""Sleep mode on the worker: vLLM 0.33 calls ``unregister_kv_caches`` before it suspends the
GPU memory (level 1 discards the KV cache, level 2 all GPU memory) and
``restore_kv_caches`` after wake-up; vLLM 0.32 never calls them.

kvtier's CPU pool (host memory) and disk store are untouched by sleep, so what they hold
survives and hits after wake-up. What must not happen is a copy touching the suspended GPU
pages: ``unregister`` waits (on the host) for every load and store already submitted, fails
the loads still waiting for a disk promotion (vLLM recomputes those blocks, nothing half-
written is trusted), and from then on any GPU copy the worker is asked for fails as a job
error (a store becomes a future miss, a load a recompute) until ``restore``. ``restore``
checks that the engine's KV tensors are where they were (sleep keeps their virtual
addresses); if not, the GPU side stays off rather than copying to stale addresses.
Both are idempotent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.connectors.vllm.worker.side import WorkerSide

log = logging.getLogger(__name__)

ASLEEP = "kvtier: KV caches are unregistered (sleep mode)"


def _addresses(ws: "WorkerSide") -> tuple[int, ...]:
    view = ws.view
    return tuple(layer.pages.data_ptr() for layer in view.layers) if view is not None else ()


def unregister(ws: "WorkerSide") -> None:
    if ws.asleep:
        return
    if ws.runtime is not None:
        ws.jobs.quiesce(ASLEEP)  # loads waiting for a promotion: never reach the GPU now
    ws.sleep_addresses = _addresses(ws)
    ws.asleep = True
    log.info("kvtier: worker rank %d: KV caches unregistered for sleep; CPU and disk tiers "
             "kept", ws.tp_rank)


def restore(ws: "WorkerSide") -> None:
    if not ws.asleep:
        return
    now = _addresses(ws)
    if now != ws.sleep_addresses:
        log.error("kvtier: worker rank %d: KV cache addresses changed across sleep; GPU "
                  "transfers stay off (hits are recomputed)", ws.tp_rank)
        return
    ws.asleep = False
    log.info("kvtier: worker rank %d: KV caches restored after wake-up", ws.tp_rank)
