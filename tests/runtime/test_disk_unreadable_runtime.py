"""A damaged disk index at start-up: the scheduler and the workers run on without the tier.

Issue 14.6: a truncated ``data.mdb`` must never crash the process (SIGBUS) and must not keep
vLLM from starting; kvtier logs what happened and serves from CPU memory. Both halves are
covered: the scheduler's read of the index (``disk_keys.read_keys``) and the worker's
``WorkerRuntime``. Run in a subprocess so a signal would show as a negative exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=2, kv_parts=1, engine_blocks_per_block=1, page_bytes=512,
                    dtype="float32", model="m")

CHILD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from kvtier.config import load_config
    from kvtier.tiers.disk.catalog.inventory import read_keys
    from kvtier.runtime.worker import WorkerRuntime
    from kvtier.tiers.gpu_view import GpuKvView
    from kvtier.tiers.layout import BlockGeometry
    geo = BlockGeometry(num_layers=2, kv_parts=1, engine_blocks_per_block=1, page_bytes=512,
                        dtype="float32", model="m")
    print("keys", len(read_keys(Path(sys.argv[1]), geo)))
    layers = {f"l{i}": torch.zeros(4, 1, 128) for i in range(2)}
    view = GpuKvView(layers, "block_pages")
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "1MiB"},
                                      "disk": {"path": sys.argv[1], "capacity": "4MiB"}}})
    rt = WorkerRuntime.create(cfg, view, view.geometry(1))
    print("store", rt.store is None, [f"{a.value}->{b.value}" for a, b in rt.engine.routes])
    rt.close()
""")


def test_truncated_index_means_no_disk_tier_not_a_crash(tmp_path):
    path = tmp_path / "disk"
    with DiskStore(path, GEO) as s:
        s.put_many([(bytes([i]) * 32, bytes(GEO.block_bytes)) for i in range(40)])
    os.truncate(path / "index.lmdb" / "data.mdb", 3 * 4096)
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "keys 0" in r.stdout
    assert "store True ['GPU->CPU', 'CPU->GPU']" in r.stdout
    assert "running without the disk tier" in r.stderr and str(path) in r.stderr
