"""A shared-tier hit on a real GPU, as the connector moves it: first its promotion, REMOTE ->
CPU (the I/O processes, a real Valkey), one job, then its load, CPU -> GPU (the CUDA handler),
one job reading the slots the promotion filled. The engine's blocks must land bit-exact in
every load mode, nothing else may be written, and the load must copy each block once.

Skipped without CUDA (CI); run on the lent GPU machine.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_cuda_transfer import (DEV, assert_untouched, load_handler,  # noqa: E402
                                    make_caches, reference_slots, run, scrambled_destination)
from kvtier.config import load_config  # noqa: E402
from kvtier.manager.specs import LoadStoreSpec, Medium  # noqa: E402
from kvtier.tiers.remote.io.process import RemoteIOProcesses  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.tiers.remote.wire.connect import remote_keys  # noqa: E402
from kvtier.tiers.remote.secrets import RemoteSecrets  # noqa: E402
from kvtier.transfer.cuda import CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.page_movers import cupy_available  # noqa: E402
from kvtier.transfer.engine import TransferEngine  # noqa: E402
from kvtier.transfer.remote_io import RemoteToCpuHandler  # noqa: E402
from support.valkey_fixtures import valkey  # noqa: E402,F401 - a pytest fixture

BLOCKS = 128  # 256 KiB each: several of an I/O process's hash batches, so it reports early


def _finished(engine, timeout_s: float = 60.0) -> list:
    results, deadline = [], time.monotonic() + timeout_s
    while not results:
        results = engine.get_finished()
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    return results


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("loads", ["rule", "layered", "staged"])
def test_a_shared_tier_hit_promoted_then_loaded_lands_bit_exact(tmp_path, valkey, loads,
                                                                 whole):
    import random

    if loads != "staged" and not cupy_available():
        pytest.skip("layered loads need CuPy")
    gen = torch.Generator(device=DEV).manual_seed(53)
    view = GpuKvView(make_caches("kv_first", 4, 2 * BLOCKS + 8, 32 << 10, torch.bfloat16, gen),
                     layout="kv_first")
    geo = view.geometry(1)
    pool = CpuBlockPool(geo, num_slots=2 * BLOCKS, shared=True)
    pool.wait_ready()
    src_ids = list(range(BLOCKS))
    want = reference_slots(view, src_ids, 1)
    run(CudaGpuToCpuHandler(view, pool).run(LoadStoreSpec.gpu(src_ids),
                                            LoadStoreSpec.cpu(range(BLOCKS))))
    cfg = load_config(data={"tiers": {"remote": {"url": valkey().url, "io_processes": 1}}},
                      env={}).remote
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg))
    starts = []
    handler = load_handler(view, pool, loads)
    real_start = handler.start

    def counted(src, dst):
        starts.append(len(src.ids))
        return real_start(src, dst)

    handler.start = counted
    try:
        keys = [b"gpu-remote-%d" % i for i in range(BLOCKS)]
        assert io.put_slots(list(range(BLOCKS)), keys) == [True] * BLOCKS
        slots = list(range(BLOCKS, 2 * BLOCKS))
        for s in slots:
            pool.slot(s).zero_()
        dst, before = scrambled_destination(view, src_ids, 2 * BLOCKS + 8, random.Random(5), gen)
        with TransferEngine([handler, RemoteToCpuHandler(pool, io)]) as engine:
            promotion = engine.submit(LoadStoreSpec.remote(keys), LoadStoreSpec.cpu(slots))
            (p,) = _finished(engine)  # as vLLM's worker does: a get_finished per engine step
            assert p.job_id == promotion and p.ok, p.error
            assert p.failed_keys == () and p.direction == (Medium.REMOTE, Medium.CPU)
            assert starts == []  # the promotion never touched the GPU
            assert all(torch.equal(pool.slot(s), pool.slot(i)) for i, s in enumerate(slots))
            load = engine.submit(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(dst, whole))
            (r,) = _finished(engine)
        assert r.job_id == load and r.ok, r.error
        torch.cuda.synchronize()
        assert torch.equal(reference_slots(view, dst, 1), want)
        assert_untouched(view, before)
        assert sum(starts) == BLOCKS, starts  # each block copied once
    finally:
        io.close()
