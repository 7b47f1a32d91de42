"""Tensor parallelism on the host tier: each rank of every instance maps its own rank's pool
(each rank holds a different slice of every block), one region per instance serves all its
ranks, and a hit on another instance's block reads, on rank r, that instance's rank-r slice.

Two instances of TP 2 in one process (the connector's scheduler side: ``open_host_tier``; each
worker's: ``attach_host_pool``), against a real service process."""

from __future__ import annotations

import os
import signal

import torch

from kvtier.config import load_config
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.manager.factory import build_manager
from kvtier.manager.host import open_host_tier
from kvtier.manager.specs import Medium
from kvtier.runtime.worker import attach_host_pool
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.host import HostAddress
from kvtier.tiers.host.client import observe

PAGE, LAYERS, WORLD = 1024, 2, 2
BLOCK = LAYERS * PAGE


def settings(tmp_path) -> ConnectorSettings:
    cfg = load_config(data={"tiers": {"cpu": {"capacity": 8 * BLOCK, "pin": False},
                                      "host": {"capacity": 32 * BLOCK,
                                               "dir": str(tmp_path / "host")}}}, env={})
    return ConnectorSettings(config=cfg, block_size=16, hash_block_size=16, block_tokens=16,
                             layer_names=tuple(f"l{i}" for i in range(LAYERS)), page_bytes=PAGE,
                             sliding_window=None, world_size=WORLD, tp_size=WORLD,
                             kv_dtype="uint8", identity="host-tp-test")


class Instance:
    def __init__(self, s: ConnectorSettings, name: str) -> None:
        fingerprint = s.geometry(0).fingerprint()
        self.host = open_host_tier(s.config, fingerprint, s.block_bytes, name)
        self.manager = build_manager(s.config, s.block_bytes, host=self.host)
        self.ranks = []
        for r in range(WORLD):
            geo = s.geometry(r)
            client, fd = attach_host_pool(s.config, fingerprint, geo, r, name)
            pool = CpuBlockPool(geo, client.total_slots, pin=False, pool_fd=fd)
            self.ranks.append((client, pool))

    def store(self, keys: list[bytes]) -> None:
        plan = self.manager.prepare_store(keys)
        for r, (_, pool) in enumerate(self.ranks):
            for key, slot in zip(plan.keys, plan.cpu_slots):
                pool.slot(slot).copy_(slice_of(key, r))
        self.manager.complete_store(plan.keys, True)

    def close(self) -> None:
        for client, _ in self.ranks:
            client.close()
        self.host.close()


def slice_of(key: bytes, rank: int) -> torch.Tensor:
    pattern = (key + bytes([rank])) * (BLOCK // (len(key) + 1) + 1)
    return torch.frombuffer(bytearray(pattern[:BLOCK]), dtype=torch.uint8)


def test_each_rank_reads_its_own_slice_of_another_instances_block(tmp_path):
    s = settings(tmp_path)
    a = Instance(s, "engine-a")
    pid = observe(HostAddress.from_config(s.config.host, s.geometry(0).fingerprint(),
                                          s.block_bytes).socket_path)["pid"]
    b = Instance(s, "engine-b")
    try:
        keys = [b"tp-%d" % i for i in range(6)]
        a.store(keys)
        a.host.client.flush()
        found = b.manager.lookup(keys)
        assert found.num_hits == len(keys) and not found.pending
        plan = b.manager.prepare_load(keys)
        assert plan.keys == tuple(keys)
        a_slots = [a.manager.tier(Medium.CPU).get(k).slot for k in keys]
        assert list(plan.cpu_slots) == a_slots  # read where a stored them
        for r, (_, pool) in enumerate(b.ranks):  # b's own mapping of rank r's pool
            for key, slot in zip(plan.keys, plan.cpu_slots):
                assert torch.equal(pool.slot(slot), slice_of(key, r)), (key, r)
        b.manager.complete_load(plan.keys)
        assert b.manager.pins() == 0
        stats = observe(HostAddress.from_config(s.config.host, s.geometry(0).fingerprint(),
                                                s.block_bytes).socket_path)
        assert len(stats["pool_bytes"]) == WORLD  # one pool per rank
        by_name = {i["name"]: i for i in stats["instances"]}
        assert by_name["engine-a"]["connections"] == 1 + WORLD  # scheduler + its ranks
        assert by_name["engine-b"]["hits_taken"] == len(keys)
    finally:
        b.close()
        a.close()
        os.kill(pid, signal.SIGKILL)
