"""The shared tier's I/O processes (``RemoteIOProcesses``) over a small shared CPU pool, for
the tests that drive them against real Valkey servers."""

from __future__ import annotations

import torch

from kvtier.config import load_config
from kvtier.tiers.remote.io.process import RemoteIOProcesses
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.wire.connect import remote_keys
from kvtier.tiers.remote.secrets import RemoteSecrets

BLOCK = 256 << 10
SLOTS = 48


def geometry(model: str = "remote-proc") -> BlockGeometry:
    return BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1,
                         page_bytes=BLOCK // 2, model=model)


def remote_cfg(tmp_path, **remote):
    data = {"tiers": {"cpu": {"capacity": f"{SLOTS * BLOCK}", "pin": False},
                      "remote": {"timeout_s": 0.5, "connect_timeout_s": 0.5,
                                 "probe_interval_s": 0.3, "io_processes": 2, **remote}}}
    return load_config(data=data, env={}).remote


def open_io(cfg, secrets=None, model="remote-proc", **kw):
    geo = geometry(model)
    pool = CpuBlockPool(geo, SLOTS, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), secrets or RemoteSecrets.load(cfg),
                           **kw)
    return pool, io


def fill(pool, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in slots:
        pool.slot(s).copy_(torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=g))
        out.append(pool.slot(s).clone())
    return out


def keys_of(n, tag="b"):
    return [f"{tag}{i}".encode() for i in range(n)]
