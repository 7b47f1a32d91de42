"""``KVTierConnector``: kvtier as a vLLM 0.32-0.34 KV connector (``KVConnectorBase_V1``).

How to load it: docs/vllm.md. vLLM builds one instance per role: the SCHEDULER one
(engine-core process) owns kvtier's manager (:mod:`.scheduler.side`), each WORKER one owns that
worker's CPU pool, disk store and transfer engine (:mod:`.worker.side`). They share nothing but
the metadata of :mod:`metadata`.

Hybrid models: kvtier is ``SupportsHMA``: with vLLM's hybrid allocator (on by default for
such connectors) full-attention, sliding-window and Mamba/SSM state groups are stored and
loaded per group (:mod:`group_keys`, :mod:`state_groups`: a state only where vLLM keeps one,
so a hit ends at a boundary whose state kvtier holds); Mamba without prefix caching is
refused at start-up (settings). Their hits load asynchronously and a failed load is reported
as its request, which vLLM recomputes (:mod:`compat.load_failures`: it cannot take their
block ids).

Sleep mode: ``supports_sleep_mode()`` is True; the worker's unregister/restore hooks are in
:mod:`compat.sleep`. Differences between vLLM releases live in :mod:`compat`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connectors.vllm.compat import declarations, load_failures, sleep
from kvtier.connectors.vllm.compat.version import SUPPORTED_VLLM, check_version
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.connectors.vllm.scheduler.side import SchedulerSide
from kvtier.connectors.vllm.group_keys import hybrid_notice
from kvtier.connectors.vllm.fast_path import handoff_for
from kvtier.connectors.vllm.logs import share_vllm_logging
from kvtier.connectors.vllm.settings import HMA_FLAG, derive_settings, describe
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.observe.timeline import timeline
from kvtier.connectors.vllm.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVTierConnector", "KVTierConnectorMetadata", "KVTierStats", "KVTierWorkerMetadata",
           "SUPPORTED_VLLM"]


def _runs_layer_hooks(forward_context: Any) -> bool:
    """Whether this forward calls ``wait_for_layer_load`` per layer: it has attention metadata
    and is not one full CUDA graph (nothing in Python runs inside a graph replay)."""
    mode = getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name", "NONE")
    return mode != "FULL" and bool(getattr(forward_context, "attn_metadata", None))


def _tp_rank(vllm_config: "VllmConfig") -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state (unit tests): use the config
        pass
    return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        share_vllm_logging()  # kvtier's lines in vLLM's output, at vLLM's level
        check_version()
        self.settings = derive_settings(vllm_config, kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        handoff = handoff_for(self.settings.engine_id)  # shared by this engine's two halves
        if role == KVConnectorRole.SCHEDULER:
            kvt = vllm_config.kv_transfer_config
            if kvt.kv_load_failure_policy != "recompute":
                # kvtier is a cache: a block it cannot read must be recomputed, never fail the
                # request. vLLM's scheduler reads the policy after building this connector.
                log.warning("kvtier: setting kv_load_failure_policy='recompute' (was %r): an "
                            "unreadable cached block is recomputed", kvt.kv_load_failure_policy)
                kvt.kv_load_failure_policy = "recompute"
            self._sched = SchedulerSide(self.settings, handoff)
            log.info("kvtier connector (scheduler): %s", describe(self.settings))
            if len(self.settings.groups) > 1:
                log.warning(hybrid_notice([g.kind for g in self.settings.groups], HMA_FLAG))
        else:
            self._worker = WorkerSide(self.settings, _tp_rank(vllm_config), handoff)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a future miss, never a correctness issue

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return True  # CPU and disk tiers survive; GPU copies pause (compat.sleep)

    # vLLM 0.34's declarations (inert on 0.32 / 0.33; the reasons: compat/declarations.py)
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        return declarations.kv_cache_access()  # IN_PROCESS: the extensible KV cache stays on

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any = None) -> bool:
        return declarations.LOOKAHEAD_BLOCK_HASHES

    def may_load_async(self, request: "Request") -> bool:
        return declarations.may_load_async(request)

    # ================================================================== scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: "Request") -> None:
        if self._sched is not None:
            self._sched.track(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.plan_load(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._sched is None or num_external_tokens == 0:
            return {}
        hits = self._sched.hit_sources(request)
        out = {CacheHitSource.HOST: hits.get("CPU", 0), CacheHitSource.DISK: hits.get("DISK", 0),
               CacheHitSource.EXTERNAL_UNSPECIFIED: hits.get("REMOTE", 0)}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._sched is not None:
            self._sched.on_worker_output(connector_output.kv_connector_worker_meta)
            self._sched.on_failed_recving(getattr(connector_output, "failed_recving", None)
                                          or ())

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request), None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's form: the stores of every group are tracked per request."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_block_frees(self) -> bool:
        """Finished requests whose blocks wait for their stores: vLLM waits, not preempts."""
        return self._sched is not None and self._sched.has_delayed_frees()

    def take_events(self) -> Iterable[Any]:
        return self._sched.take_events() if self._sched is not None else ()

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        if self._sched is not None:
            return self._sched.take_stats()
        if self._worker is not None:
            return self._worker.take_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            sleep.unregister(self._worker)

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            sleep.restore(self._worker)

    def get_handshake_metadata(self) -> None:
        """vLLM asks each worker for this once its start-up is over (profiling, warm-up and CUDA
        graph capture, all after ``register_kv_caches``) and before it serves: the CPU pool's
        background pinning starts here (``WorkerSide.start_up_over``). kvtier has no
        handshake to exchange."""
        if self._worker is not None:
            self._worker.start_up_over("vLLM's start-up is over")
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(per_layer=_runs_layer_hooks(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:  # this layer's attention waits for its synchronous loads
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # stores are taken from the paged cache after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished``'s sets, and the requests whose load failed on this worker where
        vLLM cannot take their block ids (several KV cache groups: compat/load_failures.py)."""
        if self._worker is None:
            return load_failures.transfer_results((), (), ())
        sending, recving, failed = self._worker.transfer_results()
        return load_failures.transfer_results(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        timeline().flush()  # vLLM's engine processes may end without running atexit
