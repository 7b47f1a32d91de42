"""Hostile or mistaken inputs to the CLI end in one ``kvtier: error:`` line and status 2, never
a traceback or a hang (issue 36, item 6): ports and ``ipc://`` paths that cannot be bound,
special files (FIFO, device, directory) as ``--config``, ``--trace`` or ``--snapshot``, an
oversized config, and ``stats --url`` past ``--timeout`` in name resolution or parsing.

The special-file cases run the real entry point in a child with a deadline, so a hang fails
the test instead of stalling the suite."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli

scrape_mod = importlib.import_module("kvtier.observe.metrics.scrape")  # the package re-exports
# a function of the same name

CHILD_DEADLINE_S = 120  # a cold start imports click, yaml and rich: seconds, not minutes


def child(*args):
    try:
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args],
                              capture_output=True, text=True, timeout=CHILD_DEADLINE_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {' '.join(args)} hung for {CHILD_DEADLINE_S} s")
    return proc


def one_error_line(code: int, stdout: str, stderr: str, needle: str) -> None:
    assert code == 2, stderr
    assert stdout == "" and "Traceback" not in stderr, stderr
    assert stderr.startswith("kvtier: error: ") and stderr.count("\n") == 1, stderr
    assert needle in stderr, stderr


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


def _oversized(tmp_path) -> str:
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as fh:  # sparse: 17 MiB on paper, nothing on disk
        fh.truncate(17 << 20)
    return str(path)


SPECIAL = {
    "bench --config FIFO": (lambda t, f: ["bench", "--config", f], "FIFO"),
    "stats --config FIFO": (lambda t, f: ["stats", "--config", f], "FIFO"),
    "stats --snapshot FIFO": (lambda t, f: ["stats", "--snapshot", f], "FIFO"),
    "bench --trace FIFO": (lambda t, f: ["bench", "--trace", f], "FIFO"),
    "events --config FIFO": (lambda t, f: ["events", "--config", f], "FIFO"),
    "events --config /dev/zero": (lambda t, f: ["events", "--config", "/dev/zero"], "device"),
    "bench --config /dev/zero": (lambda t, f: ["bench", "--config", "/dev/zero"], "device"),
    "stats --config /dev/zero": (lambda t, f: ["stats", "--config", "/dev/zero"], "device"),
    "stats --snapshot /dev/zero": (lambda t, f: ["stats", "--snapshot", "/dev/zero"], "device"),
    "bench --trace /dev/zero": (lambda t, f: ["bench", "--trace", "/dev/zero"], "device"),
    "bench --config directory": (lambda t, f: ["bench", "--config", str(t)], "directory"),
    "stats --snapshot directory": (lambda t, f: ["stats", "--snapshot", str(t)], "directory"),
    "bench --config oversized": (lambda t, f: ["bench", "--config", _oversized(t)], "16 MiB"),
    "stats --config oversized": (lambda t, f: ["stats", "--config", _oversized(t)], "16 MiB"),
    "stats --snapshot oversized": (lambda t, f: ["stats", "--snapshot", _oversized(t)],
                                   "16 MiB"),
}


@pytest.mark.parametrize("case", SPECIAL)
def test_special_and_oversized_files_are_one_error_line(tmp_path, fifo, case):
    make_args, needle = SPECIAL[case]
    proc = child(*make_args(tmp_path, fifo))
    one_error_line(proc.returncode, proc.stdout, proc.stderr, needle)


def test_a_snapshot_named_by_the_config_that_is_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "snap.json")
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"stats: {{snapshot_path: {tmp_path / 'snap.json'}}}\n")
    proc = child("stats", "--config", str(cfg))
    one_error_line(proc.returncode, proc.stdout, proc.stderr, "FIFO")


# -- ports and paths that cannot be bound ---------------------------------------------------------

@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


BIND = {
    "metrics port in use": (lambda port: f"metrics: {{port: {port}}}\n", "Address already in use"),
    "events port in use": (lambda port: f"events: {{endpoint: 'tcp://127.0.0.1:{port}'}}\n",
                           "Address already in use"),
    "ipc path over 107 characters": (
        lambda port: "events: {endpoint: 'ipc:///tmp/" + "x" * 120 + "'}\n", "107"),
}


@pytest.mark.parametrize("case", BIND)
def test_an_endpoint_that_cannot_be_bound_is_one_error_line(tmp_path, busy_port, case):
    yaml_of, needle = BIND[case]
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(yaml_of(busy_port))
    res = CliRunner().invoke(cli, ["bench", "--limit", "2", "--config", str(cfg)])
    one_error_line(res.exit_code, res.stdout, res.stderr, needle)


# -- stats --url: --timeout bounds the whole call -------------------------------------------------

@pytest.fixture
def release():
    done = threading.Event()
    yield done
    done.set()  # let the abandoned scrape thread finish


def test_url_timeout_covers_a_name_lookup_that_never_answers(monkeypatch, release):
    def never_answers(*args, **kwargs):
        release.wait(60)
        raise socket.gaierror("lookup released by the test")

    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    t0 = time.monotonic()
    res = CliRunner().invoke(cli, ["stats", "--url", "http://metrics.example:9400/metrics",
                                   "--timeout", "1"])
    elapsed = time.monotonic() - t0
    one_error_line(res.exit_code, res.stdout, res.stderr, "within 1s")
    assert elapsed < 3, elapsed


def test_url_timeout_covers_parsing_a_slow_body(monkeypatch, release):
    from kvtier.config import MetricsConfig
    from kvtier.observe.metrics import MetricsExporter

    def slow_parse(text):
        release.wait(60)
        return {}

    monkeypatch.setattr(scrape_mod, "parse", slow_parse)
    with MetricsExporter(MetricsConfig(port=0), lambda: {"manager": {"lookups": 1}}) as ex:
        t0 = time.monotonic()
        res = CliRunner().invoke(cli, ["stats", "--url", ex.url, "--timeout", "1"])
        elapsed = time.monotonic() - t0
    one_error_line(res.exit_code, res.stdout, res.stderr, "within 1s")
    assert elapsed < 3, elapsed
