"""How much kvtier's stores slow the model's compute beside them: copy kernel vs batched DMA.

Why: past saturation vLLM's steps were slower with kvtier than with vLLM's native offloading,
whose stores ride the copy engines (issue 46). kvtier's default store gathers pages with an
SM kernel (``store_copy: kernel``) on a stream of higher priority than the compute stream;
``store_copy: dma`` enqueues the whole store as one ``cuMemcpyBatchAsync`` (copy engines
only). Both are the store handlers vLLM's worker runs (``CudaGpuToCpuHandler``).

What runs, as in a serving engine: a loop of bf16 matmuls on the compute stream (a forward's
work) and, after each, a store of ``--store-blocks`` engine blocks the matmul "wrote" (the
store waits for it on the GPU and runs beside the next one). Measured per configuration, in
one process on one GPU: the compute's time (CUDA events on the compute stream) alone, beside
kernel stores, beside DMA stores; and the stores' bandwidth. Ratios against the run's own
compute-alone time; nothing is asserted.

    python benchmarks/store_interference.py               # the 1B shape's blocks, 16 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.transfer.cuda import CudaGpuToCpuHandler  # noqa: E402

# (layers, kv heads, head dim): Llama-3.2-1B and Llama-3.1-8B
SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128)}


def kv_view(shape: str, block_tokens: int, blocks: int, device: torch.device) -> GpuKvView:
    layers, heads, dim = SHAPES[shape]
    caches = {f"model.layers.{i}.self_attn": torch.zeros(
        (2, blocks, block_tokens, heads, dim), dtype=torch.bfloat16, device=device)
        for i in range(layers)}
    return GpuKvView(caches)


def compute_loop(a: torch.Tensor, b: torch.Tensor, rounds: int, after=None) -> float:
    """``rounds`` matmuls on the current stream, ``after(i)`` enqueued after each; returns
    the compute stream's milliseconds from the first to the last."""
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for i in range(rounds):
        torch.matmul(a, b)
        if after is not None:
            after(i)
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def run(a) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    view = kv_view(a.shape, a.block_tokens, a.engine_blocks, dev)
    geo = view.geometry(1)
    pool = CpuBlockPool(geo, num_slots=a.slots, pin=True)
    pool.wait_ready()
    handlers = {name: CudaGpuToCpuHandler(view, pool, store_copy=name)
                for name in ("kernel", "dma")}
    kinds = {name: type(h.copier).__name__ for name, h in handlers.items()}
    m = torch.randn(a.matmul, a.matmul, dtype=torch.bfloat16, device=dev)
    n = torch.randn(a.matmul, a.matmul, dtype=torch.bfloat16, device=dev)
    g = torch.Generator().manual_seed(0)
    out: dict = {"gpu": torch.cuda.get_device_name(dev), "args": vars(a), "copiers": kinds,
                 "block_bytes": geo.block_bytes, "rounds": []}

    def stores(handler):
        pending: list = []
        nbytes = [0]

        def after(i: int) -> None:
            ids = torch.randperm(a.engine_blocks, generator=g)[:a.store_blocks].tolist()
            first = (i * a.store_blocks) % (a.slots - a.store_blocks)
            slots = list(range(first, first + a.store_blocks))
            pending.append(handler.start(LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(slots)))
            nbytes[0] += a.store_blocks * geo.block_bytes
        return after, pending, nbytes

    compute_loop(m, n, 3)  # warm-up: cuBLAS, the kernels' compilation
    for name, h in handlers.items():
        after, pending, _ = stores(h)
        compute_loop(m, n, 2, after)
        for p in pending:
            h.finish(p)
    for r in range(a.repeats):
        row = {"alone_ms": compute_loop(m, n, a.rounds)}
        for name, h in handlers.items():
            after, pending, nbytes = stores(h)
            t0 = time.perf_counter()
            row[f"{name}_ms"] = compute_loop(m, n, a.rounds, after)
            copy_s = sum(h.finish(p).seconds for p in pending)
            row[f"{name}_wall_ms"] = (time.perf_counter() - t0) * 1e3
            row[f"{name}_store_gbps"] = nbytes[0] / copy_s / 1e9 if copy_s else 0.0
            row[f"{name}_store_device_ms"] = copy_s * 1e3
        out["rounds"].append(row)
        print(json.dumps(row), flush=True)
    med = {k: statistics.median(r[k] for r in out["rounds"]) for k in out["rounds"][0]}
    out["median"] = med
    return out


def report(out: dict) -> str:
    med, a = out["median"], out["args"]
    lines = [f"# Stores beside compute: copy kernel vs batched DMA — {out['gpu']}", "",
             f"`python benchmarks/store_interference.py --shape {a['shape']} --block-tokens "
             f"{a['block_tokens']} --store-blocks {a['store_blocks']} --matmul {a['matmul']} "
             f"--rounds {a['rounds']} --repeats {a['repeats']}`", "",
             f"{a['rounds']} bf16 {a['matmul']}^3 matmuls on the compute stream, a store of "
             f"{a['store_blocks']} blocks ({a['store_blocks'] * out['block_bytes'] / 2**20:.0f}"
             f" MiB) after each (copiers: {out['copiers']}); medians of {a['repeats']}.", "",
             "| stores | compute ms | vs alone | store device ms | store GB/s |",
             "|---|---|---|---|---|",
             f"| none | {med['alone_ms']:.1f} | 1.00x | | |"]
    for name in ("kernel", "dma"):
        lines.append(f"| {name} | {med[name + '_ms']:.1f} | "
                     f"{med[name + '_ms'] / med['alone_ms']:.2f}x | "
                     f"{med[name + '_store_device_ms']:.1f} | {med[name + '_store_gbps']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--engine-blocks", type=int, default=4096)
    p.add_argument("--slots", type=int, default=2048)
    p.add_argument("--store-blocks", type=int, default=64, help="blocks per store job")
    p.add_argument("--matmul", type=int, default=8192, help="matmul size (n x n x n)")
    p.add_argument("--rounds", type=int, default=40, help="matmuls (and stores) per run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=None, help="write store_interference_<gpu>.md/.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.store_blocks * 2 > a.slots or a.store_blocks > a.engine_blocks:
        p.error("--store-blocks must fit twice in --slots and once in --engine-blocks")
    out = run(a)
    text = report(out)
    print(text)
    if a.out_dir:
        os.makedirs(a.out_dir, exist_ok=True)
        base = os.path.join(a.out_dir, "store_interference_" + out["gpu"].replace(" ", "-"))
        with open(base + ".json", "w") as f:
            json.dump(out, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
