"""``kvtier stats``: what each tier holds, and live counters of a running instance.

A running instance is read from its stats snapshot file (``--config`` / ``--dir`` find it,
``--snapshot`` names it) or from its Prometheus endpoint (``--url``); both give the same
live-stats dict, from which per-tier hit rates, used/capacity and GB/s per direction are
derived.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import click
from click.core import ParameterSource
from rich import box
from rich.console import Console
from rich.table import Table

from kvtier.cli import terminal
from kvtier.cli.errors import user_errors
from kvtier.cli.inputs import load_config_file, read_snapshot_file
from kvtier.config import ConfigError, format_size
from kvtier.config.schema import STATS_FILE_NAME
from kvtier.observe.metrics import ScrapeError, enrich, scrape
from kvtier.tiers.disk import DiskStore

STALE_AFTER_S = 30.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):  # gone, or not a pid at all
        return False
    return True


def _ts(value: float | None) -> str | None:
    if value is None:
        return None
    return datetime.fromtimestamp(value, tz=timezone.utc).isoformat(timespec="seconds")


def _instance_from_snapshot(snap: dict) -> dict:
    age = time.time() - float(snap.get("written_at", 0))
    snap["live"] = _pid_alive(int(snap.get("pid", -1))) and age < STALE_AFTER_S
    snap["age_s"] = round(age, 1)
    return snap


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rate(part, total) -> float | None:
    return round(part / total, 4) if isinstance(part, (int, float)) and total else None


def host_line(host: dict, m: dict) -> str:
    """The host tier, for one instance: the pool, and the hits between instances."""
    if not host:
        return "host tier DOWN (this instance serves from its own region)"
    return (f"host tier: {host.get('instances', 0)} instances, {_count(host.get('used_blocks'))}"
            f" of {_count(host.get('capacity_blocks'))} blocks; hits on others' blocks "
            f"{m.get('host_foreign_hit_blocks', 0)}, others' hits on this instance's "
            f"{host.get('hits_given', 0)}; stores skipped (held by another) "
            f"{m.get('host_store_skipped_held', 0)}, evictions held back "
            f"{m.get('host_evictions_held', 0)}")


def shared_tier_configured(data: dict) -> bool:
    """Whether a shared tier is part of this setup: the config names one, or the instance
    reports its usage (the manager lists REMOTE usage only when it has the tier) or its
    counters. The manager's ``remote_degraded`` flag and zero REMOTE hit counts are exported
    either way, and alone they showed a REMOTE row and "shared tier ok" for an instance that
    has no shared tier."""
    if "REMOTE" in data["tiers"] and "server" in data["tiers"]["REMOTE"]:
        return True
    inst = data.get("instance") or {}
    usage = inst.get("usage")
    manager = inst.get("manager") or {}
    return bool((isinstance(usage, dict) and "REMOTE" in usage) or inst.get("remote")
                or manager.get("remote_degraded") is True)


def summarize(data: dict) -> dict:
    """Add per-tier hit rates and the transfers table of the instance to ``data`` (in place)."""
    inst = data.get("instance")
    if not inst:
        return data
    enrich(inst)
    tiers = data["tiers"]
    for tier, usage in (inst.get("usage") or {}).items():
        if isinstance(usage, dict):
            tiers.setdefault(tier, {}).update(usage)
    req = inst.get("requests") or {}
    manager = inst.get("manager") or {}
    if req.get("hit_blocks"):  # what the engine saw: rates over every prompt block/token
        hit_b, hit_t = req.get("hit_blocks") or {}, req.get("hit_tokens") or {}
        total_b = sum(hit_b.values()) + req.get("miss_blocks", 0)
        total_t = sum(hit_t.values()) + req.get("miss_tokens", 0)
        for tier in hit_b:
            row = tiers.setdefault(tier, {})
            row.update(hit_blocks=hit_b.get(tier), block_hit_rate=_rate(hit_b.get(tier), total_b))
            if tier in hit_t:
                row.update(hit_tokens=hit_t[tier], token_hit_rate=_rate(hit_t[tier], total_t))
    elif manager.get("hit_blocks"):  # only the manager's view: rates over looked-up blocks
        for tier, n in manager["hit_blocks"].items():
            tiers.setdefault(tier, {}).update(
                hit_blocks=n, block_hit_rate=_rate(n, manager.get("lookup_blocks")))
    disk = inst.get("disk")
    ratio = disk.get("compression_ratio") if isinstance(disk, dict) else None
    if _is_number(ratio) and "DISK" in tiers:
        tiers["DISK"].setdefault("compression_ratio", round(float(ratio), 4))
    data["transfers"] = inst.get("transfers") or {}
    if not shared_tier_configured(data):
        tiers.pop("REMOTE", None)
    return data


URL_ALLOWED = "a kvtier metrics URL such as http://127.0.0.1:9400/metrics"
FETCH_ERROR_GRACE_S = 0.25
"""When the fetch's own deadline fires, its error (which phase stalled) arrives a moment after
``timeout``; waiting this much longer lets it be the one reported."""


def scrape_within(url: str, timeout: float) -> dict:
    """``scrape`` with ``timeout`` for all of it: the fetch's own deadline covers the socket
    but not resolving the host name (a DNS server that never answers) nor parsing a huge body,
    so the whole call runs in a daemon thread that is abandoned when the deadline passes."""
    result: dict = {}

    def work() -> None:
        try:
            result["stats"] = scrape(url, timeout)
        except ScrapeError as exc:
            result["error"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as one line, never a traceback
            result["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=work, name="kvtier-stats-scrape", daemon=True)
    worker.start()
    worker.join(timeout + FETCH_ERROR_GRACE_S)
    if worker.is_alive():
        raise ConfigError(f"no answer within {timeout:g}s (--timeout: name lookup, connection, "
                          "transfer and parsing included)", key="--url", allowed=URL_ALLOWED)
    if "error" in result:
        raise ConfigError(result["error"], key="--url", allowed=URL_ALLOWED)
    return result["stats"]


def _disk_tier(disk_dir: Path, config, named_by: str) -> dict:
    """What the disk tier at ``disk_dir`` holds, read-only. ``named_by``: ``--dir``, or the
    config's ``tiers.disk.path``, which need not exist yet: an instance creates it when it
    starts, so before that the tier is shown absent (``exists: false``)."""
    tier: dict = {"path": str(disk_dir)}
    if config is not None and config.disk is not None:
        tier["capacity_bytes"] = config.disk.capacity
    if named_by != "--dir" and not os.path.lexists(disk_dir):
        return {**tier, "exists": False}
    if not disk_dir.is_dir():
        raise ConfigError(f"no such directory: {disk_dir}", file=str(disk_dir), key=named_by,
                          allowed="a kvtier disk-tier directory")
    if not any(disk_dir.iterdir()):  # created, never written to yet
        return {**tier, "blocks": 0, "used_bytes": 0}
    d = DiskStore.read_stats(disk_dir)
    return {
        **tier,
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


def collect_stats(config_path: Path | None, disk_dir: Path | None, url: str | None = None,
                  snapshot_path: Path | None = None, timeout: float = 5.0) -> dict:
    if url is not None:
        inst = scrape_within(url, timeout)
        inst.update(source=url, live=True)
        return summarize({"tiers": {}, "instance": inst})
    if snapshot_path is not None:
        snap = read_snapshot_file(snapshot_path)
        if snap is None:
            raise ConfigError(f"no readable kvtier stats snapshot at {snapshot_path} (missing, "
                              "unreadable or malformed)",
                              key="--snapshot", allowed="a kvtier-stats.json file")
        return summarize({"tiers": {}, "instance": _instance_from_snapshot(snap)})
    config = load_config_file(config_path, create_dirs=False) if config_path else None
    named_by = "--dir"
    if disk_dir is None and config is not None and config.disk is not None:
        disk_dir, named_by = config.disk.path, "tiers.disk.path"
    out: dict = {"tiers": {}, "instance": None}
    if config is not None:
        out["tiers"]["CPU"] = {"capacity_bytes": config.cpu.capacity, "eviction": config.cpu.eviction}
    if config is not None and config.remote is not None:  # the server's maxmemory is the budget
        r = config.remote
        out["tiers"]["REMOTE"] = {"capacity_bytes": r.capacity, "capacity_is": "advisory",
                                  "server": r.url or ",".join(r.nodes)}
    if disk_dir is not None:
        out["tiers"]["DISK"] = _disk_tier(Path(disk_dir), config, named_by)
    snap_path = config.snapshot_path() if config is not None else None
    if snap_path is None and disk_dir is not None:
        snap_path = Path(disk_dir) / STATS_FILE_NAME
    snap = read_snapshot_file(snap_path)
    if snap is not None:
        out["instance"] = _instance_from_snapshot(snap)
    return summarize(out)


def _pct(v) -> str:
    return f"{v:.1%}" if _is_number(v) else "-"


def _count(v) -> str:
    """A block count in at most 6 characters ("98.8M"): exact below 100,000 (--json is exact)."""
    if not _is_number(v):
        return "-"
    if abs(v) < 100_000:
        return str(int(v))
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v / 1e3:.3g}k"


def _size(v) -> str:
    return format_size(int(v)) if _is_number(v) else "-"


TIER_COLUMNS = ("tier", "blocks", "used", "capacity", "hit\nblocks", "block\nhit rate",
                "token\nhit rate", "compr.\nratio")
"""Two-line headers and no timestamp columns: the table fits 80 columns (it needed ~155, and
rich cut headers to "bloc…"). The oldest/newest entries follow as lines under the table."""


def _tiers_table(data: dict) -> tuple[Table, list[str]]:
    t = Table(title="kvtier tiers", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in TIER_COLUMNS:
        t.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    ages = []
    for name, tier in data["tiers"].items():
        blocks = tier.get("blocks", tier.get("used_blocks"))
        ratio = tier.get("compression_ratio")
        t.add_row(
            name,
            _count(blocks),
            _size(tier.get("used_bytes")),
            _size(tier.get("capacity_bytes")),
            _count(tier.get("hit_blocks")),
            _pct(tier.get("block_hit_rate")),
            _pct(tier.get("token_hit_rate")),
            f"{ratio:.3f}" if _is_number(ratio) else "-",
        )
        if tier.get("exists") is False:
            ages.append(f"{name}: {tier['path']} does not exist yet (no instance has "
                        "started with this config)")
        if tier.get("oldest") or tier.get("newest"):
            ages.append(f"{name}: oldest entry {tier.get('oldest') or '-'}, "
                        f"newest {tier.get('newest') or '-'}")
    return t, ages


def print_stats(data: dict, console: Console) -> None:
    t, ages = _tiers_table(data)
    console.print(t)
    for line in ages:
        console.print(line)
    inst = data["instance"]
    if inst is None:
        console.print("no running instance found (no stats snapshot)")
        return
    if "source" in inst:
        console.print(f"instance at {inst['source']}: live")
    else:
        state = "live" if inst["live"] else f"not running (snapshot {inst['age_s']}s old)"
        console.print(f"instance pid {inst.get('pid')}: {state}")
    if data.get("transfers"):
        tt = Table(title="transfers", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
        for col in ("direction", "jobs", "failed", "bytes", "busy s", "GB/s"):
            tt.add_column(col, justify="left" if col == "direction" else "right")
        for name, x in data["transfers"].items():
            tt.add_row(name, _count(x.get("jobs")), _count(x.get("failed_jobs")), _size(x.get("bytes")),
                       f"{x.get('seconds', 0):.3f}", f"{x.get('gbps', 0):.2f}")
        console.print(tt)
    m = inst.get("manager") or {}
    d = inst.get("disk") or {}
    ev = inst.get("events") or {}
    parts = [f"lookups {m.get('lookups', '-')} ({m.get('lookup_blocks', '-')} blocks)"]
    if m.get("evicted_blocks"):
        parts.append("evictions " + ", ".join(f"{k} {v}" for k, v in m["evicted_blocks"].items()))
    if "evicted_unwritten" in m:  # > 0: write-back to disk falls behind the stores
        parts.append(f"evicted before written to disk {m['evicted_unwritten']}")
    if m.get("admission_rejected"):
        parts.append("admission rejections " + ", ".join(f"{k} {v}" for k, v in m["admission_rejected"].items()))
    if "checksum_failures" in d:
        parts.append(f"checksum failures {d['checksum_failures']}")
    if "remote_degraded" in m and shared_tier_configured(data):
        state = "DEGRADED" if m["remote_degraded"] else "ok"
        parts.append(f"shared tier {state} ({m.get('remote_degradations', 0)} degradations, "
                     f"{m.get('remote_writes_skipped', 0)} write-backs skipped, "
                     f"{m.get('remote_writes_already_held', 0)} already held)")
    host = (inst.get("usage") or {}).get("HOST")
    if host is not None:
        parts.append(host_line(host, m))
    r = inst.get("remote") or {}
    if r:
        named = "".join(f", {label} {r[k]}" for k, label in (
            ("tls_errors", "TLS errors"), ("auth_errors", "AUTH errors"),
            ("unlisted_refused", "unlisted-node refusals")) if r.get(k))
        parts.append(f"shared tier values rejected {r.get('rejected', 0)}, "
                     f"errors {r.get('errors', 0)}{named}")
        if named and r.get("last_error"):
            parts.append(f"last shared-tier error: {r['last_error']}")
    if ev:
        parts.append(f"events: {ev.get('batches', 0)} batches, {ev.get('dropped_events', 0)} dropped")
    console.print("; ".join(parts))
    cost = inst.get("cost")
    if isinstance(cost, dict) and cost.get("load_gbps"):
        console.print(cost_line(cost, m))


def cost_line(cost: dict, manager: dict) -> str:
    """Cost-aware loading's view: what recompute costs, each tier's measured load speed, and
    the hits it left to recompute because loading them would have been slower."""
    skipped = manager.get("skipped_slower_than_recompute") or {}
    latency = cost.get("latency_ms") or {}
    tiers = ", ".join(
        f"{tier} {gbps:.2f} GB/s"
        + (f" + {latency[tier]:.1f} ms per load" if latency.get(tier) else "")
        + f" ({cost.get('measured', {}).get(tier, 0)} samples"
        + (f", {skipped[tier]} blocks recomputed instead" if skipped.get(tier) else "") + ")"
        for tier, gbps in cost["load_gbps"].items())
    return (f"cost-aware loading: recompute {cost.get('recompute_ms_per_block', '-')} ms/block "
            f"(loads pay above {cost.get('break_even_gbps', '-')} GB/s); measured loads: {tiers}; "
            f"lookups cut {cost.get('cuts', 0)}, probes {cost.get('probes', 0)}, "
            f"explorations of larger loads {cost.get('explorations', 0)}")


def refuse_unused_options(ctx: click.Context) -> None:
    """No option is silently ignored: --url and --snapshot read one instance and nothing else,
    --timeout is --url's, --interval and --count are --watch's."""
    given = {p.name: p.opts[-1] for p in ctx.command.params
             if ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE,
                                                      ParameterSource.ENVIRONMENT)}
    sources = [given[n] for n in ("url", "snapshot_path", "config_path", "disk_dir")
               if n in given]
    if len(sources) > 1 and ("url" in given or "snapshot_path" in given):
        raise click.UsageError(f"give one of {' and '.join(sources)} (--url and --snapshot "
                               "read a running instance alone)")
    if "timeout" in given and "url" not in given:
        raise click.UsageError("--timeout: used only with --url")
    wrong = [given[n] for n in ("interval", "count") if n in given]
    if wrong and "watch" not in given:
        raise click.UsageError(f"{', '.join(wrong)}: used only with --watch")


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="kvtier YAML: report its tiers (and its running instance, if any).")
@click.option("--dir", "disk_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A disk-tier directory to inspect (read-only).")
@click.option("--url", help="A running instance's metrics endpoint, e.g. http://127.0.0.1:9400/metrics.")
@click.option("--timeout", type=click.FloatRange(min=0.1, max=3600), default=5.0,
              show_default=True, help="--url: seconds for the whole fetch.")
@click.option("--snapshot", "snapshot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A running instance's stats snapshot file (kvtier-stats.json).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (one per line with --watch).")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--count", type=click.IntRange(min=1), help="With --watch: stop after N refreshes.")
@user_errors
@click.pass_context
def stats(ctx, config_path, disk_dir, url, timeout, snapshot_path, as_json, watch, interval, count):
    """Capacity, used bytes, block count, hit rates, compression ratio and oldest/newest entry
    per tier; for a running instance also bytes and GB/s per transfer direction."""
    if config_path is None and disk_dir is None and url is None and snapshot_path is None:
        raise click.UsageError("give --config FILE, --dir DISK_DIR, --url URL or --snapshot FILE")
    refuse_unused_options(ctx)
    console = terminal.console()
    shown = 0
    try:
        while True:
            data = collect_stats(config_path, disk_dir, url, snapshot_path, timeout)
            if as_json:
                click.echo(json.dumps(data, default=str))
            else:
                if watch:
                    console.clear()
                print_stats(data, console)
            shown += 1
            if not watch or (count is not None and shown >= count):
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
