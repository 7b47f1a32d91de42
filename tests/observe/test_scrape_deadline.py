"""``kvtier stats --url`` against a server that drips its answer (issue 14, item 11): the
timeout covers the whole fetch, not each read. The server is real (a socket on 127.0.0.1 in a
thread); it drips a byte every 50 ms for as long as the client listens, so a per-read timeout
never fires. The join below is only a hang guard (a fetch that never returns), not a timing
assertion."""

from __future__ import annotations

import socket
import threading

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.observe.metrics.scrape import ScrapeError, fetch, parse


class DripServer:
    """Accepts connections; sends ``head`` at once, then one byte of ``drip`` every 50 ms."""

    def __init__(self, head: bytes, drip: bytes = b"# drip\n") -> None:
        self.head, self.drip = head, drip
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(self.head)
                i = 0
                while not self.stop.wait(0.05):
                    conn.sendall(self.drip[i % len(self.drip):][:1])
                    i += 1
            except OSError:
                pass  # the client gave up: what we want

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture(params=["headers", "body"])
def dripping(request):
    head = {"headers": b"HTTP/1.1 200 OK\r\n",  # then header bytes, one at a time
            "body": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"}[request.param]
    drip = b"X-Slow: yes\r\n" if request.param == "headers" else b"# HELP x y\n"
    server = DripServer(head, drip)
    yield server
    server.close()


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)  # hang guard only: the deadline under test is 1 s
    assert not t.is_alive(), "the fetch never returned: the timeout is per read, not per fetch"
    return box


def test_fetch_gives_up_on_a_dripping_server(dripping):
    box = _in_thread(lambda: fetch(dripping.url, timeout=1.0))
    assert isinstance(box.get("error"), ScrapeError), box
    assert "within 1s" in str(box["error"])


def test_stats_url_on_a_dripping_server_exits_2_in_one_line(dripping):
    box = _in_thread(lambda: CliRunner().invoke(
        cli, ["stats", "--url", dripping.url, "--timeout", "1"]))
    res = box["value"]
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "within 1s" in res.output


def test_fetch_still_reads_a_prompt_server():
    server = socket.create_server(("127.0.0.1", 0))
    body = b"kvtier_evictions_total{tier=\"CPU\"} 3\n"

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    threading.Thread(target=answer, daemon=True).start()
    try:
        text = fetch(f"http://127.0.0.1:{server.getsockname()[1]}/metrics", timeout=30)
    finally:
        server.close()
    assert text == body.decode()


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "1e300"])
def test_non_finite_and_huge_values_are_ignored(bad):
    """Such values reach ``int()`` and ``format_size`` when the table is drawn."""
    text = "# TYPE kvtier_lookups_total counter\nkvtier_lookups_total {}\n"
    assert parse(text.format("5.0")) == {"manager": {"lookups": 5}}
    assert parse(text.format(bad)) == {}
