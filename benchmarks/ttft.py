"""Time to first token with and without kvtier: recompute vs. prefix KV from the CPU or disk tier.

A random-weight Llama-3.1-8B-shaped model (transformers, bf16, built from a config: no
download). For each prompt length N the prefix (all but the last 16-token block) is:

(a) recomputed: one prefill of N tokens;
(b) loaded from kvtier's CPU tier: CudaCpuToGpuHandler moves the prefix blocks from the pinned
    pool into scattered pages of a paged KV cache (vLLM layout), the pages are handed to the
    model as its cache, and only the last block is prefilled;
(c) loaded from kvtier's disk tier: DiskToCpuHandler reads the blocks (page cache dropped
    before each repetition, so reads are cold) into the pool, then as (b).

The prefix KV that is stored is the model's own (stored through CudaGpuToCpuHandler and
DiskStore.put_many), and the first token's logits of (b) and (c) are compared with (a).
Prints a markdown table and writes ``<out-dir>/ttft_<device>.md``.

    python benchmarks/ttft.py [--lengths 2048 8192 32768] [--disk-dir DIR] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from kvtier.tiers.cpu_pool import CpuBlockPool  # noqa: E402
from kvtier.tiers.gpu_view import GpuKvView  # noqa: E402
from kvtier.transfer.cuda import CudaCpuToGpuHandler, CudaGpuToCpuHandler  # noqa: E402

DEV = torch.device("cuda", 0)
BLOCK = 16  # tokens per block (engine page = kvtier block)
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
        num_attention_heads=32, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def sync() -> None:
    torch.cuda.synchronize()


class Rig:
    """Paged engine KV cache + pinned pool + handlers, sized for the longest prompt."""

    def __init__(self, max_tokens: int, disk_dir: str | None) -> None:
        n_blocks = max_tokens // BLOCK
        self.engine_blocks = 2 * n_blocks + 8
        shape = (2, self.engine_blocks, BLOCK, KV_HEADS, HEAD_DIM)  # vLLM flash-attn layout
        self.kv = {f"model.layers.{i}.self_attn": torch.zeros(shape, dtype=torch.bfloat16, device=DEV)
                   for i in range(LAYERS)}
        self.view = GpuKvView(self.kv, layout="kv_first")
        self.geo = self.view.geometry(1, dtype="bfloat16", model="llama-3.1-8b-shape-random")
        self.pool = CpuBlockPool(self.geo, num_slots=n_blocks)
        self.store = CudaGpuToCpuHandler(self.view, self.pool)
        self.load = CudaCpuToGpuHandler(self.view, self.pool)
        self.loop = asyncio.new_event_loop()
        self.disk = self.disk_handler = None
        self.disk_note = ""
        if disk_dir:
            try:
                from kvtier.tiers.disk import DiskStore
                from kvtier.transfer.disk_io import DiskToCpuHandler

                shutil.rmtree(disk_dir, ignore_errors=True)
                self.disk = DiskStore(disk_dir, self.geo, fsync=True)
                self.disk_handler = DiskToCpuHandler(self.pool, self.disk, read_threads=16)
            except Exception as exc:  # noqa: BLE001 - report and skip (c)
                self.disk_note = f"disk tier unavailable: {type(exc).__name__}: {exc}"

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def put_prefix(self, cache, n_blocks: int, ids: list[int]) -> None:
        """Write the model's prefix KV into engine pages ``ids`` (what vLLM's kernels would)."""
        idx = torch.tensor(ids, device=DEV)
        for (k, v), t in zip(cache_layers(cache), self.kv.values()):
            for part, x in ((0, k), (1, v)):
                pages = x[0, :, : n_blocks * BLOCK].transpose(0, 1).reshape(
                    n_blocks, BLOCK, KV_HEADS, HEAD_DIM)
                t[part].index_copy_(0, idx, pages)

    def cache_from_pages(self, idx: torch.Tensor):
        """Hand pages ``idx`` (device tensor) to the HF model as a DynamicCache: one gather,
        where vLLM's attention would read the pages in place."""
        cache = new_cache()
        for layer, t in enumerate(self.kv.values()):
            k, v = (t[p].index_select(0, idx).reshape(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
                    for p in (0, 1))
            cache.update(k, v, layer)
        return cache


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


class SuffixStep:
    """Pages -> model cache -> prefill of the last block -> first-token logits.

    ``eager`` runs it through transformers op by op (its launch overhead for a 16-token step is
    ~20 ms on an 8B model); ``graph`` replays the same work from a CUDA graph captured once,
    as vLLM runs small steps. The graph reads the engine pages in place, so a load into the
    same pages followed by a replay is a real hit.
    """

    def __init__(self, model, rig: Rig, suffix: torch.Tensor, dst_ids: list[int]) -> None:
        self.model, self.rig, self.suffix = model, rig, suffix
        self.dst_idx = torch.tensor(dst_ids, device=DEV)  # static input of the graph
        self.graph = None
        self.graph_error = ""
        try:
            side = torch.cuda.Stream(DEV)
            side.wait_stream(torch.cuda.current_stream(DEV))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.eager()
            torch.cuda.current_stream(DEV).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.static_logits = self.eager()
            self.graph = graph
        except Exception as exc:  # noqa: BLE001 - report, fall back to eager
            self.graph_error = f"{type(exc).__name__}: {str(exc)[:120]}"
            torch.cuda.synchronize()

    def eager(self) -> torch.Tensor:
        cache = self.rig.cache_from_pages(self.dst_idx)
        out = self.model(self.suffix, past_key_values=cache, logits_to_keep=1)
        return out.logits[0, -1]

    def __call__(self, use_graph: bool) -> torch.Tensor:
        if use_graph:
            self.graph.replay()
            return self.static_logits.clone()
        return self.eager()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--disk-dir", default=os.path.join(os.getcwd(), ".ttft_disk"))
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ttft.py needs CUDA")
    try:
        t0 = time.perf_counter()
        model = build_model()
        built = time.perf_counter() - t0
    except ImportError as exc:
        sys.exit(f"transformers is not installed ({exc}); this benchmark needs it")
    rig = Rig(max(args.lengths), args.disk_dir)
    rig.pool.wait_ready()
    rng = random.Random(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, notes = [], []
    cold = True
    for n in args.lengths:
        prefix_blocks = (n - 1) // BLOCK
        p = prefix_blocks * BLOCK
        ids = torch.randint(0, 128256, (1, n), device=DEV, generator=gen)
        slots = list(range(prefix_blocks))
        keys = [f"ttft-{n}-{i}".encode() for i in range(prefix_blocks)]
        with torch.inference_mode():
            # (a) recompute
            model(ids, logits_to_keep=1)
            times = []
            for _ in range(args.reps):
                sync()
                t = time.perf_counter()
                ref = model(ids, logits_to_keep=1).logits[0, -1]
                ref.argmax().item()
                times.append(time.perf_counter() - t)
            t_a = statistics.median(times)
            # store the prefix's KV: model -> engine pages -> CPU pool (-> disk)
            out = model(ids[:, :p], use_cache=True, logits_to_keep=1)
            src_ids = rng.sample(range(rig.engine_blocks), prefix_blocks)
            rig.put_prefix(out.past_key_values, prefix_blocks, src_ids)
            del out
            rig.run(rig.store.run(LoadStoreSpec.gpu(src_ids), LoadStoreSpec.cpu(slots)))
            if rig.disk is not None:
                t = time.perf_counter()
                rig.disk.put_many([(k, memoryview(rig.pool.slot(s).numpy()))
                                   for k, s in zip(keys, slots)])
                notes.append(f"N={n}: disk write of {prefix_blocks * rig.geo.block_bytes / 1e9:.2f}"
                             f" GB with fsync took {time.perf_counter() - t:.2f} s")
            used = set(src_ids)
            dst_ids = [b for b in rng.sample(range(rig.engine_blocks), rig.engine_blocks)
                       if b not in used][:prefix_blocks]
            step = SuffixStep(model, rig, ids[:, p:], dst_ids)
            if step.graph_error:
                notes.append(f"N={n}: CUDA graph capture failed ({step.graph_error}); eager only")

            def hit(from_disk: bool, use_graph: bool) -> tuple[float, float, torch.Tensor]:
                """(total s, load s, logits) of one hit; destination pages scrambled first."""
                for t_ in rig.kv.values():
                    t_[:, dst_ids] = 0
                if from_disk:
                    for s in slots:
                        rig.pool.slot(s).zero_()
                    hit.cold = hit.cold and drop_page_cache()
                sync()
                t = time.perf_counter()
                if from_disk:
                    res = rig.run(rig.disk_handler.run(LoadStoreSpec.disk(keys),
                                                       LoadStoreSpec.cpu(slots)))
                    if res.failed_keys:
                        raise RuntimeError(f"{len(res.failed_keys)} disk blocks unreadable")
                rig.run(rig.load.run(LoadStoreSpec.cpu(slots), LoadStoreSpec.gpu(dst_ids)))
                t_load = time.perf_counter() - t
                logits = step(use_graph)
                logits.argmax().item()
                return time.perf_counter() - t, t_load, logits

            hit.cold = True
            modes = [False] + ([True] if step.graph is not None else [])
            row = dict(n=n, gb=prefix_blocks * rig.geo.block_bytes / 1e9, a=t_a)
            for g in modes:
                hit(False, g)
                res = [hit(False, g) for _ in range(args.reps)]
                row[f"b{int(g)}"] = statistics.median(r[0] for r in res)
                row["load"] = statistics.median(r[1] for r in res)
                row[f"cos_b{int(g)}"] = cosine(res[-1][2], ref)
            if rig.disk_handler is not None:
                res = [hit(True, modes[-1]) for _ in range(max(1, args.reps - 1))]
                row["c"] = statistics.median(r[0] for r in res)
                row["disk_load"] = statistics.median(r[1] for r in res)
                row["cos_c"] = cosine(res[-1][2], ref)
                cold = cold and hit.cold
            rows.append(row)
            print(row, flush=True)
            del step
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(DEV)
    lines = [f"# Time to first token on {name}", "",
             f"Random-weight Llama-3.1-8B shape (transformers {transformers_version()}, bf16, "
             f"sdpa; built in {built:.0f} s), torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}. Median of {args.reps} repetitions (disk: of "
             "max(1, reps-1)). A hit loads every full 16-token block but the last token's "
             "block and prefills only that block. Hit time = load (CudaCpuToGpuHandler, "
             "completion seen by event polling) + pages handed to the model + prefill of the "
             "rest + first token, eager (transformers op by op) or replayed from a CUDA graph "
             "(how vLLM runs small steps). cos = cosine of first-token logits vs (a).", ""]
    graph = any("b1" in r for r in rows)
    head = ["prompt tokens", "prefix KV GB", "(a) recompute ms", "load ms (GB/s)",
            "(a) / load", "(b) CPU hit ms, eager", "speed-up"]
    if graph:
        head += ["(b) CPU hit ms, graph", "of which model step ms", "speed-up"]
    head += ["cos"]
    if rig.disk_handler is not None:
        head += ["(c) disk hit ms", "of which disk read ms (GB/s)", "speed-up", "cos"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = [f"{r['n']}", f"{r['gb']:.2f}", f"{r['a'] * 1e3:.1f}",
             f"{r['load'] * 1e3:.1f} ({r['gb'] / r['load']:.1f})", f"{r['a'] / r['load']:.1f}x",
             f"{r['b0'] * 1e3:.1f}", f"{r['a'] / r['b0']:.1f}x"]
        if graph:
            c += [f"{r['b1'] * 1e3:.1f}", f"{(r['b1'] - r['load']) * 1e3:.1f}",
                  f"{r['a'] / r['b1']:.1f}x"]
        c += [f"{r.get('cos_b1', r['cos_b0']):.4f}"]
        if "c" in r:
            read = r["disk_load"] - r["load"]
            c += [f"{r['c'] * 1e3:.1f}", f"{read * 1e3:.0f} ({r['gb'] / read:.2f})",
                  f"{r['a'] / r['c']:.2f}x", f"{r['cos_c']:.4f}"]
        lines.append("| " + " | ".join(c) + " |")
    lines.append("")
    if rig.disk_handler is not None:
        lines.append(
            "Disk tier: kvtier DiskStore (fsync on, no compression) + DiskToCpuHandler (16 read "
            f"threads) on the machine's disk, directory {args.disk_dir}; page cache "
            f"{'dropped before each disk repetition (cold reads)' if cold else 'NOT dropped (warm)'}"
            "; disk read time = disk hit's load minus the CPU->GPU load time.")
    else:
        lines.append(rig.disk_note)
    lines += [f"- {x}" for x in notes]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    with open(os.path.join(args.out_dir, f"ttft_{tag}.md"), "w") as f:
        f.write(text)
    if rig.disk is not None:
        rig.disk.close()
        shutil.rmtree(args.disk_dir, ignore_errors=True)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
