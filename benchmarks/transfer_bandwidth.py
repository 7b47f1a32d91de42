"""GPU <-> pinned CPU bandwidth of kvtier's CUDA path against the usual ways to copy KV pages.

For each page size (Llama-3.1-8B's 32 KiB pages, plus 8 KiB and 2 MiB) a set of scattered
blocks across all layers (~2 GiB) is moved GPU->CPU, CPU->GPU, and both at once, by:

* ``big copy``      one contiguous pinned copy of the same bytes (the link's limit),
* ``memcpy loop``   one ``cudaMemcpyAsync`` per page (vLLM ``swap_blocks`` style, from Python),
* ``batch``         ``cuMemcpyBatchAsync`` with one descriptor per page (driver API, ctypes),
* ``kvtier``        kvtier's handlers (gather kernel + staging ring + bulk DMA), driven through
                    their asyncio ``run`` like the transfer engine does.

Then the slowdown of a loop of bf16 matmuls (a CUDA graph, so launches don't matter) while each
method copies in a loop beside it. Prints markdown tables and writes them to
``<out-dir>/transfer_bandwidth_<device>.md``. Needs CUDA; run on the GPU machine.

    python benchmarks/transfer_bandwidth.py [--out-dir benchmarks/results] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.tiers.layout import BlockGeometry  # noqa: E402
from kvtier.transfer.cuda import CudaCpuToGpuHandler, CudaGpuToCpuHandler  # noqa: E402
from kvtier.transfer.cuda.plan import LayerAddressing  # noqa: E402

DEV = torch.device("cuda", 0)
GB = 1e9


@dataclass
class Config:
    name: str
    page_bytes: int
    moved_blocks: int
    engine_blocks: int
    layers: int = 32


CONFIGS = [
    Config("Llama-3.1-8B, 32 KiB pages (16 tok x 8 heads x 128 x bf16)", 32 << 10, 1024, 4096),
    Config("8 KiB pages", 8 << 10, 4096, 8192),
    Config("2 MiB pages", 2 << 20, 16, 40),
]


# --------------------------------------------------------------------------------------------
# baselines


class BatchCopy:
    """``cuMemcpyBatchAsync`` through ctypes (CUDA 13 ``_v2`` entry point, else the 12.8 one)."""

    class Attr(ctypes.Structure):
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int),
                    ("srcLocId", ctypes.c_int), ("dstLocType", ctypes.c_int),
                    ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]

    def __init__(self) -> None:
        self.error = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            self.error = f"libcuda not loadable: {exc}"
            return
        self.fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        self.v2 = self.fn is not None
        if self.fn is None:
            self.fn = getattr(lib, "cuMemcpyBatchAsync", None)
        if self.fn is None:
            self.error = "driver has no cuMemcpyBatchAsync"
            return
        self.attr = self.Attr(1, 0, 0, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self.attr_idx = (ctypes.c_size_t * 1)(0)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                 stream: torch.cuda.Stream, max_batch: int = 65536) -> None:
        for i in range(0, len(dsts), max_batch):
            d, s, n = (np.ascontiguousarray(a[i:i + max_batch], dtype=np.uint64)
                       for a in (dsts, srcs, sizes))
            args = [d.ctypes.data_as(ctypes.c_void_p), s.ctypes.data_as(ctypes.c_void_p),
                    n.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(len(d)),
                    ctypes.byref(self.attr), self.attr_idx, ctypes.c_size_t(1)]
            if not self.v2:
                fail = ctypes.c_size_t(0)
                args.append(ctypes.byref(fail))
            args.append(ctypes.c_void_p(stream.cuda_stream))
            rc = self.fn(*args)
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync returned CUresult {rc}")


def memcpy_loop(dsts, srcs, size, stream) -> None:
    import cupy

    memcpy, kind, h = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDefault, stream.cuda_stream
    for d, s in zip(dsts.tolist(), srcs.tolist()):
        memcpy(d, s, size, kind, h)


# --------------------------------------------------------------------------------------------
# one configuration


class Bench:
    def __init__(self, cfg: Config, seed: int = 0) -> None:
        self.cfg = cfg
        rng = random.Random(seed)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        heads_dim = cfg.page_bytes // 2  # bf16 elements per page
        self.caches = {
            f"layers.{i}": torch.randint(0, 256, (2, cfg.engine_blocks, cfg.page_bytes),
                                         dtype=torch.uint8, device=DEV, generator=gen)
            .view(torch.bfloat16).view(2, cfg.engine_blocks, 16, heads_dim // 16)
            for i in range(cfg.layers)
        }
        self.view = GpuKvView(self.caches, layout="kv_first")
        self.geo = self.view.geometry(1)
        n = cfg.moved_blocks
        self.pool = CpuBlockPool(self.geo, num_slots=2 * n)
        self.pool.wait_ready()
        self.nbytes = n * self.geo.block_bytes
        perm = rng.sample(range(cfg.engine_blocks), 2 * n)
        self.ids_a, self.ids_b = perm[:n], perm[n:]  # store set, load set (disjoint)
        self.slots_a, self.slots_b = list(range(n)), list(range(n, 2 * n))
        self.store = CudaGpuToCpuHandler(self.view, self.pool)
        self.load = CudaCpuToGpuHandler(self.view, self.pool)
        self.loop = asyncio.new_event_loop()
        # big-copy buffers
        self.dev_big = [torch.empty(self.nbytes, dtype=torch.uint8, device=DEV) for _ in range(2)]
        self.host_big = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
                         for _ in range(2)]
        self.s1, self.s2 = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
        # per-page descriptors for the loop and batch baselines
        addr = LayerAddressing.of(self.view)
        page = cfg.page_bytes
        per_slot = self.geo.block_bytes // page
        self.gpu_a = addr.page_table(np.asarray(self.ids_a), 1).astype(np.uint64)
        self.gpu_b = addr.page_table(np.asarray(self.ids_b), 1).astype(np.uint64)
        offs = np.arange(per_slot, dtype=np.uint64) * np.uint64(page)
        self.host_a = (np.asarray([self.pool.slot(s).data_ptr() for s in self.slots_a],
                                  dtype=np.uint64)[:, None] + offs[None, :]).reshape(-1)
        self.host_b = (np.asarray([self.pool.slot(s).data_ptr() for s in self.slots_b],
                                  dtype=np.uint64)[:, None] + offs[None, :]).reshape(-1)
        self.sizes = np.full(len(self.gpu_a), page, dtype=np.uint64)
        self.batch = BatchCopy()

    # each method: fn(direction) enqueues or runs one full transfer; returns when done
    def big(self, d2h: bool, h2d: bool) -> None:
        if d2h:
            with torch.cuda.stream(self.s1):
                self.host_big[0].copy_(self.dev_big[0], non_blocking=True)
        if h2d:
            with torch.cuda.stream(self.s2):
                self.dev_big[1].copy_(self.host_big[1], non_blocking=True)
        self.s1.synchronize()
        self.s2.synchronize()

    def loop_copy(self, d2h: bool, h2d: bool) -> None:
        # one thread per direction so both directions are fed at once
        ts = []
        if d2h:
            ts.append(threading.Thread(target=memcpy_loop,
                                       args=(self.host_a, self.gpu_a, self.cfg.page_bytes, self.s1)))
        if h2d:
            ts.append(threading.Thread(target=memcpy_loop,
                                       args=(self.gpu_b, self.host_b, self.cfg.page_bytes, self.s2)))
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.s1.synchronize()
        self.s2.synchronize()

    def batch_copy(self, d2h: bool, h2d: bool) -> None:
        if d2h:
            self.batch(self.host_a, self.gpu_a, self.sizes, self.s1)
        if h2d:
            self.batch(self.gpu_b, self.host_b, self.sizes, self.s2)
        self.s1.synchronize()
        self.s2.synchronize()

    def kvtier(self, d2h: bool, h2d: bool) -> None:
        coros = []
        if d2h:
            coros.append(self.store.run(LoadStoreSpec.gpu(self.ids_a),
                                        LoadStoreSpec.cpu(self.slots_a)))
        if h2d:
            coros.append(self.load.run(LoadStoreSpec.cpu(self.slots_b),
                                       LoadStoreSpec.gpu(self.ids_b)))

        async def both():
            await asyncio.gather(*coros)

        self.loop.run_until_complete(both())

    def kvtier_jobs(self, d2h: bool, h2d: bool, jobs: int = 8) -> None:
        """The same blocks as ``jobs`` smaller jobs in flight at once (how serving traffic
        arrives: one job per request); host set-up of one overlaps the copies of another."""
        n = len(self.slots_a)
        step = -(-n // jobs)
        coros = []
        for j in range(0, n, step):
            if d2h:
                coros.append(self.store.run(LoadStoreSpec.gpu(self.ids_a[j:j + step]),
                                            LoadStoreSpec.cpu(self.slots_a[j:j + step])))
            if h2d:
                coros.append(self.load.run(LoadStoreSpec.cpu(self.slots_b[j:j + step]),
                                           LoadStoreSpec.gpu(self.ids_b[j:j + step])))

        async def all_jobs():
            await asyncio.gather(*coros)

        self.loop.run_until_complete(all_jobs())

    def check_kvtier(self) -> str:
        """Bytes moved by kvtier equal a torch-indexing reference (a sample of blocks)."""
        self.kvtier(True, False)
        for i in random.Random(1).sample(range(len(self.ids_a)), 8):
            b = self.ids_a[i]
            want = torch.stack([layer.pages[:, b] for layer in self.view.layers]).reshape(-1).cpu()
            if not torch.equal(self.pool.slot(self.slots_a[i]), want):
                return "STORE MISMATCH"
        self.kvtier(False, True)
        for i in random.Random(2).sample(range(len(self.ids_b)), 8):
            got = torch.stack([layer.pages[:, self.ids_b[i]] for layer in self.view.layers])
            if not torch.equal(got.reshape(-1).cpu(), self.pool.slot(self.slots_b[i])):
                return "LOAD MISMATCH"
        return "ok"

    def time(self, fn, d2h: bool, h2d: bool, reps: int) -> float:
        fn(d2h, h2d)  # warm-up
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(d2h, h2d)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def close(self) -> None:
        self.store.close(wait=True)
        self.load.close(wait=True)
        self.loop.close()


def bandwidth_table(bench: Bench, quick: bool) -> tuple[str, dict]:
    methods = [("one big pinned copy (limit)", bench.big, 5),
               ("per-page cudaMemcpyAsync loop", bench.loop_copy, 1),
               ("cuMemcpyBatchAsync, one descriptor per page", bench.batch_copy, 2),
               ("kvtier (gather + staging ring + bulk DMA), one job", bench.kvtier, 5),
               ("kvtier, same blocks as 8 jobs in flight", bench.kvtier_jobs, 5)]
    if quick:
        methods = [(n, f, 1) for n, f, _ in methods]
    rows, res = [], {}
    for name, fn, reps in methods:
        cells = []
        for d2h, h2d in ((True, False), (False, True), (True, True)):
            try:
                t = bench.time(fn, d2h, h2d, reps)
                gbps = bench.nbytes * (int(d2h) + int(h2d)) / t / GB
                res[(name, d2h, h2d)] = gbps
                cells.append(f"{gbps:.1f}")
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                cells.append(f"unavailable ({type(exc).__name__}: {str(exc)[:60]})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    big = {k[1:]: v for k, v in res.items() if k[0].startswith("one big")}
    for label, prefix in (("kvtier one job / big copy", "kvtier ("),
                          ("kvtier 8 jobs / big copy", "kvtier, same")):
        kv = {k[1:]: v for k, v in res.items() if k[0].startswith(prefix)}
        if big and kv:
            ratio = [f"{100 * kv[k] / big[k]:.0f} %" if k in kv and k in big else "-"
                     for k in ((True, False), (False, True), (True, True))]
            rows.append(f"| {label} | " + " | ".join(ratio) + " |")
    # where kvtier's time goes: host-side enqueue of one job vs. the whole job
    for label, copier, ids, slots in (("GPU->CPU", bench.store.copier, bench.ids_a, bench.slots_a),
                                      ("CPU->GPU", bench.load.copier, bench.ids_b, bench.slots_b)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        job = copier.enqueue(ids, slots)
        t1 = time.perf_counter()
        job.done.synchronize()
        t2 = time.perf_counter()
        rows.append(f"| kvtier {label}: host enqueue {1e3 * (t1 - t0):.1f} ms of "
                    f"{1e3 * (t2 - t0):.1f} ms (no asyncio) | | | |")
    head = ("| method | GPU->CPU GB/s | CPU->GPU GB/s | both at once, total GB/s |\n"
            "|---|---|---|---|")
    return head + "\n" + "\n".join(rows), res


class MatmulLoad:
    """``n_mm`` bf16 matmuls captured in a CUDA graph on their own stream (no launch gaps)."""

    def __init__(self, n_mm: int = 20, size: int = 8192) -> None:
        self.n_mm, self.size = n_mm, size
        a = torch.randn(size, size, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=DEV, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        self.stream = torch.cuda.Stream(DEV)
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                torch.mm(a, b, out=c)
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            for _ in range(n_mm):
                torch.mm(a, b, out=c)
        self._keep = (a, b, c)
        for _ in range(10):  # clocks up before anything is timed
            self.once()

    def once(self) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            e0.record()
            self.graph.replay()
            e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)

    def alone(self, reps: int = 3) -> float:
        return statistics.median(self.once() for _ in range(reps))

    def beside(self, bench: "Bench", fn, d2h: bool, h2d: bool) -> tuple[float, float, float]:
        """(matmul ms with ``fn`` copying in a loop beside it, matmul ms alone around it,
        copy GB/s meanwhile)."""
        before = self.alone()
        stop = threading.Event()
        moved = [0]
        err: list[BaseException] = []

        def copier():
            try:
                torch.cuda.set_device(DEV)  # driver-API baselines need the context current
                if getattr(fn, "__name__", "") == "kvtier":
                    bench.loop = asyncio.new_event_loop()  # asyncio loops are per thread
                while not stop.is_set():
                    fn(d2h, h2d)
                    moved[0] += bench.nbytes * (int(d2h) + int(h2d))
            except BaseException as exc:  # noqa: BLE001
                err.append(exc)

        t = threading.Thread(target=copier)
        t0 = time.perf_counter()
        t.start()
        time.sleep(0.05)
        ms = self.alone()
        stop.set()
        t.join()
        secs = time.perf_counter() - t0
        if err:
            raise err[0]
        after = self.alone()
        return ms, (before + after) / 2, moved[0] / secs / GB


def interference_table(bench: Bench, mm: MatmulLoad) -> str:
    rows = []
    methods = [("one big pinned copy", bench.big), ("per-page cudaMemcpyAsync loop", bench.loop_copy),
               ("cuMemcpyBatchAsync", bench.batch_copy), ("kvtier", bench.kvtier)]
    for name, fn in methods:
        for label, d2h, h2d in (("GPU->CPU", True, False), ("CPU->GPU", False, True),
                                ("both", True, True)):
            try:
                ms, base, gbps = mm.beside(bench, fn, d2h, h2d)
            except Exception as exc:  # noqa: BLE001
                rows.append(f"| {name} {label} | unavailable ({type(exc).__name__}: "
                            f"{str(exc)[:60]}) | - | - | - |")
                continue
            rows.append(f"| {name} {label} | {ms:.1f} | {base:.1f} | {ms / base:.2f} | "
                        f"{gbps:.1f} |")
    head = (f"| copy running beside {mm.n_mm} x {mm.size}^3 bf16 matmuls (CUDA graph) | "
            "matmul ms | alone ms (before/after) | slowdown | copy GB/s meanwhile |\n"
            "|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def sweep_table(bench: Bench, mm: MatmulLoad) -> str:
    """kvtier's staging size / ring depth / kernel grid, idle and beside the matmuls."""
    rows = []
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for staging_mib, ring, ctas in ((32, 4, 64), (32, 4, sms), (16, 4, 2 * sms),
                                    (32, 4, 2 * sms), (64, 3, 2 * sms), (32, 4, 4 * sms)):
        kw = dict(staging_bytes=staging_mib << 20, ring_slots=ring, max_ctas=ctas)
        bench.store.close()
        bench.load.close()
        bench.store = CudaGpuToCpuHandler(bench.view, bench.pool, **kw)
        bench.load = CudaCpuToGpuHandler(bench.view, bench.pool, **kw)
        bench.loop = asyncio.new_event_loop()
        idle = [bench.nbytes * (int(a) + int(b)) / bench.time(bench.kvtier, a, b, 3) / GB
                for a, b in ((True, False), (False, True), (True, True))]
        busy = []
        for a, b in ((True, False), (False, True)):
            ms, base, gbps = mm.beside(bench, bench.kvtier, a, b)
            busy += [f"{gbps:.1f}", f"{ms / base:.2f}"]
        rows.append(f"| {staging_mib} MiB x {ring}, {ctas} CTAs | "
                    + " | ".join(f"{x:.1f}" for x in idle) + " | " + " | ".join(busy) + " |")
    head = ("| kvtier staging x ring, kernel CTAs | GPU->CPU | CPU->GPU | both | GPU->CPU beside "
            "matmuls | matmul slowdown | CPU->GPU beside matmuls | matmul slowdown |\n"
            "|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def pool_startup(gib: int) -> str:
    """How long a pinned pool of ``gib`` GiB blocks start-up, and when it is fully pinned."""
    geo = BlockGeometry(num_layers=32, kv_parts=2, engine_blocks_per_block=1, page_bytes=32 << 10)
    t0 = time.perf_counter()
    pool = CpuBlockPool(geo, num_slots=(gib << 30) // geo.block_bytes)
    t1 = time.perf_counter()
    pool.wait_ready()
    t2 = time.perf_counter()
    text = (f"Pinned CPU pool of {gib} GiB (1 GiB chunks, torch pin_memory, background thread): "
            f"constructor returned after {t1 - t0:.2f} s (first chunk), fully pinned after "
            f"{t2 - t0:.2f} s ({gib * 2**30 / (t2 - t0) / GB:.1f} GB/s).")
    del pool
    return text


def device_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(DEV)).strip("-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true", help="one repetition, first config only")
    ap.add_argument("--no-interference", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep kvtier staging settings")
    ap.add_argument("--pool-gib", type=int, default=16, help="pinned pool start-up test (0: skip)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("transfer_bandwidth.py needs CUDA")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvtier").setLevel(logging.INFO)  # pool allocation progress
    name = torch.cuda.get_device_name(DEV)
    out = [f"# kvtier transfer bandwidth on {name}", "",
           f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; host<->device over PCIe; "
           "GB = 1e9 bytes; median of repetitions; times include kvtier's enqueue on the host.",
           ""]
    if args.pool_gib:
        out += [pool_startup(args.pool_gib), ""]
        print(out[-2], flush=True)
    if BatchCopy().error:
        out.append(f"cuMemcpyBatchAsync unavailable: {BatchCopy().error}\n")
    configs = CONFIGS[:1] if args.quick else CONFIGS
    for i, cfg in enumerate(configs):
        bench = Bench(cfg)
        check = bench.check_kvtier()
        gib = bench.nbytes / 2**30
        out.append(f"## {cfg.name}: {cfg.moved_blocks} scattered blocks x {cfg.layers} layers x "
                   f"K/V = {len(bench.gpu_a)} pages, {gib:.2f} GiB per direction "
                   f"(kvtier bytes check: {check})")
        out.append("")
        table, _ = bandwidth_table(bench, args.quick)
        out.append(table)
        out.append("")
        print("\n".join(out[-4:]), flush=True)
        if i == 0 and not args.no_interference:
            mm = MatmulLoad()
            out += [f"### Interference ({cfg.name})", "", interference_table(bench, mm), ""]
            print("\n".join(out[-3:]), flush=True)
            if args.sweep:
                out += ["### kvtier settings (GB/s; same blocks)", "", sweep_table(bench, mm), ""]
                print("\n".join(out[-3:]), flush=True)
            del mm
        bench.close()
        del bench
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # give pinned memory back
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"transfer_bandwidth_{device_tag()}.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
