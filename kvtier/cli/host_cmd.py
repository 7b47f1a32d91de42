"""``kvtier host-tier``: what the host tier's services on this host hold, for operators.

The service starts with the first instance that configures ``tiers.host`` (one per model
geometry); this command finds them by their sockets in the host tier's directory and asks
each for its index: the pool, its regions (one per instance), the blocks published and the
hits between instances. It is an observer: it holds no region and no pin.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.table import Table

from kvtier.cli.errors import user_errors
from kvtier.cli.inputs import load_config_file
from kvtier.config.schema import default_host_dir
from kvtier.config.sizes import format_size
from kvtier.tiers.host import HostTierUnavailable
from kvtier.tiers.host.client import observe


@click.command("host-tier")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False),
              help="The host tier's directory (default: the config's tiers.host.dir, else "
                   "/dev/shm/kvtier-host-<uid>).")
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="A kvtier config: its tiers.host.dir is the directory.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per service.")
@user_errors
def host_tier(directory: Path | None, config_path: Path | None, as_json: bool) -> int:
    """Show the host tier's services on this host: pool, regions, blocks, hits between
    instances. Exit status 1 when none runs."""
    if directory is None and config_path is not None:
        config = load_config_file(config_path, create_dirs=False)
        if config.host is None:
            raise click.UsageError(f"{config_path} has no tiers.host section")
        directory = config.host.dir
    directory = directory or default_host_dir()
    sockets = sorted(directory.glob("*.sock")) if directory.is_dir() else []
    found = []
    for sock in sockets:
        try:
            found.append(observe(sock))
        except HostTierUnavailable as exc:
            click.echo(f"kvtier: {sock.name}: {exc}", err=True)
    if not found:
        click.echo(f"kvtier: no host tier service runs in {directory}", err=True)
        return 1
    for stats in found:
        if as_json:
            click.echo(json.dumps(stats, sort_keys=True))
        else:
            _print(stats)
    return 0


def _print(stats: dict) -> None:
    console = Console(highlight=False)
    pool = sum(stats.get("pool_bytes", {}).values())
    console.print(f"host tier {stats['fingerprint'][:16]} (service pid {stats['pid']}): "
                  f"{stats['published_blocks']} of {stats['total_slots']} blocks published, "
                  f"{stats['free_slots']} slots free, pool {format_size(pool)} over "
                  f"{len(stats.get('pool_bytes', {}))} rank(s), {stats['pinned_slots']} slots "
                  f"being read, {stats['duplicates']} duplicate publications")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("instance", "region", "published", "stored", "hits given", "hits taken",
                "state"):
        table.add_column(col, justify="left" if col in ("instance", "state") else "right")
    for i in stats["instances"]:
        region = f"{i['base']}+{i['slots']}" if i["slots"] else "-"
        table.add_row(i["name"], region, str(i["published_blocks"]), str(i["stored_blocks"]),
                      str(i["hits_given"]), str(i["hits_taken"]),
                      "running" if i["alive"] else "gone (being read)")
    console.print(table)
