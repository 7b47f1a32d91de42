"""``kvtier events`` where nothing answers: it says it is waiting, and after ``--timeout`` it
fails (status 1) saying nothing answered, instead of printing nothing and exiting 0 (issue 49).
An instance that answers but is quiet is not an error: the command tails it."""

from __future__ import annotations

import socket

from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.config.schema import EventsConfig
from kvtier.observe.events.publisher import EventPublisher


def _unused_endpoint() -> str:
    with socket.socket() as s:  # bound, never listening: connecting to it is refused
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_nothing_listening_says_so_and_exits_1_after_the_timeout():
    endpoint = _unused_endpoint()
    res = CliRunner().invoke(cli, ["events", "--endpoint", endpoint, "--timeout", "0.5"])
    assert res.exit_code == 1, res.output
    assert res.stdout == ""
    err = " ".join(res.stderr.split())
    assert f"waiting for an instance at {endpoint}" in err
    assert f"kvtier: error: nothing answers at {endpoint} after 0.5 s" in err


def test_events_config_creates_nothing(tmp_path):
    """Reading the endpoints from a config creates none of what it names (its disk path)."""
    endpoint = _unused_endpoint()
    cfg = tmp_path / "kvtier.yaml"
    disk = tmp_path / "never" / "disk"
    cfg.write_text(f"tiers:\n  disk: {{path: {disk}, capacity: 1GiB}}\n"
                   f"events: {{endpoint: '{endpoint}'}}\n")
    res = CliRunner().invoke(cli, ["events", "--config", str(cfg), "--timeout", "0.5"])
    assert res.exit_code == 1, res.output
    assert "nothing answers" in res.stderr
    assert not (tmp_path / "never").exists()


def test_a_quiet_instance_that_answers_is_tailed_not_refused():
    cfg = EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    with EventPublisher(cfg, block_tokens=16) as pub:
        res = CliRunner().invoke(cli, ["events", "--endpoint", pub.endpoint, "--timeout", "5",
                                       "--idle-timeout", "1"])
    assert res.exit_code == 0, res.output
    assert "nothing answers" not in res.stderr
