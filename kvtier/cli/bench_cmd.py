"""``kvtier bench``: replay a trace through the real manager, transfer engine and tiers."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.bench.replay import Replay
from kvtier.bench.trace import load_trace
from kvtier.cli.errors import user_errors
from kvtier.config import format_size, load_config

DEFAULT_BLOCK_KIB = 64


def default_bench_config(disk_dir: Path):
    """Small tiers so that the bundled trace exercises eviction, demotion and disk hits."""
    return load_config(data={
        "tiers": {
            "cpu": {"capacity": "16MiB", "eviction": "lru"},
            "disk": {"path": str(disk_dir), "capacity": "96MiB", "eviction": "lru",
                     "compression": "zstd", "zstd_level": 1, "fsync": True},
        },
    })


def _table(report: dict) -> Table:
    t = Table(title=f"kvtier bench: {report['requests']} requests in {report['seconds']:.1f}s")
    for col in ("tier", "blocks", "tokens", "block hit rate", "token hit rate"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier in ("GPU", "CPU", "DISK", "MISS"):
        t.add_row(tier, str(report["blocks"][tier]), str(report["tokens"][tier]),
                  f"{report['block_hit_rate'][tier]:.1%}", f"{report['token_hit_rate'][tier]:.1%}")
    return t


def _transfer_table(report: dict) -> Table:
    t = Table(title="transfers" + (" (GPU simulated in host memory)" if report["gpu_is_simulated"] else ""))
    for col in ("direction", "jobs", "failed", "bytes", "busy s", "GB/s"):
        t.add_column(col, justify="right" if col != "direction" else "left")
    for name, s in report["transfers"].items():
        t.add_row(name, str(s["jobs"]), str(s["failed_jobs"]), format_size(int(s["bytes"])),
                  f"{s['seconds']:.3f}", f"{s['gbps']:.2f}")
    return t


def print_report(report: dict, console: Console) -> None:
    console.print(_table(report))
    console.print(_transfer_table(report))
    m = report["manager"]
    lines = [
        f"evictions: CPU {m['evicted_blocks']['CPU']}, DISK {m['evicted_blocks']['DISK']}",
        f"stored: CPU {m['stored_blocks']['CPU']}, DISK {m['stored_blocks']['DISK']}; "
        f"stores skipped (no space) {m['store_skipped_no_space']}",
    ]
    if "disk" in report:
        d = report["disk"]
        lines.append(f"disk: {d['num_blocks']} blocks, compression ratio {d['compression_ratio']:.3f}, "
                     f"checksum failures {d['checksum_failures']}")
    lines.append(f"wrong blocks served: {report['wrong_blocks']}; failed loads: {report['failed_loads']}")
    for line in lines:
        console.print(line)


@click.command()
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Mooncake-format JSONL trace (default: a small bundled sample).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="kvtier YAML (default: 16MiB CPU tier + 96MiB zstd disk tier in a temp dir).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests.")
@click.option("--block-kib", type=click.IntRange(min=1), default=DEFAULT_BLOCK_KIB, show_default=True,
              help="Synthetic KV bytes per trace block (512 tokens), in KiB.")
@click.option("--gpu-blocks", type=click.IntRange(min=1),
              help="Engine prefix-cache size in blocks (default: 2x the longest request).")
@user_errors
def bench(trace_path, config_path, as_json, limit, block_kib, gpu_blocks):
    """Replay a request trace through kvtier's manager, transfer workers and tiers.

    Prints per-tier hit rates (GPU/CPU/disk/miss, in blocks and tokens), bytes and GB/s per
    transfer direction, evictions, the disk compression ratio, and the number of wrong blocks
    served (every load is checked byte for byte; it must be 0).
    """
    trace = load_trace(trace_path, limit)
    longest = max(len(r.hash_ids) for r in trace)
    gpu_blocks = gpu_blocks or max(64, 2 * longest)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        config = load_config(config_path) if config_path else default_bench_config(Path(tmp) / "disk")
        replay = Replay(config, block_kib * 1024, gpu_blocks)
        try:
            if as_json or not sys.stderr.isatty():
                replay.run(trace)
            else:
                with Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
                    task = bar.add_task("requests", total=len(trace))
                    replay.run(trace, progress=lambda n: bar.update(task, completed=n))
            report = replay.report()
        finally:
            replay.close()
    report["config"] = config.to_dict()
    report["trace"] = str(trace_path) if trace_path else "<bundled sample>"
    if as_json:
        click.echo(json.dumps(report, default=str))
    else:
        print_report(report, Console())
    if report["wrong_blocks"]:
        sys.exit(1)
