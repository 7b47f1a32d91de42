"""Disk tier throughput vs raw sequential file I/O on the same disk, in the same run.

For each block size: raw sequential write of N blocks (+ one fsync), raw cold read of the same
file, then ``DiskStore.put_many`` (batches, one sync per batch) and ``get_into`` cold reads, with
and without zstd. Payloads are bf16 normals, like real KV. Page cache is dropped with
``posix_fadvise(DONTNEED)`` before every cold read (after the data is flushed). Each measurement
is repeated (interleaved with its baseline) and the median is reported, since shared disks are
noisy.

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


def raw_write(path: Path, data: list[memoryview], fsync: bool, batch: int | None) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t = time.perf_counter()
        for i, b in enumerate(data):
            os.write(fd, b)
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


def store_run(root: Path, geo: BlockGeometry, data, keys, *, compression: str, level: int,
              fsync: bool, batch: int, writers: int = 1, readers: int = 1
              ) -> tuple[float, float, float]:
    """(write seconds, cold read seconds, compression ratio) for one fresh store."""
    shutil.rmtree(root, ignore_errors=True)
    with DiskStore(root, geo, compression=compression, zstd_level=level, fsync=fsync) as s:
        tw = in_threads(
            writers, list(range(0, len(data), batch)),
            lambda i: s.put_many(list(zip(keys[i : i + batch], data[i : i + batch]))),
        )
        for seg in (root / "segments").glob("*.seg"):
            drop_cache(seg)
        local = threading.local()

        def read(i: int) -> None:
            out = getattr(local, "out", None)
            if out is None:
                out = local.out = memoryview(bytearray(geo.block_bytes))
            for j in range(i, min(i + batch, len(keys))):
                if not s.get_into(keys[j], out):
                    raise RuntimeError("DiskStore lost a block")
            if out != data[min(i + batch, len(keys)) - 1]:
                raise RuntimeError("DiskStore returned wrong bytes")

        tr = in_threads(readers, list(range(0, len(keys), batch)), read)
        ratio = s.stats().compression_ratio
    shutil.rmtree(root, ignore_errors=True)
    return tw, tr, ratio


def bench_block(kib: int, args, work: Path) -> dict:
    bb = kib << 10
    n = max((args.total_mib << 20) // bb, args.batch)
    total = n * bb
    geo = BlockGeometry(num_layers=32, kv_parts=2, engine_blocks_per_block=1, page_bytes=bb // 64,
                        model=f"bench-{kib}k")
    data = blocks(make_pool(bb), bb, n)
    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]
    samples: dict[str, list[float]] = {}
    ratio = 1.0

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(total / seconds / 1e9)

    raw = work / "raw.bin"
    for _ in range(args.repeats):
        add("raw_write", raw_write(raw, data, args.fsync, None))
        add("raw_read", raw_read(raw, bb, n))
        add("raw_write_batch_sync", raw_write(raw, data, args.fsync, args.batch))
        raw.unlink()
        tw, tr, _ = store_run(work / "store", geo, data, keys, compression="none", level=0,
                              fsync=args.fsync, batch=args.batch, writers=args.writers,
                              readers=args.readers)
        add("store_write", tw)
        add("store_read", tr)
        if not args.skip_zstd:
            tw, tr, ratio = store_run(work / "store", geo, data, keys, compression="zstd",
                                      level=args.zstd_level, fsync=args.fsync, batch=args.batch,
                                      writers=args.writers, readers=args.readers)
            add("zstd_write", tw)
            add("zstd_read", tr)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "block_kib": kib, "blocks": n, "bytes": total, "gbps": med, "samples": samples,
        "write_vs_raw": med["store_write"] / med["raw_write"],
        "read_vs_raw": med["store_read"] / med["raw_read"],
        "zstd_ratio": ratio if not args.skip_zstd else None,
    }


def table(results: list[dict], args) -> str:
    lines = [
        f"disk tier vs raw, {args.total_mib} MiB per size, batch {args.batch} blocks, "
        f"{args.writers} writer / {args.readers} reader thread(s), "
        f"fsync {'ON (one per batch; raw: one per file)' if args.fsync else 'OFF'}, "
        f"median of {args.repeats}, GB/s of block bytes",
        f"{'block':>7} | {'raw W':>6} {'rawW/b':>6} {'store W':>7} {'W/raw':>6} | "
        f"{'raw R':>6} {'store R':>7} {'R/raw':>6} | {'zstd W':>6} {'zstd R':>6} {'ratio':>5}",
    ]
    for r in results:
        g = r["gbps"]
        z = (f"{g['zstd_write']:6.2f} {g['zstd_read']:6.2f} {r['zstd_ratio']:5.2f}"
             if r["zstd_ratio"] else f"{'-':>6} {'-':>6} {'-':>5}")
        lines.append(
            f"{r['block_kib']:>5}Ki | {g['raw_write']:6.2f} {g['raw_write_batch_sync']:6.2f} "
            f"{g['store_write']:7.2f} {r['write_vs_raw']:6.0%} | {g['raw_read']:6.2f} "
            f"{g['store_read']:7.2f} {r['read_vs_raw']:6.0%} | {z}"
        )
    lines.append("rawW/b: raw write with an fsync every batch (the store's durability cadence)")
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
