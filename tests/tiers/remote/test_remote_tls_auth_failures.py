"""TLS and AUTH failures are named, counted apart and logged once.

Before, a wrong CA or a wrong password looked like any lost connection: the tier degraded,
``kvtier_remote_errors_total`` stayed 0 and nothing said why. Now ``last_error`` names the
failure ("TLS: certificate verify failed (wrong CA?)", "AUTH failed"), the
``remote.tls_errors`` / ``remote.auth_errors`` counters (metrics ``kvtier_remote_tls_errors_total``
/ ``kvtier_remote_auth_errors_total``) count it, and the log says it once, not per attempt.
"""

from __future__ import annotations

import logging
import os
import ssl
import subprocess

import pytest

from kvtier.observe.metrics.exporter import metric_families
from kvtier.tiers.remote.wire import failures
from kvtier.tiers.remote.block_io import RemoteBlockIO
from kvtier.tiers.remote.exists import PresenceQueries
from kvtier.tiers.remote.health import RemoteHealth
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.secrets import RemoteSecrets
from support.fake_resp import FakeResp
from support.remote_blocks import BLOCK, Slots, remote_cfg
from support.valkey_fixtures import valkey  # noqa: F401 - a pytest fixture


@pytest.fixture(autouse=True)
def fresh_log_once():
    failures._logged.clear()  # "once per process": each test starts as a new process would
    yield
    failures._logged.clear()


@pytest.fixture
def tls_server(tmp_path):
    """A TLS fake server whose certificate (for 127.0.0.1) no CA the client knows signed."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server = FakeResp(lambda args, conn: b"+PONG\r\n", tls=ctx)
    yield server, cert
    server.close()


def _names_once(caplog, text: str, queries: PresenceQueries, tries: int = 3) -> None:
    for _ in range(tries):
        assert queries.count_present([[b"k"]]) == [None]
        queries.health.recovered()  # as a probe would: the next lookup tries again
    named = [r for r in caplog.records if text in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in caplog.records]


def test_a_certificate_from_an_unknown_ca_is_named_counted_and_logged_once(tls_server,
                                                                           caplog):
    server, _ = tls_server
    caplog.set_level(logging.WARNING)
    cfg = remote_cfg(url=f"rediss://127.0.0.1:{server.port}")  # system CAs only
    io = RemoteBlockIO(cfg, RemoteKeys("ns", "geo"), RemoteSecrets.load(cfg), Slots(2, BLOCK),
                       BLOCK)
    queries = PresenceQueries(cfg, RemoteSecrets.load(cfg), RemoteHealth(60.0))
    try:
        assert not io.warm_up()
        assert io.fetch([b"a"], [0]).failed == [0]
        _names_once(caplog, "TLS: certificate verify failed (wrong CA?)", queries)
    finally:
        io.close()
        queries.close()
    assert io.stats.tls_errors >= 1 and io.stats.auth_errors == 0
    assert "TLS: certificate verify failed (wrong CA?)" in io.stats.last_error
    assert queries.tls_errors == 3
    metrics = {m.name: m for m in metric_families({"remote": io.stats.to_dict()})}
    tls = metrics["kvtier_remote_tls_errors"]
    assert tls.samples[0].value == io.stats.tls_errors


def test_the_right_ca_connects(tls_server):
    server, cert = tls_server
    cfg = remote_cfg(url=f"rediss://127.0.0.1:{server.port}", tls_ca_file=str(cert))
    io = RemoteBlockIO(cfg, RemoteKeys("ns", "geo"), RemoteSecrets.load(cfg), Slots(2, BLOCK),
                       BLOCK)
    try:
        assert io.warm_up()
    finally:
        io.close()
    assert io.stats.tls_errors == 0 and io.stats.errors == 0


def test_a_wrong_password_is_named_counted_and_logged_once(valkey, caplog):
    password = "right-" + os.urandom(6).hex()
    server = valkey()
    server.client().execute_command("ACL", "SETUSER", "kvtier", "on", f">{password}", "~*",
                                    "+@all")
    caplog.set_level(logging.WARNING)
    cfg = remote_cfg(url=server.url, username="kvtier", password_env="PW")
    secrets = RemoteSecrets.load(cfg, {"PW": "wrong-" + os.urandom(6).hex()})
    io = RemoteBlockIO(cfg, RemoteKeys("ns", "geo"), secrets, Slots(2, BLOCK), BLOCK)
    queries = PresenceQueries(cfg, secrets, RemoteHealth(60.0))
    try:
        assert not io.warm_up()
        _names_once(caplog, "AUTH failed", queries)
    finally:
        io.close()
        queries.close()
    assert io.stats.auth_errors == 1 and io.stats.tls_errors == 0
    assert "AUTH failed" in io.stats.last_error and queries.auth_errors == 3
    assert password not in caplog.text and secrets.password not in caplog.text


def test_kvtier_stats_names_the_tls_failure():
    import io

    from rich.console import Console

    from kvtier.cli.stats_cmd import print_stats

    last = "127.0.0.1:1: TLS: certificate verify failed (wrong CA?): self-signed"
    data = {"tiers": {}, "instance": {
        "source": "http://127.0.0.1:1", "manager": {"remote_degraded": True},
        "usage": {"REMOTE": {}},
        "remote": {"errors": 3, "tls_errors": 3, "rejected": 0, "last_error": last}}}
    out = io.StringIO()
    print_stats(data, Console(file=out, width=80))
    text = " ".join(out.getvalue().split())
    assert "TLS errors 3" in text and "certificate verify failed (wrong CA?)" in text
