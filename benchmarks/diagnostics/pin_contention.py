"""Does the CPU pool's background pinning slow vLLM's start-up work on the GPU? (CUDA only)

Why: kvtier's CPU pool is allocated and page-locked by a background thread while vLLM starts
(``kvtier/tiers/cpu_pool.py``), so start-up returns at once. Page-locking (``cudaHostAlloc``
for a private pool, ``cudaHostRegister`` for the shared one the I/O children map) takes the
CUDA driver for as long as it touches the pages; vLLM meanwhile profiles the model and captures
its CUDA graphs, which are driver calls too. If they wait on each other, kvtier's engine starts
later than native's although nothing waits on the pool itself.

This times what vLLM does at start-up in miniature (allocate activations, capture one CUDA
graph per batch size of a stack of layers, replay each once) alone, then again while a real
``CpuBlockPool`` of ``--pool-gib`` allocates in the background (private pinned, then shared +
registered), and reports each as a ratio to the alone run of the same process.

    python benchmarks/diagnostics/pin_contention.py [--pool-gib 16] [--graphs 67]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def capture_work(graphs: int, layers: int, width: int) -> float:
    """Seconds to build and capture ``graphs`` CUDA graphs of a layer stack, and replay them."""
    import torch

    t0 = time.perf_counter()
    stack = [torch.nn.Linear(width, width, device="cuda", dtype=torch.bfloat16)
             for _ in range(layers)]
    pool = torch.cuda.graph_pool_handle()
    kept = []
    for n in range(1, graphs + 1):
        x = torch.randn(n * 8, width, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as vLLM does
            y = x
            for layer in stack:
                y = layer(y)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = x
            for layer in stack:
                y = layer(y)
        g.replay()
        kept.append((g, x, y))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def pool_during(pool_gib: int, shared: bool, graphs: int, layers: int, width: int) -> dict:
    from kvtier.tiers.cpu_pool import CpuBlockPool
    from kvtier.tiers.layout import BlockGeometry

    geometry = BlockGeometry(num_layers=32, kv_parts=2, engine_blocks_per_block=1,
                             page_bytes=32 << 10)  # the Llama-8B block: 2 MiB
    t0 = time.perf_counter()
    pool = CpuBlockPool(geometry, (pool_gib << 30) // geometry.block_bytes, pin=True,
                        shared=shared)
    work = capture_work(graphs, layers, width)
    pool.wait_ready()
    return {"capture_s": work, "pool_ready_s": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool-gib", type=int, default=16)
    p.add_argument("--graphs", type=int, default=67, help="CUDA graphs captured (vLLM: ~67)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("pin_contention: error: needs a CUDA device", file=sys.stderr)
        return 2
    capture_work(4, a.layers, a.width)  # context, cuBLAS handles, kernels loaded
    alone = capture_work(a.graphs, a.layers, a.width)
    out = {"gpu": torch.cuda.get_device_name(0), "pool_gib": a.pool_gib, "graphs": a.graphs,
           "alone_s": alone}
    for shared in (False, True):
        row = pool_during(a.pool_gib, shared, a.graphs, a.layers, a.width)
        row["capture_vs_alone"] = row["capture_s"] / alone
        out["shared" if shared else "private"] = row
    out["alone_again_s"] = capture_work(a.graphs, a.layers, a.width)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
