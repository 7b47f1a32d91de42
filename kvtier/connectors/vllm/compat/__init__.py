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

What 0.33 changes that needs no adapter here, and why:

* vLLM's ``OffloadingManager`` gains a ``lock`` (held from a lookup HIT to the
  ``prepare_load`` that pins it), ``on_reset_flushed()`` and ``config_info()``; kvtier does not
  plug into vLLM's offloading manager but drives its own (``kvtier.manager``) from the
  connector, only on the scheduler thread: nothing can evict a hit between
  ``get_num_new_matched_tokens`` and ``update_state_after_alloc``, and a shorter
  ``prepare_load`` plan is recomputed, never read. ``CachePolicy.insert(ctx)``'s request
  context is kvtier's ``prepare_store(keys, RequestContext)`` (which now carries the hints).
* ``sync_load_budget_bytes`` (small hits loaded inside the step) is a kvtier key of the same
  name and meaning on both releases (``settings.sync_load_budget``).
* ``get_loaded_kv_cache_group_ids`` keeps vLLM's default (the prefix-cacheable groups: all a
  hash-addressed store holds); ``requires_kv_delivery`` is False (a cache);
  ``has_pending_block_frees`` is True while a finished request's blocks wait for its stores.

What 0.34 changes that needs no adapter here, and why:

* The default block size is 64 (was 16): ``block_tokens`` left out of the kvtier config is
  vLLM's block size (``settings.block_tokens``), so no ``--block-size`` has to match.
* The extensible KV cache (``--enable-extensible-kv-cache``, on by default): vLLM builds the
  worker's connector after the final commit and hands it views over the committed blocks;
  kvtier declares ``IN_PROCESS`` access (:mod:`.declarations`) and its sleep check compares
  virtual addresses, which a recommit keeps.
* ``touch()`` left vLLM's offload manager and its policies; kvtier never called them.
"""
