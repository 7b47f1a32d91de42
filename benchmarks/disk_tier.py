"""Disk tier throughput vs raw sequential file I/O on the same disk, in the same run.

For each block size: raw sequential writes of N blocks (one fsync at the end -- the baseline
of the >= 90 % target --, one fsync per batch, and with write-back started every MiB), then
``DiskStore.put_many`` (batches; the store syncs data and index once per batch), then cold
reads of the raw file (one ``preadv`` per block) and of the store (``get_into`` per block), with
and without zstd. Payloads are bf16 normals, like real KV. The page cache is dropped with
``posix_fadvise(DONTNEED)`` before every cold read, and one untimed read runs first because on
virtual disks the first read after a write burst is slow whatever reads it. Each measurement is
repeated (the two timed reads alternate in order) and the median is reported, since shared
disks are noisy; ``--json`` keeps every sample.

    python benchmarks/disk_tier.py --block-kib 64,256,1024 --total-mib 512 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk.segments import KICK_BYTES, start_writeback
from kvtier.tiers.layout import BlockGeometry

POOL_BYTES = 64 << 20


def drop_cache(path: Path) -> bool:
    """Flush and evict one file from the page cache; False if the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def make_pool(block_bytes: int) -> memoryview:
    n = max(POOL_BYTES // block_bytes, 1) * block_bytes
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(n // 2, dtype=torch.float32, generator=gen).to(torch.bfloat16)
    return memoryview(data.view(torch.uint8).numpy())


def blocks(pool: memoryview, block_bytes: int, n: int):
    per = len(pool) // block_bytes
    return [pool[(i % per) * block_bytes : (i % per + 1) * block_bytes] for i in range(n)]


def raw_write(path: Path, data: list[memoryview], fsync: bool, batch: int | None,
              kick: bool = False) -> float:
    """Sequential write; one fdatasync at the end, or one per ``batch`` blocks.

    ``kick``: start write-back every MiB as the store does (sync_file_range), the tuned
    ceiling; without it the kernel starts writing only at the fsync.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t = time.perf_counter()
        written = kicked = 0
        for i, b in enumerate(data):
            written += os.write(fd, b)
            if kick and written - kicked >= KICK_BYTES:
                start_writeback(fd, kicked, written - kicked)
                kicked = written
            if fsync and batch and (i + 1) % batch == 0:
                os.fdatasync(fd)
        if fsync:
            os.fdatasync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def raw_read(path: Path, block_bytes: int, n: int) -> float:
    drop_cache(path)
    buf = bytearray(block_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        for i in range(n):
            if os.preadv(fd, [buf], i * block_bytes) != block_bytes:
                raise RuntimeError("short raw read")
        return time.perf_counter() - t
    finally:
        os.close(fd)


def in_threads(n_threads: int, jobs: list, fn) -> float:
    """Run ``fn(job)`` for every job on ``n_threads`` threads (like the transfer workers)."""
    it = iter(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            try:
                fn(job)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


class StoreRun:
    """One fresh store: timed batched writes, then (separately) timed cold reads."""

    def __init__(self, root: Path, geo: BlockGeometry, data, keys, args, compression: str):
        shutil.rmtree(root, ignore_errors=True)
        self.root, self.geo, self.data, self.keys, self.args = root, geo, data, keys, args
        self.store = DiskStore(root, geo, compression=compression, zstd_level=args.zstd_level,
                               fsync=args.fsync)

    def write(self) -> float:
        s, data, keys, batch = self.store, self.data, self.keys, self.args.batch
        return in_threads(
            self.args.writers, list(range(0, len(data), batch)),
            lambda i: s.put_many(list(zip(keys[i : i + batch], data[i : i + batch]))),
        )

    def drop_cache(self) -> None:
        for seg in (self.root / "segments").glob("*.seg"):
            drop_cache(seg)

    def read(self) -> float:
        self.drop_cache()
        s, data, keys, batch = self.store, self.data, self.keys, self.args.batch
        local = threading.local()

        def read_batch(i: int) -> None:
            out = getattr(local, "out", None)
            if out is None:
                out = local.out = memoryview(bytearray(self.geo.block_bytes))
            for j in range(i, min(i + batch, len(keys))):
                if not s.get_into(keys[j], out):
                    raise RuntimeError("DiskStore lost a block")
            if out != data[min(i + batch, len(keys)) - 1]:
                raise RuntimeError("DiskStore returned wrong bytes")

        return in_threads(self.args.readers, list(range(0, len(keys), batch)), read_batch)

    def close(self) -> float:
        ratio = self.store.stats().compression_ratio
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return ratio


def bench_block(kib: int, args, work: Path) -> dict:
    bb = kib << 10
    n = max((args.total_mib << 20) // bb, args.batch)
    total = n * bb
    geo = BlockGeometry(num_layers=32, kv_parts=2, engine_blocks_per_block=1, page_bytes=bb // 64,
                        model=f"bench-{kib}k")
    data = blocks(make_pool(bb), bb, n)
    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]
    samples: dict[str, list[float]] = {}
    ratio = None

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(total / seconds / 1e9)

    raw = work / "raw.bin"
    for rep in range(args.repeats):
        # Writes first, then the cold reads of raw file and store back to back (order
        # alternating), so both reads meet the disk in the same state.
        add("raw_write_batch_sync", raw_write(raw, data, args.fsync, args.batch))
        add("raw_write_kicked", raw_write(raw, data, args.fsync, None, kick=args.fsync))
        add("raw_write", raw_write(raw, data, args.fsync, None))
        run = StoreRun(work / "store", geo, data, keys, args, "none")
        try:
            add("store_write", run.write())
            raw_read(raw, bb, n)  # untimed: the first read after a write burst is slow on VMs
            reads = [("raw_read", lambda: raw_read(raw, bb, n)), ("store_read", run.read)]
            for name, fn in reads if rep % 2 == 0 else reads[::-1]:
                # Evict both, so the second read finds the page cache as the first did (on a
                # VM, reading into never-touched memory costs more than reusing freed pages).
                drop_cache(raw)
                run.drop_cache()
                add(name, fn())
        finally:
            run.close()
            raw.unlink()
        if not args.skip_zstd:
            run = StoreRun(work / "store", geo, data, keys, args, "zstd")
            try:
                add("zstd_write", run.write())
                run.read()  # untimed, as above
                add("zstd_read", run.read())
            finally:
                ratio = run.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "block_kib": kib, "blocks": n, "bytes": total, "gbps": med, "samples": samples,
        "write_vs_raw": med["store_write"] / med["raw_write"],
        "write_vs_raw_kicked": med["store_write"] / med["raw_write_kicked"],
        "read_vs_raw": med["store_read"] / med["raw_read"],
        "zstd_ratio": ratio,
    }


def table(results: list[dict], args) -> str:
    lines = [
        f"disk tier vs raw, {args.total_mib} MiB per size, batch {args.batch} blocks, "
        f"{args.writers} writer / {args.readers} reader thread(s), fsync "
        f"{'ON (store: one per batch; raw: one per file)' if args.fsync else 'OFF'}, "
        f"median of {args.repeats}, GB/s of block bytes",
        f"{'block':>7} | {'raw W':>6} {'rawW/b':>6} {'rawW+k':>6} {'store W':>7} {'/raw':>5} "
        f"{'/raw+k':>6} | {'raw R':>6} {'store R':>7} {'/raw':>5} | "
        f"{'zstd W':>6} {'zstd R':>6} {'ratio':>5}",
    ]
    for r in results:
        g = r["gbps"]
        z = (f"{g['zstd_write']:6.2f} {g['zstd_read']:6.2f} {r['zstd_ratio']:5.2f}"
             if r["zstd_ratio"] else f"{'-':>6} {'-':>6} {'-':>5}")
        lines.append(
            f"{r['block_kib']:>5}Ki | {g['raw_write']:6.2f} {g['raw_write_batch_sync']:6.2f} "
            f"{g['raw_write_kicked']:6.2f} {g['store_write']:7.2f} {r['write_vs_raw']:5.0%} "
            f"{r['write_vs_raw_kicked']:6.0%} | {g['raw_read']:6.2f} {g['store_read']:7.2f} "
            f"{r['read_vs_raw']:5.0%} | {z}"
        )
    lines.append(
        "raw W: write + one fsync (the target's baseline); rawW/b: fsync every batch; "
        "rawW+k: write-back started every MiB + one fsync (the tuned ceiling; the store does "
        "this too)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", default="64,256,1024", help="comma-separated block sizes")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per block size")
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: tmp)")
    p.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch", type=int, default=32, help="blocks per put_many call")
    p.add_argument("--writers", type=int, default=1, help="threads calling put_many")
    p.add_argument("--readers", type=int, default=1, help="threads calling get_into")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--zstd-level", type=int, default=1)
    p.add_argument("--skip-zstd", action="store_true")
    p.add_argument("--json", nargs="?", const="-", default=None,
                   help="write results as JSON to PATH (or stdout if no PATH)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.block_kib.split(",") if x.strip()]
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-disk-bench-", dir=base))
    try:
        results = [bench_block(kib, args, work) for kib in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"fsync": args.fsync, "batch": args.batch, "total_mib": args.total_mib,
              "writers": args.writers, "readers": args.readers,
              "repeats": args.repeats, "dir": str(base), "results": results}
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(table(results, args))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
