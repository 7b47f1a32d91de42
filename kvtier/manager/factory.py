"""Build the manager stack a config describes: tiered manager + admission wrappers."""

from __future__ import annotations

from typing import Iterable

from kvtier.config import KvtierConfig
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission import make_admission
from kvtier.manager.admission.wrappers import OffloadRatioAdmission, StoreThresholdAdmission
from kvtier.manager.specs import BlockKey
from kvtier.manager.tiered import TieredOffloadingManager


def build_manager(
    config: KvtierConfig, block_bytes: int, initial_disk_keys: Iterable[BlockKey] = ()
) -> OffloadingManager:
    """``TieredOffloadingManager`` sized for ``block_bytes`` blocks, wrapped by the admission
    the config asks for. Extras of the tiered manager stay reachable through the wrappers."""
    config.check_block_bytes(block_bytes)
    cpu_blocks = config.cpu_slots(block_bytes)
    disk = config.disk
    disk_blocks = config.disk_blocks(block_bytes) if disk is not None else 0
    disk_admission = None
    if disk is not None and disk.store_threshold > 1:
        disk_admission = make_admission(
            "threshold", threshold=disk.store_threshold, capacity_blocks=disk_blocks
        )
    manager: OffloadingManager = TieredOffloadingManager(
        cpu_blocks=cpu_blocks,
        cpu_eviction=config.cpu.eviction,
        disk_blocks=disk_blocks,
        disk_eviction=disk.eviction if disk is not None else "lru",
        disk_admission=disk_admission,
        initial_disk_keys=initial_disk_keys,
    )
    adm = config.admission
    if adm.store_threshold > 1:
        manager = StoreThresholdAdmission(manager, adm.store_threshold, 4 * (cpu_blocks + disk_blocks))
    if adm.offload_ratio < 1.0 or adm.max_offload_tokens is not None:
        manager = OffloadRatioAdmission(manager, adm.offload_ratio, adm.max_offload_tokens)
    return manager
