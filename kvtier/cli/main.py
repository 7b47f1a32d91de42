"""``kvtier`` command line: ``bench`` (trace replay), ``stats`` (what a tier holds, live
counters) and ``events`` (tail an instance's KV-event stream)."""

from __future__ import annotations

import logging
import sys

import click

from kvtier.cli.bench_cmd import bench
from kvtier.cli.events_cmd import events
from kvtier.cli.stats_cmd import stats


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvtier: a KV-cache storage hierarchy for vLLM (GPU -> pinned CPU -> local disk).

    \b
    kvtier bench            replay the bundled sample trace through all tiers
    kvtier bench --trace T  replay a Mooncake-format trace
    kvtier stats --dir D    what a disk tier (and a running instance) holds
    kvtier stats --url U    live counters of an instance from its metrics endpoint
    kvtier events --endpoint E   tail an instance's KV events
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(bench)
cli.add_command(stats)
cli.add_command(events)


def main() -> None:
    cli(prog_name="kvtier")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
