"""How a failed load reaches vLLM: as engine block ids, or as its request.

vLLM's scheduler takes failed loads two ways. ``get_block_ids_with_load_errors`` names engine
blocks: the scheduler rewinds each request that holds one to its first bad block and
recomputes from there (for a synchronous load too: the step's forward ran on them). A block
id is unique only within one KV cache group, so with several groups (hybrid allocator:
sliding window, Mamba/SSM state) vLLM cannot map a flat set back to requests and raises
``RuntimeError`` on the first one, which ends the engine. ``failed_recving`` of
``KVConnectorTransferResults`` (returned by ``get_transfer_results``) names requests: each
one still waiting for an asynchronous load (``WAITING_FOR_REMOTE_KVS``) restarts from zero
computed tokens, its blocks freed; a request already running is ignored.

So with several groups on a vLLM that has ``failed_recving`` every load is asynchronous
(``ConnectorSettings.async_loads_only``) and a failed one is reported by request; otherwise
block ids, which recompute only the failed blocks. vLLM 0.32 and 0.33 both have it.
A failed request is also in ``finished_recving`` (vLLM's contract: that releases it from its
wait); with several workers vLLM's ``KVOutputAggregator`` keeps a request one rank failed
until every rank finished it, so each rank reports only its own failures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - a vLLM before the request-level report
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

FAILED_RECVING = KVConnectorTransferResults is not None and "failed_recving" in {
    f.name for f in dataclasses.fields(KVConnectorTransferResults)}
"""This vLLM takes failed asynchronous loads by request (``failed_recving``)."""


def per_request(num_groups: int) -> bool:
    """Whether a failed load must be reported by request (see the module docstring)."""
    return num_groups > 1 and FAILED_RECVING


def transfer_results(sending: Iterable[str], recving: Iterable[str],
                     failed: Iterable[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults``; every failed request is in ``recving`` too
    (``failed`` is empty unless ``per_request``, so a vLLM without the field never needs it)."""
    assert KVConnectorTransferResults is not None, "this vLLM has no get_transfer_results"
    failed = set(failed)
    fields: dict[str, Any] = {"failed_recving": failed} if failed else {}
    return KVConnectorTransferResults(finished_sending=set(sending),
                                      finished_recving=set(recving) | failed, **fields)
