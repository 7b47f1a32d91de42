"""``kvtier events``: tail a running instance's KV-event stream in readable form or as JSON."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click
import zmq

from kvtier.cli import terminal
from kvtier.cli.errors import user_errors
from kvtier.cli.terminal import echo_error, echo_stderr
from kvtier.cli.inputs import load_config_file, read_snapshot_file
from kvtier.config import ConfigError
from kvtier.observe.events import (
    AllBlocksCleared,
    BlockAccessed,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventSubscriber,
    Gap,
)

SHOW_HASHES = 4
EXIT_NO_ANSWER = 1
HASH_CHARS = 8  # enough to tell blocks apart at a glance; --json has them whole


def _hash(h) -> str | int:
    return h.hex() if isinstance(h, bytes) else h


def event_to_dict(ev) -> dict:
    """JSON-able form of one wire event (hashes as hex strings when they are bytes)."""
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    out = {"type": type(ev).__name__, "medium": ev.medium,
           "block_hashes": [_hash(h) for h in ev.block_hashes]}
    if isinstance(ev, BlockStored):
        parent = ev.parent_block_hash
        out.update(parent_block_hash=None if parent is None else _hash(parent),
                   block_size=ev.block_size, token_ids=list(ev.token_ids),
                   lora_name=ev.lora_name)
    elif isinstance(ev, BlockAccessed):
        out["num_tokens"] = ev.num_tokens
    return out


def item_to_dict(item: Delivery | Gap) -> dict:
    if isinstance(item, Gap):
        return {"gap": {"expected": item.expected, "resumed_at": item.resumed_at,
                        "reason": item.reason}}
    b = item.batch
    return {"seq": item.seq, "ts": b.ts, "replayed": item.replayed,
            "data_parallel_rank": b.data_parallel_rank,
            "events": [event_to_dict(e) for e in b.events],
            "access": [event_to_dict(e) for e in b.access]}


def _with_hashes(prefix: str, hashes, suffix: str, width: int) -> str:
    """``prefix[h1 h2 +N]suffix`` in at most ``width`` columns: as many leading hashes as fit
    (up to ``SHOW_HASHES``), then the count of the others; cut at ``width`` if even one does
    not fit."""
    short = [str(_hash(h))[:HASH_CHARS] for h in hashes[:SHOW_HASHES]]
    line = ""
    for shown in range(len(short), -1, -1):
        more = [f"+{len(hashes) - shown}"] if len(hashes) > shown else []
        line = f"{prefix}[{' '.join(short[:shown] + more)}]{suffix}"
        if len(line) <= width:
            return line
    return line[:width]


def item_lines(item: Delivery | Gap, width: int = terminal.MAX_COLUMNS) -> list[str]:
    """One line per event, each at most ``width`` columns: hashes shortened, a parent hash
    and the block size left to ``--json``, which prints every field whole."""
    if isinstance(item, Gap):
        upto = f"..{item.resumed_at - 1}" if item.resumed_at > item.expected + 1 else ""
        return [f"GAP: batch {item.expected}{upto} lost ({item.reason})"[:width]]
    b = item.batch
    when = datetime.fromtimestamp(b.ts, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    head = f"#{item.seq} {when}" + (" (replay)" if item.replayed else "")
    lines = []
    for ev in b.events:
        if isinstance(ev, AllBlocksCleared):
            lines.append(f"{head} cleared all blocks"[:width])
        elif isinstance(ev, BlockStored):
            tokens = f"{len(ev.token_ids)} tokens" if ev.token_ids else "no tokens"
            lines.append(_with_hashes(
                f"{head} stored  {ev.medium or '-':<7} {len(ev.block_hashes):>4} blocks ",
                ev.block_hashes, f" {tokens}", width))
        elif isinstance(ev, BlockRemoved):
            lines.append(_with_hashes(
                f"{head} removed {ev.medium or '-':<7} {len(ev.block_hashes):>4} blocks ",
                ev.block_hashes, "", width))
    for ev in b.access:
        lines.append(_with_hashes(
            f"{head} hit     {ev.medium or '-':<7} {len(ev.block_hashes):>4} blocks ",
            ev.block_hashes, f" {ev.num_tokens} tokens", width))
    return lines or [f"{head} (empty batch)"[:width]]


def endpoints_from_config(path: Path) -> tuple[str, str | None, str]:
    """The event endpoints of the instance ``path`` configures: the bound ones its stats
    snapshot records when it runs (needed for any-port endpoints), else the configured ones."""
    config = load_config_file(path, create_dirs=False)
    if config.events is None:
        raise ConfigError("the config has no events section (the event stream is off)",
                          file=str(path), key="events", allowed="events: {endpoint: ...}")
    endpoint, replay = config.events.endpoint, config.events.replay_endpoint
    snap_path = config.snapshot_path()
    snap = read_snapshot_file(snap_path)
    info = (snap or {}).get("events") or {}
    if isinstance(info.get("endpoint"), str):
        endpoint = info["endpoint"]
        replay = info.get("replay_endpoint") if isinstance(info.get("replay_endpoint"), str) else replay
    return endpoint, replay, config.events.topic


def connect_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not something to connect to (ZMQ's own error would name neither the
    option nor the expected form), or None."""
    scheme, sep, rest = endpoint.partition("://")
    expected = "expected tcp://HOST:PORT or ipc://PATH"
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        return f"not an endpoint ({expected})"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port.isascii() and port.isdigit()
                                          and 0 < int(port) <= 65535):
            return f"a tcp endpoint needs a host and a port from 1 to 65535 ({expected})"
    return None


