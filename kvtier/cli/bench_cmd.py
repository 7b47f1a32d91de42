"""``kvtier bench``: replay a trace through the real manager, transfer engine and tiers.

torch is imported only when a replay actually moves bytes (``kvtier.bench.replay`` is imported
inside ``bench``): importing it takes seconds, which ``--help``, ``--compare`` and every other
command must not pay."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from kvtier.bench.compare import DEFAULT_POLICIES
from kvtier.bench.trace import load_trace
from kvtier.cli import compare_table, terminal
from kvtier.cli.errors import EXIT_USAGE, user_errors
from kvtier.cli.inputs import load_config_file, regular_file
from kvtier.cli.progress import progress
from kvtier.cli.terminal import echo_error
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
    for tier in ("GPU", "CPU", "DISK", "REMOTE", "MISS"):
        if tier == "REMOTE" and "remote" not in report:
            continue
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
    if "cost" in report:
        c, skipped = report["cost"], m["skipped_slower_than_recompute"]
        lines.append(f"cost-aware loading: load GB/s CPU {c['load_gbps']['CPU']}, DISK "
                     f"{c['load_gbps']['DISK']} (break-even {c['break_even_gbps']}); hits skipped as "
                     f"slower than recompute: CPU {skipped['CPU']}, DISK {skipped['DISK']}")
    lines.append(f"wrong blocks served: {report['wrong_blocks']}; failed loads: {report['failed_loads']}")
    if report.get("overlap"):
        lines.append("--overlap: transfers ran on across requests; counts vary with thread timing")
    else:
        lines.append("each request's transfers finished before the next: the same trace and "
                     "config give these counts every run (--overlap: engine-like timing)")
    for line in lines:
        console.print(line)


def _check_simulated_gpu(gpu_blocks: int, block_kib: int) -> None:
    """The simulated GPU is host memory, allocated up front: refuse one larger than half the
    machine (the trace reader bounds a request, but --gpu-blocks and --block-kib multiply)."""
    from kvtier.config.machine import physical_memory

    need, memory = gpu_blocks * block_kib * 1024, physical_memory()
    if memory is not None and need > memory // 2:
        raise click.UsageError(
            f"the simulated GPU would take {format_size(need)} ({gpu_blocks} blocks of "
            f"{block_kib} KiB), more than half of this machine's {format_size(memory)}; lower "
            "--gpu-blocks or --block-kib")


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter("every capacity must be at least 1 block")
    return out


def run_compare(trace, trace_name: str, capacities, policies: str, as_json: bool) -> None:
    """``--compare``: the policy table (real manager per policy, Belady, infinite cache)."""
    from kvtier.bench.compare import as_rows, check_specs, compare, infinite, replay

    try:
        specs = check_specs(policies.split(","))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--policies") from None
    runs = len(capacities) * len(dict.fromkeys(["lru", *specs]))
    t0 = time.perf_counter()
    with progress(runs, "policy runs") as update:
        done = 0

        def run_one(trace, capacity, spec):  # the real manager's replay, counted
            nonlocal done
            update(done, f"C={capacity:,} {spec}")
            result = replay(trace, capacity, spec)
            done += 1
            return result

        results = compare(trace, capacities, specs, run=run_one)
        ceiling = infinite(trace)
    seconds = time.perf_counter() - t0
    blocks = sum(len(r.hash_ids) for r in trace)
    if as_json:
        click.echo(json.dumps({
            "trace": trace_name, "requests": len(trace), "blocks": blocks,
            "seconds": round(seconds, 3), "rows": as_rows(results),
            "infinite": ceiling.as_dict(),
        }))
        return
    click.echo(compare_table.intro(trace_name, len(trace), blocks, seconds) + "\n")
    click.echo(compare_table.table(results, ceiling))


def run_shared_bench(config, trace, trace_name: str, block_bytes: int, gpu_blocks: int):
    from kvtier.bench.shared import run_shared

    if config is None or config.remote is None:
        raise click.UsageError("--shared needs --config with a tiers.remote section "
                               "(a Redis/Valkey server to share)")
    try:
        report = run_shared(config, trace, block_bytes, gpu_blocks)
    except OSError as exc:  # a port or path it could not bind, a server it could not reach
        _fail(f"--shared: {exc}")
    report["trace"] = trace_name
    click.echo(json.dumps(report, default=str))
    if report["wrong_blocks"]:
        sys.exit(1)


def _fail(message: str) -> None:
    echo_error(message)
    sys.exit(EXIT_USAGE)


MODE_OPTIONS = (
    # (options, when they apply, what to say when given elsewhere)
    (("capacity_blocks", "policies"), lambda p: p["do_compare"], "used only with --compare"),
    (("config_path", "gpu_blocks", "block_kib", "overlap", "do_shared"),
     lambda p: not p["do_compare"],
     "not used by --compare (it replays the manager alone: no bytes, no config)"),
    (("overlap",), lambda p: not p["do_shared"], "not used by --shared"),
)
"""Every option is used by the mode it is given in, or refused: none is silently ignored."""


def refuse_unused_options(ctx: click.Context) -> None:
    given = {p.name: p.opts[-1] for p in ctx.command.params
             if ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE,
                                                      ParameterSource.ENVIRONMENT)}
    for names, applies, why in MODE_OPTIONS:
        wrong = [given[n] for n in names if n in given]
        if wrong and not applies(ctx.params):
            raise click.UsageError(f"{', '.join(wrong)}: {why}")


@click.command()
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Mooncake-format JSONL trace (default: a small bundled sample).")
@click.option("--compare", "do_compare", is_flag=True,
              help="Compare placement policies instead: replay the trace through the manager "
                   "(CPU tier, no bytes) once per policy and capacity, with Belady's optimum.")
@click.option("--capacity-blocks", callback=_int_list,
              help="--compare: tier capacities, in trace blocks (default: 5, 20 and 50% of "
                   "the trace's distinct blocks).")
@click.option("--policies", default=",".join(DEFAULT_POLICIES), show_default=True,
              help="--compare: eviction[+admission][+hints] specs (lru is always run); +hints "
                   "passes the trace's 'continues' flags as a router's retention hints.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="kvtier YAML (default: 16MiB CPU tier + 96MiB zstd disk tier in a temp dir).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests.")
@click.option("--block-kib", type=click.IntRange(min=1), default=DEFAULT_BLOCK_KIB, show_default=True,
              help="Synthetic KV bytes per trace block (512 tokens), in KiB.")
@click.option("--gpu-blocks", type=click.IntRange(min=1),
              help="Engine prefix-cache size in blocks (default: 2x the longest request).")
@click.option("--overlap", is_flag=True,
              help="Let stores and demotions run on while later requests are served (as in an "
                   "engine); hit counts then depend on thread timing and vary run to run. "
                   "Default: each request's transfers finish before the next request, so the "
                   "same trace and config give the same counts every run.")
@click.option("--shared", "do_shared", is_flag=True,
              help="Shared tier (needs tiers.remote in --config): two instances replay the "
                   "trace's halves against one Redis/Valkey tier, vs one instance with twice "
                   "the CPU capacity.")
@user_errors
@click.pass_context
def bench(ctx, trace_path, do_compare, capacity_blocks, policies, config_path,
          as_json, limit, block_kib, gpu_blocks, overlap, do_shared):
    """Replay a request trace through kvtier's manager, transfer workers and tiers.

    Prints per-tier hit rates (GPU/CPU/disk/remote/miss, in blocks and tokens), bytes and GB/s per
    transfer direction, evictions, the disk compression ratio, and the number of wrong blocks
    served (every load is checked byte for byte; it must be 0).

    With --compare: one table of block and token hit rate, blocks written, wasted writes
    (evicted before a single hit), share of the LRU->Belady gap closed and writes relative to
    LRU, per policy and capacity.

    With --shared: the cross-instance report of the shared tier (one JSON object).
    """
    refuse_unused_options(ctx)
    config = load_config_file(config_path) if config_path else None  # before any slow import
    if trace_path is not None:
        regular_file(trace_path, "--trace")
    trace = load_trace(trace_path, limit)
    trace_name = str(trace_path) if trace_path else "<bundled sample>"
    if do_compare:
        from kvtier.bench.compare import default_capacities

        run_compare(trace, trace_name, capacity_blocks or default_capacities(trace), policies,
                    as_json)
        return
    longest = max(len(r.hash_ids) for r in trace)
    gpu_blocks = gpu_blocks or max(64, 2 * longest)
    _check_simulated_gpu(gpu_blocks, block_kib)
    from kvtier.bench.replay import Replay  # torch: only here, where bytes move

    if do_shared:
        run_shared_bench(config, trace, trace_name, block_kib * 1024, gpu_blocks)
        return

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        config = config or default_bench_config(Path(tmp) / "disk")
        try:
            replay = Replay(config, block_kib * 1024, gpu_blocks, overlap=overlap)
        except OSError as exc:  # an events/metrics port in use, an ipc:// path too long
            _fail(str(exc))
        try:
            with progress(len(trace), "requests replayed") as update:
                replay.run(trace, progress=lambda n: update(n, ""))
            report = replay.report()
        finally:
            replay.close()
    report["config"] = config.to_dict()
    report["trace"] = trace_name
    report["overlap"] = overlap
    if as_json:
        click.echo(json.dumps(report, default=str))
    else:
        print_report(report, terminal.console())
    if report["wrong_blocks"]:
        sys.exit(1)
