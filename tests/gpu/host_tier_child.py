"""Instance B of test_cuda_host_tier.py: its own connection, mapping and page-locking of the
host's pool; loads instance A's slots into its own GPU blocks and checks them bit for bit."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from test_cuda_transfer import (DEV, assert_untouched, load_handler, make_caches,  # noqa: E402
                                reference_slots, run, scrambled_destination)
from kvtier.manager.specs import LoadStoreSpec
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.host import HostAddress, HostClient


def main(spec: dict) -> int:
    blocks = spec["blocks"]
    gen = torch.Generator(device=DEV).manual_seed(97)  # other bytes than A's
    view = GpuKvView(make_caches("kv_first", spec["layers"], 2 * blocks + 8, spec["page"],
                                 torch.bfloat16, gen), layout="kv_first")
    geo = view.geometry(1)
    address = HostAddress(Path(spec["socket_dir"]), spec["fingerprint"], spec["total_slots"])
    b = HostClient.connect(address, "b", start=False)
    try:
        b.register(blocks)
        pool = CpuBlockPool(geo, b.total_slots, pool_fd=b.attach(0, geo.block_bytes))
        pool.wait_ready()
        dst, before = scrambled_destination(view, list(range(blocks)), 2 * blocks + 8,
                                            random.Random(3), gen)
        run(load_handler(view, pool, spec["loads"]).run(LoadStoreSpec.cpu(spec["slots"]),
                                                        LoadStoreSpec.gpu(dst)))
        torch.cuda.synchronize()
        want = torch.from_numpy(np.fromfile(spec["want"], dtype=np.uint8))  # raw bytes
        got = reference_slots(view, dst, 1).cpu().contiguous().view(torch.uint8).flatten()
        assert torch.equal(got, want)
        assert_untouched(view, before)
    finally:
        b.close()
    print("bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
