"""``kvtier stats``: what each tier holds, and live counters of a running instance."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.errors import user_errors
from kvtier.config import ConfigError, format_size, load_config
from kvtier.config.schema import STATS_FILE_NAME
from kvtier.runtime.snapshot import read_snapshot
from kvtier.tiers.disk import DiskStore

STALE_AFTER_S = 30.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ts(value: float | None) -> str | None:
    if value is None:
        return None
    return datetime.fromtimestamp(value, tz=timezone.utc).isoformat(timespec="seconds")


def collect_stats(config_path: Path | None, disk_dir: Path | None) -> dict:
    config = load_config(config_path) if config_path else None
    if disk_dir is None and config is not None and config.disk is not None:
        disk_dir = config.disk.path
    out: dict = {"tiers": {}, "instance": None}
    if config is not None:
        out["tiers"]["CPU"] = {"capacity_bytes": config.cpu.capacity, "eviction": config.cpu.eviction}
    if disk_dir is not None:
        if not Path(disk_dir).is_dir():
            raise ConfigError(f"no such directory: {disk_dir}", file=str(disk_dir), key="--dir",
                              allowed="a kvtier disk-tier directory")
        d = DiskStore.read_stats(disk_dir)
        tier = {
            "path": str(disk_dir),
            "blocks": d.num_blocks,
            "used_bytes": d.logical_bytes,
            "stored_bytes": d.stored_bytes,
            "file_bytes": d.file_bytes,
            "compression_ratio": round(d.compression_ratio, 4),
            "checksum_failures": d.checksum_failures,
            "read_errors": d.read_errors,
            "oldest": _ts(d.oldest_ts),
            "newest": _ts(d.newest_ts),
            "geometry": d.geometry,
        }
        if config is not None and config.disk is not None:
            tier["capacity_bytes"] = config.disk.capacity
        out["tiers"]["DISK"] = tier
    snap_path = config.snapshot_path() if config is not None else None
    if snap_path is None and disk_dir is not None:
        snap_path = Path(disk_dir) / STATS_FILE_NAME
    snap = read_snapshot(snap_path) if snap_path is not None else None
    if snap is not None:
        age = time.time() - float(snap.get("written_at", 0))
        snap["live"] = _pid_alive(int(snap.get("pid", -1))) and age < STALE_AFTER_S
        snap["age_s"] = round(age, 1)
        out["instance"] = snap
        for tier, usage in (snap.get("usage") or {}).items():
            out["tiers"].setdefault(tier, {}).update(usage)
    return out


def print_stats(data: dict, console: Console) -> None:
    t = Table(title="kvtier tiers")
    for col in ("tier", "blocks", "used", "capacity", "compression", "oldest", "newest"):
        t.add_column(col)
    for name, tier in data["tiers"].items():
        used = tier.get("used_bytes")
        cap = tier.get("capacity_bytes")
        t.add_row(
            name,
            str(tier.get("blocks", tier.get("used_blocks", "-"))),
            format_size(used) if used is not None else "-",
            format_size(cap) if cap is not None else "-",
            f"{tier['compression_ratio']:.3f}" if "compression_ratio" in tier else "-",
            tier.get("oldest") or "-",
            tier.get("newest") or "-",
        )
    console.print(t)
    inst = data["instance"]
    if inst is None:
        console.print("no running instance found (no stats snapshot)")
        return
    state = "live" if inst["live"] else f"not running (snapshot {inst['age_s']}s old)"
    console.print(f"instance pid {inst.get('pid')}: {state}")
    m = inst.get("manager", {})
    if m:
        console.print(f"hits: CPU {m['hit_blocks']['CPU']} blocks, DISK {m['hit_blocks']['DISK']} blocks; "
                      f"lookups {m['lookups']} ({m['lookup_blocks']} blocks)")
    for name, s in (inst.get("transfers") or {}).items():
        console.print(f"{name}: {format_size(int(s['bytes']))} in {s['jobs']} jobs, {s['gbps']:.2f} GB/s")


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="kvtier YAML: report its tiers (and its running instance, if any).")
@click.option("--dir", "disk_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A disk-tier directory to inspect (read-only).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def stats(config_path, disk_dir, as_json):
    """Capacity, used bytes, block count, compression ratio and oldest/newest entry per tier;
    for a running instance also hit counters and bytes per transfer direction."""
    if config_path is None and disk_dir is None:
        raise click.UsageError("give --config FILE or --dir DISK_DIR")
    data = collect_stats(config_path, disk_dir)
    if as_json:
        click.echo(json.dumps(data, default=str))
    else:
        print_stats(data, Console())
