"""A host-tier hit on a real GPU: instance A stores GPU -> CPU into its region of the host's
pool; instance B, in another process with its own mapping and page-locking of that pool,
loads those very slots CPU -> GPU with the CUDA handler, every load mode. B's engine blocks
must land bit-exact, nothing else may be written.

Skipped without CUDA (CI); run on the lent GPU machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_cuda_transfer import DEV, make_caches, reference_slots, run  # noqa: E402
from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.tiers.host import HostAddress, HostClient  # noqa: E402
from kvtier.tiers.host.client import observe  # noqa: E402
from kvtier.transfer.cuda import CudaGpuToCpuHandler  # noqa: E402

BLOCKS = 48
LAYERS, PAGE = 4, 32 << 10
CHILD = Path(__file__).resolve().parent / "host_tier_child.py"


def caches(seed: int) -> GpuKvView:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return GpuKvView(make_caches("kv_first", LAYERS, 2 * BLOCKS + 8, PAGE, torch.bfloat16, gen),
                     layout="kv_first")


@pytest.mark.parametrize("loads", ["rule", "layered", "staged"])
def test_another_instances_slots_load_bit_exact_from_its_own_mapping(tmp_path, loads):
    view = caches(61)
    geo = view.geometry(1)
    address = HostAddress(tmp_path / "host", geo.fingerprint(), 4 * BLOCKS, idle_exit_s=60)
    a = HostClient.connect(address, "a")
    pid = observe(address.socket_path)["pid"]
    try:
        base = a.register(2 * BLOCKS)
        pool = CpuBlockPool(geo, a.total_slots, pool_fd=a.attach(0, geo.block_bytes))
        pool.wait_ready()
        slots = list(range(base + 5, base + 5 + BLOCKS))
        src = list(range(BLOCKS))
        run(CudaGpuToCpuHandler(view, pool).run(LoadStoreSpec.gpu(src), LoadStoreSpec.cpu(slots)))
        torch.cuda.synchronize()
        want = reference_slots(view, src, 1).cpu().contiguous().view(torch.uint8).flatten()
        want.numpy().tofile(tmp_path / "want.bin")  # raw bytes: nothing to unpickle
        spec = {"socket_dir": str(address.directory), "fingerprint": address.fingerprint,
                "total_slots": address.total_slots, "slots": slots, "loads": loads,
                "layers": LAYERS, "page": PAGE, "blocks": BLOCKS,
                "want": str(tmp_path / "want.bin")}
        out = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(CHILD.parent), *sys.path])})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "bit-exact" in out.stdout
    finally:
        a.close()
        os.kill(pid, signal.SIGKILL)
