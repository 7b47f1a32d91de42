"""What differs between the vLLM releases kvtier supports (0.32-0.34), behind small adapters.

Each module answers one question the same way on both releases, so the connector itself holds
no version checks:

* :mod:`.version` — which vLLM is running, and whether kvtier was tested with it.
* :mod:`.req_data` — a step's block tables per request, with "is this the whole table" meaning
  the same thing on both (vLLM 0.33 changed the third element of ``yield_req_data``).
* :mod:`.kv_events` — ``BlockStored`` / ``BlockRemoved`` with the fields this vLLM's structs
  have (medium, locality, group index, cache-spec kind).
* :mod:`.hints` — per-request ``kv_hints`` (orchestrator retention hints) as plain kvtier data
  for the placement layer.
* :mod:`.sleep` — the worker's sleep/wake hooks (0.33 calls them; 0.32 never does).
* :mod:`.load_failures` — how a failed load reaches vLLM: engine block ids with one KV cache
  group, the request (``failed_recving``) with several, where vLLM raises on block ids.
* :mod:`.declarations` — what vLLM 0.34 asks a connector to declare (``kv_cache_access``,
  ``may_load_async``, ``supports_lookahead_block_hashes``), inert on 0.32 / 0.33.

What 0.33 and 0.34 change that needs no adapter, and why: docs/vllm.md, "Versions".
"""
