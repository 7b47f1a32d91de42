"""Does the CPU pool's background pinning slow vLLM's start-up work on the GPU? (CUDA only)

Why: kvtier's CPU pool is allocated and page-locked by a background thread while vLLM starts
(``kvtier/tiers/cpu_pool.py``), so its constructor returns after the first chunk. Page-locking (``cudaHostAlloc``
for a private pool, ``cudaHostRegister`` for the shared one the I/O children map) takes the
CUDA driver for as long as it touches the pages; vLLM meanwhile profiles the model and captures
its CUDA graphs, which are driver calls too. If they wait on each other, kvtier's engine starts
later than native's although nothing waits on the pool itself.

This times what vLLM does at start-up in miniature (allocate activations, capture one CUDA
graph per batch size of a stack of layers, replay each once) alone, then again while a real
``CpuBlockPool`` of ``--pool-gib`` allocates in the background (private pinned, then shared +
registered), and reports each as a ratio to the alone run of the same process. Row
``on_start``: the pool as kvtier's vLLM worker builds it (``fill="on_start"``), the capture
before ``start_filling()`` as in vLLM, so its ratio should be ~1. Rows ``stall``: how long one
small CUDA call (a kernel launch and a stream sync, as the engine makes every step) takes while
the pool fills after start-up, per chunk size (``--stall-chunk-mib``): a chunk is one
page-locking call, the longest the driver can be held at a time.

    python benchmarks/diagnostics/pin_contention.py [--pool-gib 16] [--graphs 67]
        [--chunk-mib 256] [--stall-chunk-mib 1024,256,64]
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


def host_cache_emptier():
    """torch's call that frees its cached pinned blocks, or None (older torch)."""
    import torch

    return (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            or getattr(torch._C, "_host_emptyCache", None))


def make_pool(pool_gib: int, chunk_mib: int, *, shared: bool = False, fill: str = "now"):
    """A real pinned pool of Llama-8B blocks (2 MiB). torch's pinned-block cache is emptied
    first: the blocks of a pool freed earlier in this process would otherwise be reused, and
    nothing would be pinned."""
    from kvtier.tiers.cpu_pool import CpuBlockPool
    from kvtier.tiers.layout import BlockGeometry

    empty = host_cache_emptier()
    if empty is not None:
        empty()
    geometry = BlockGeometry(num_layers=32, kv_parts=2, engine_blocks_per_block=1,
                             page_bytes=32 << 10)
    return CpuBlockPool(geometry, (pool_gib << 30) // geometry.block_bytes, pin=True,
                        shared=shared, chunk_bytes=chunk_mib << 20, fill=fill)


def pool_during(pool_gib: int, chunk_mib: int, shared: bool, graphs: int, layers: int,
                width: int) -> dict:
    t0 = time.perf_counter()
    pool = make_pool(pool_gib, chunk_mib, shared=shared)
    work = capture_work(graphs, layers, width)
    pool.wait_ready()
    return {"capture_s": work, "pool_ready_s": time.perf_counter() - t0}


def pool_on_start(pool_gib: int, chunk_mib: int, graphs: int, layers: int, width: int) -> dict:
    """kvtier's vLLM worker: the capture runs before the filling starts."""
    t0 = time.perf_counter()
    pool = make_pool(pool_gib, chunk_mib, fill="on_start")
    built = time.perf_counter() - t0
    work = capture_work(graphs, layers, width)
    t1 = time.perf_counter()
    pool.start_filling("start-up over")
    pool.wait_ready()
    return {"constructor_s": built, "capture_s": work,
            "pool_ready_after_start_s": time.perf_counter() - t1}


def probe_ms(seconds: float | None = None, pool=None) -> list[float]:
    """Milliseconds of each small CUDA call (a kernel launch, then a sync), for ``seconds``
    or until ``pool`` is ready."""
    import torch

    x = torch.zeros(1024, device="cuda")
    out: list[float] = []
    end = time.perf_counter() + (seconds or 0.0)

    def going() -> bool:
        return not pool.wait_ready(0) if pool is not None else time.perf_counter() < end

    while going():
        t = time.perf_counter()
        x.add_(1)
        torch.cuda.current_stream().synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    if not ms:
        return {"calls": 0}
    return {"calls": len(ms), "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))], "max_ms": ms[-1]}


def stall_while_filling(pool_gib: int, chunk_mib: int) -> dict:
    pool = make_pool(pool_gib, chunk_mib, fill="on_start")
    t0 = time.perf_counter()
    pool.start_filling("start-up over")
    row = summary(probe_ms(pool=pool))
    row["pool_ready_s"] = time.perf_counter() - t0
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool-gib", type=int, default=16)
    p.add_argument("--graphs", type=int, default=67, help="CUDA graphs captured (vLLM: ~67)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="pool chunk size of the capture rows (default: the pool's default)")
    p.add_argument("--stall-chunk-mib", default="1024,256,64",
                   help="chunk sizes of the stall rows, comma-separated ('' for none)")
    a = p.parse_args()
    try:
        stall_chunks = [int(c) for c in a.stall_chunk_mib.split(",") if c.strip()]
    except ValueError:
        print(f"pin_contention: error: --stall-chunk-mib {a.stall_chunk_mib!r} is not a "
              "comma-separated list of MiB", file=sys.stderr)
        return 2
    if a.pool_gib <= 0 or (a.chunk_mib is not None and a.chunk_mib <= 0) or \
            any(c <= 0 for c in stall_chunks):
        print("pin_contention: error: --pool-gib and chunk sizes must be > 0", file=sys.stderr)
        return 2
    import torch

    from kvtier.tiers.cpu_pool import DEFAULT_CHUNK_BYTES

    chunk_mib = a.chunk_mib or DEFAULT_CHUNK_BYTES >> 20

    if not torch.cuda.is_available():
        print("pin_contention: error: needs a CUDA device", file=sys.stderr)
        return 2
    capture_work(4, a.layers, a.width)  # context, cuBLAS handles, kernels loaded
    alone = capture_work(a.graphs, a.layers, a.width)
    out = {"gpu": torch.cuda.get_device_name(0), "pool_gib": a.pool_gib, "graphs": a.graphs,
           "chunk_mib": chunk_mib, "host_cache_emptied": host_cache_emptier() is not None,
           "alone_s": alone}
    for shared in (False, True):
        row = pool_during(a.pool_gib, chunk_mib, shared, a.graphs, a.layers, a.width)
        row["capture_vs_alone"] = row["capture_s"] / alone
        out["shared" if shared else "private"] = row
    row = pool_on_start(a.pool_gib, chunk_mib, a.graphs, a.layers, a.width)
    row["capture_vs_alone"] = row["capture_s"] / alone
    out["on_start"] = row
    out["alone_again_s"] = capture_work(a.graphs, a.layers, a.width)
    if stall_chunks:
        out["probe_alone"] = summary(probe_ms(seconds=2.0))
        out["stall"] = {str(c): stall_while_filling(a.pool_gib, c) for c in stall_chunks}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
