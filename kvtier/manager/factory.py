"""Build the manager stack a config describes: the tiered manager, wrapped for threshold
admission when ``admission.store_threshold`` asks for it."""

from __future__ import annotations

from typing import Iterable

from kvtier.config import KvtierConfig
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission import AdmissionPolicy, OffloadLimit, make_admission
from kvtier.manager.admission.wrappers import StoreThresholdAdmission
from kvtier.manager.cost import LoadCostModel
from kvtier.manager.specs import BlockKey
from kvtier.manager.tiered import TieredOffloadingManager


def tier_admission(name: str, store_threshold: int, capacity_blocks: int) -> AdmissionPolicy | None:
    """The admission plug-in a tier's ``admission`` names (None: admit all). ``threshold``
    waits for ``store_threshold`` sightings, at least two (one would admit everything)."""
    if name == "all":
        return None
    return make_admission(name, threshold=max(2, store_threshold), capacity_blocks=capacity_blocks)


def _remote_args(config: KvtierConfig, block_bytes: int, directory) -> dict:
    r = config.remote
    if r is None or directory is None:
        return {}
    capacity = None if r.capacity is None else max(1, r.capacity // block_bytes)
    return {"remote": directory, "remote_max_writes": r.max_writes_in_flight,
            "remote_capacity_blocks": capacity,
            "remote_admission": tier_admission(r.admission, r.store_threshold,
                                               capacity or 1 << 20)}


def build_cost_model(config: KvtierConfig, block_bytes: int) -> LoadCostModel | None:
    cost = config.cost
    if cost is None:
        return None
    return LoadCostModel(block_bytes=block_bytes, block_tokens=config.block_tokens,
                         recompute_s_per_token=cost.recompute_us_per_token * 1e-6,
                         prior_bytes_per_s=cost.prior_load_gbps * 1e9)


def build_manager(
    config: KvtierConfig, block_bytes: int, initial_disk_keys: Iterable[BlockKey] = (),
    stale_disk_keys: Iterable[BlockKey] = (),
    *,
    remote=None,
    host=None,
) -> OffloadingManager:
    """``TieredOffloadingManager`` sized for ``block_bytes`` blocks, wrapped by the admission
    the config asks for. ``stale_disk_keys``: records found on some ranks only, deleted on
    every rank. ``remote``: the shared tier's ``RemoteDirectory`` when ``tiers.remote`` is
    configured; ``host``: the instance's ``HostTier`` (``manager/host.py``) when ``tiers.host``
    is. Callers use only the ``OffloadingManager`` contract."""
    config.check_block_bytes(block_bytes)
    cpu_blocks = config.cpu_slots(block_bytes)
    disk = config.disk
    disk_blocks = config.disk_blocks(block_bytes) if disk is not None else 0
    disk_admission = None
    if disk is not None:  # store_threshold > 1 alone means threshold admission (older configs)
        name = "threshold" if disk.store_threshold > 1 and disk.admission == "all" else disk.admission
        disk_admission = tier_admission(name, disk.store_threshold, disk_blocks)
    manager: OffloadingManager = TieredOffloadingManager(
        cpu_blocks=cpu_blocks,
        cpu_eviction=config.cpu.eviction,
        disk_blocks=disk_blocks,
        disk_eviction=disk.eviction if disk is not None else "lru",
        cpu_admission=tier_admission(config.cpu.admission, 2, cpu_blocks),
        disk_admission=disk_admission,
        initial_disk_keys=initial_disk_keys,
        stale_disk_keys=stale_disk_keys,
        cost=build_cost_model(config, block_bytes),
        block_bytes=block_bytes,
        host=host,
        offload_limit=OffloadLimit(config.admission.offload_ratio,
                                   config.admission.max_offload_tokens),
        **_remote_args(config, block_bytes, remote),
    )
    adm = config.admission
    if adm.store_threshold > 1:
        manager = StoreThresholdAdmission(manager, adm.store_threshold, 4 * (cpu_blocks + disk_blocks))
    return manager
