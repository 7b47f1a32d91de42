"""``kvtier`` command line: ``bench`` (trace replay), ``stats`` (what a tier holds, live
counters), ``events`` (tail an instance's KV-event stream) and ``host-tier`` (the host's
shared CPU pool); ``--version``."""

from __future__ import annotations

import logging
import sys
from importlib import metadata

import click

from kvtier.cli.bench_cmd import bench
from kvtier.cli.events_cmd import events
from kvtier.cli.host_cmd import host_tier
from kvtier.cli.stats_cmd import stats
from kvtier.cli.terminal import echo_error


class KvtierGroup(click.Group):
    """One error style for every error: click's usage errors ("Usage: ... Error: ...", four
    lines) are printed like kvtier's own, ``kvtier: error: <what> (see '<command> --help')``,
    one line on stderr (wrapped to 80 columns at a terminal: ``terminal.py``), status 2
    (``user_errors`` prints config, trace and disk errors the same way)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            sys.exit(report(exc))
        except click.Abort:
            click.echo("kvtier: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def report(exc: click.ClickException) -> int:
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())) and ctx is not None:
        click.echo(ctx.get_help())  # plain `kvtier`: the help is the answer, not an error
        return 0
    message = exc.format_message()
    if isinstance(exc, click.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    echo_error(message)
    return exc.exit_code


def installed_version() -> str:
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


@click.group(cls=KvtierGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(installed_version(), "-V", "--version", prog_name="kvtier",
                      message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvtier: a KV-cache storage hierarchy for vLLM: GPU -> pinned CPU memory -> local disk
    -> a tier shared by many instances (Redis/Valkey).

    \b
    kvtier bench              replay the bundled sample trace through all tiers
    kvtier bench --trace T    replay a Mooncake-format trace
    kvtier bench --compare    compare placement policies (no bytes moved)
    kvtier bench --shared --config C
                              two instances sharing one Redis/Valkey tier
    kvtier stats --dir D      what a disk tier (and a running instance) holds
    kvtier stats --url U      live counters of an instance (metrics endpoint)
    kvtier events --endpoint E
                              tail an instance's KV events
    kvtier host-tier          what this host's shared CPU pool holds, per instance
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(bench)
cli.add_command(stats)
cli.add_command(events)
cli.add_command(host_tier)


def main() -> None:
    cli.main(prog_name="kvtier")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
