"""What vLLM 0.34's connector API asks a connector to declare, answered for kvtier.

vLLM 0.34's ``KVConnectorBase_V1`` asks three new questions; 0.32 and 0.33 never ask them, so
the connector's answers are inert there (``KVCacheAccess`` is imported only where it exists).

* ``kv_cache_access()``: how the workers reach the device KV cache. kvtier copies blocks
  inside the worker process (torch / CuPy kernels on the tensors ``register_kv_caches`` hands
  it); no other process maps GPU memory (the disk and shared-tier I/O children move bytes of
  the CPU pool only) and nothing registers it with UCX or RDMA: ``IN_PROCESS``, under which any
  allocation works. So vLLM 0.34's extensible KV cache (reserved as virtual memory, committed
  after warm-up; on by default) stays on: vLLM builds the worker's connector after the commit
  and registers views over the committed blocks only, which is the geometry kvtier reads;
  sleep releases the physical memory and wake-up recommits it at the same virtual addresses,
  which :mod:`.sleep` checks before GPU copies resume.
* ``may_load_async(request)``: whether the request may start an asynchronous load while the
  running batch is full (with ``--max-num-inflight-kv-loads``). False for every request:
  whether kvtier loads a hit asynchronously (disk and shared-tier hits, CPU hits past the
  step's budget) is known only from the lookup, which has effects (sightings, the step's
  budget, an early copy) and must not run for a request that is merely queued. vLLM asks this
  on every enqueue and a wrong True holds back other loads; False keeps vLLM's own order
  (kvtier's asynchronous loads start when a running slot is free, as on 0.32 and 0.33).
* ``supports_lookahead_block_hashes()``: False. With lookahead hashes a block's hash also
  covers tokens after the block (``BlockStored.lookahead_token_ids``); kvtier's KV events give
  a block's own tokens only, so a consumer rebuilding hashes from them would get others. vLLM
  then keeps the plain hashes (EAGLE's trailing-block drop instead).
"""

from __future__ import annotations

from typing import Any

LOOKAHEAD_BLOCK_HASHES = False


def kv_cache_access() -> Any:
    """``KVCacheAccess.IN_PROCESS`` on a vLLM that has the flags (0.34+), else None (never
    asked there)."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    return KVCacheAccess.IN_PROCESS


def may_load_async(request: Any) -> bool:
    """Never announced ahead of the lookup (see the module's docstring)."""
    return False