@click.command()
@click.option("--endpoint", help="PUB endpoint of the instance, e.g. tcp://127.0.0.1:5570.")
@click.option("--replay-endpoint", help="Its replay (ROUTER) endpoint: fills holes, and history.")
@click.option("--topic", default=None, help="Topic to subscribe to (default: the config's, or '').")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Take the endpoints from this kvtier YAML (and its running instance).")
@click.option("--from-seq", type=click.IntRange(min=0),
              help="Replay from this sequence number first (default: only what comes next).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per batch (or gap) per line.")
@click.option("--count", type=click.IntRange(min=1), help="Exit after this many batches.")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True),
              help="Exit after this many seconds without a batch.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True,
              help="Exit with status 1 if nothing answers at the endpoint in this many seconds.")
@user_errors
def events(endpoint, replay_endpoint, topic, config_path, from_seq, as_json, count, idle_timeout,
           timeout):
    """Tail the KV events of a running instance (vLLM's format; kvtier's access events too).

    Sequence numbers are checked: holes are filled from the replay endpoint when given, and
    a lost stretch is printed as a GAP line. Until the instance answers, stderr says it is
    waiting; if nothing answers within --timeout, the command fails (status 1).
    """
    config_topic = ""
    if config_path is not None:
        cfg_endpoint, cfg_replay, config_topic = endpoints_from_config(config_path)
        endpoint = endpoint or cfg_endpoint
        replay_endpoint = replay_endpoint or cfg_replay
    if endpoint is None:
        raise click.UsageError("give --endpoint or --config")
    if from_seq is not None and replay_endpoint is None:
        raise click.UsageError("--from-seq needs --replay-endpoint")
    for option, value in (("--endpoint", endpoint), ("--replay-endpoint", replay_endpoint)):
        problem = None if value is None else connect_problem(value)
        if problem:
            raise click.UsageError(f"cannot connect to {option} {value!r}: {problem}")
    try:
        sub = EventSubscriber(endpoint, replay_endpoint=replay_endpoint,
                              topic=config_topic if topic is None else topic, start_seq=from_seq,
                              watch_connection=True)
    except zmq.ZMQError as exc:
        where = endpoint if replay_endpoint is None else f"{endpoint} or {replay_endpoint}"
        raise click.UsageError(f"cannot connect to {where}: {exc}") from None
    seen = 0
    last = started = time.monotonic()
    width = terminal.columns()
    answered = said_waiting = False
    try:
        while count is None or seen < count:
            items = sub.poll(0.25)
            if not answered:
                answered = bool(items) or sub.connected()
            if not answered:
                if not said_waiting:
                    said_waiting = True
                    echo_stderr(f"kvtier: waiting for an instance at {endpoint} (up to "
                                f"{timeout:g} s)")
                if time.monotonic() - started >= timeout:
                    echo_error(f"nothing answers at {endpoint} after {timeout:g} s: is the "
                               "instance running, with its event stream on?")
                    sys.exit(EXIT_NO_ANSWER)
                continue
            if not items:
                if idle_timeout is not None and time.monotonic() - last >= idle_timeout:
                    break
                continue
            last = time.monotonic()
            for item in items:
                if as_json:
                    click.echo(json.dumps(item_to_dict(item)))
                else:
                    for line in item_lines(item, width):
                        click.echo(line)
                seen += isinstance(item, Delivery)
                if count is not None and seen >= count:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
