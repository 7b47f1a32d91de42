"""Host time to enqueue one copy job on the CUDA path (``handler.start``), GPU idle vs busy.

Every synchronous hit enqueues its load on vLLM's engine thread inside ``schedule()``, and every
store is enqueued before a forward, so this host time sits on a request's path; for a one-block
hit it decides whether loading beats recomputing. It is all CUDA API calls and a little numpy
(events, a pinned upload of the engine block ids, the kernel launch, the DMA requests), and
CUDA API calls get slower while the device is executing work. So each case is timed with the
GPU idle (synchronised before) and busy (a queue of bf16 matmuls on the current stream, as when
the previous step's forward still runs), in the same run; the ratio is the figure. Also timed:
the two primitives the job issues most, a pinned upload of 8 bytes and an event record.

Cases: loads (the one-launch path these small jobs take) and stores of 1, 8 and 125 blocks (125 = a 2,000-token
prompt) of the Llama-3.2-1B KV shape (16 layers, 8 KV heads, head dim 64, bf16, 16-token
blocks) and, with ``--shape 8b``, Llama-3.1-8B's; CPU slots contiguous or scattered
(``--scattered``: every block its own DMA).
Needs CUDA (and CuPy for the default page mover).

    python benchmarks/diagnostics/enqueue_cost.py [--shape 1b|8b] [--reps 40] [--scattered] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.transfer.cuda.handlers import CudaCpuToGpuHandler, CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.page_movers import _upload  # noqa: E402

SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128)}  # layers, KV heads, head dim
ENGINE_BLOCKS = 4096


def ms(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--scattered", action="store_true", help="random CPU slots, not a run")
    p.add_argument("--profile", action="store_true", help="cProfile the busy one-block load")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("enqueue_cost.py needs CUDA")
    dev = torch.device("cuda", 0)
    layers, heads, dim = SHAPES[a.shape]
    caches = {f"layers.{i}": torch.zeros((2, ENGINE_BLOCKS, 16, heads * dim),
                                         dtype=torch.bfloat16, device=dev)
              for i in range(layers)}
    view = GpuKvView(caches, layout="kv_first")
    pool = CpuBlockPool(view.geometry(1), num_slots=ENGINE_BLOCKS)
    pool.wait_ready()
    handlers = {"load": CudaCpuToGpuHandler(view, pool),  # one launch (one_launch.py)
                "store": CudaGpuToCpuHandler(view, pool)}
    mat = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rng = random.Random(0)
    print(f"{torch.cuda.get_device_name(dev)}, {a.shape} shape, "
          f"{'scattered' if a.scattered else 'contiguous'} CPU slots, median of {a.reps}\n")
    print("| job | blocks | idle ms | busy ms | busy / idle | busy: 8-byte pinned upload ms "
          "| busy: event record ms |\n|---|---|---|---|---|---|---|")
    for blocks in (1, 8, 125):
        for kind, h in handlers.items():
            res = {}
            prof = cProfile.Profile()
            for cond in ("idle", "busy"):
                times, upload, event = [], [], []
                for rep in range(a.reps):
                    torch.cuda.synchronize()
                    if cond == "busy":
                        for _ in range(20):  # ~30 ms of matmuls queued ahead
                            mat @ mat
                    ids = rng.sample(range(1, ENGINE_BLOCKS), blocks)
                    first = rng.randrange(ENGINE_BLOCKS - blocks)
                    slots = (rng.sample(range(ENGINE_BLOCKS), blocks) if a.scattered
                             else list(range(first, first + blocks)))
                    upload.append(ms(lambda: _upload(np.asarray(ids, dtype=np.int64), dev))[0])
                    event.append(ms(lambda: torch.cuda.Event(enable_timing=True).record())[0])
                    gpu, cpu = LoadStoreSpec.gpu(ids), LoadStoreSpec.cpu(slots)
                    src, dst = (cpu, gpu) if kind.startswith("load") else (gpu, cpu)
                    profiled = a.profile and cond == "busy" and blocks == 1 and kind == "load"
                    if profiled:
                        prof.enable()
                    dt, pending = ms(lambda: h.start(src, dst))
                    if profiled:
                        prof.disable()
                    times.append(dt)
                    h.finish(pending)
                res[cond] = (statistics.median(times), statistics.median(upload),
                             statistics.median(event))
            idle, busy = res["idle"][0], res["busy"][0]
            print(f"| {kind} | {blocks} | {idle:.3f} | {busy:.3f} | {busy / idle:.2f}x | "
                  f"{res['busy'][1]:.3f} | {res['busy'][2]:.3f} |")
            if a.profile and blocks == 1 and kind == "load":
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
                print("\n```\n" + s.getvalue().strip()[-2500:] + "\n```\n")


if __name__ == "__main__":
    main()
