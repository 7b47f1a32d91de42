"""Stores of a request whose synchronous load failed, held back until the scheduler saw it.

Why: a synchronous load's forward runs in the same step as its copy. If the copy is refused or
the forward skipped a fenced layer's hook, the KV that forward read is untrusted, and so is the
KV it computed for the step's new tokens. vLLM rewinds the request when it processes the
step's output, and kvtier plans stores from ``num_computed_tokens`` one step late, so with a
synchronous scheduler the next plan already sees the rewind. With vLLM's batch queue (async
scheduling) the next step is planned *before* that output is processed: its late store would
copy the blocks computed on untrusted KV into the CPU tier, where a later hit would load them.
Same-step stores (sliding-window models) would copy them in the failing step itself.

So a worker taints the request when it learns of the failure and refuses (fails: a future
miss, never wrong bytes) the request's stores until a step's metadata acknowledges the taint:
the worker reports it (``KVTierWorkerMetadata.tainted``), and the first metadata the scheduler
builds after processing that report (``untaint``) was planned after vLLM's rewind.
"""

from __future__ import annotations

import logging
from typing import Iterable

log = logging.getLogger(__name__)


class LoadTaint:
    def __init__(self) -> None:
        self._tainted: set[str] = set()
        self._unreported: set[str] = set()

    def taint(self, req_id: str) -> None:
        if req_id not in self._tainted:
            log.warning("kvtier: a synchronous load of %s failed after its forward ran: its "
                        "stores are refused until the scheduler has seen the failure", req_id)
        self._tainted.add(req_id)
        self._unreported.add(req_id)

    def acknowledged(self, req_ids: Iterable[str]) -> None:
        self._tainted.difference_update(req_ids)

    def refuses(self, req_id: str) -> bool:
        return req_id in self._tainted

    def take_report(self) -> tuple[str, ...]:
        out, self._unreported = tuple(sorted(self._unreported)), set()
        return out
