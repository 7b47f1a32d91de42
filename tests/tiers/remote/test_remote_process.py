"""The shared tier's data path as production runs it: I/O child processes that map the CPU
pool, against real servers. Bytes exact; absent keys are misses; forged records are refused
when the tier has a MAC key; ACL and TLS credentials reach the server but never a command
line; a hung child is replaced instead of stalling a load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from kvtier.tiers.remote.io.process import RemoteIOProcesses
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.remote.block_io import RemoteBlockIO
from kvtier.tiers.remote.wire.connect import connect_remote, remote_keys
from kvtier.tiers.remote.secrets import RemoteSecretError, RemoteSecrets
from kvtier.tiers.remote.store import RemoteUnavailable
from support.remote_processes import BLOCK, fill, geometry, keys_of, open_io, remote_cfg
from support.valkey_fixtures import cluster, valkey  # noqa: F401 - pytest fixtures

def test_round_trip_through_the_io_processes_is_exact(tmp_path, valkey):
    cfg = remote_cfg(tmp_path, url=valkey().url)
    pool, io = open_io(cfg)
    try:
        assert io.warm_up() == 2
        want = fill(pool, range(16))
        assert io.put_slots(list(range(16)), keys_of(16)) == [True] * 16
        for s in range(16, 33):
            pool.slot(s).zero_()
        r = io.fetch_slots(keys_of(16) + [b"never-stored"], list(range(16, 33)))
        assert r.failed == [16] and r.transient == []  # absent: a miss, not a lost read
        assert all(torch.equal(pool.slot(16 + i), want[i]) for i in range(16))
        st = io.stats()
        assert (st.puts, st.hits, st.misses, st.rejected) == (16, 16, 1, 0)
    finally:
        io.close()


def test_cluster_round_trip_spreads_over_the_primaries(tmp_path, cluster):
    cfg = remote_cfg(tmp_path, nodes=[n.node for n in cluster])
    pool, io = open_io(cfg)
    try:
        want = fill(pool, range(24), seed=3)
        assert io.put_slots(list(range(24)), keys_of(24, "c")) == [True] * 24
        assert all(n.client().dbsize() > 0 for n in cluster)
        r = io.fetch_slots(keys_of(24, "c"), list(range(24, 48)))
        assert r.failed == []
        assert all(torch.equal(pool.slot(24 + i), want[i]) for i in range(24))
    finally:
        io.close()


def _key_file(path, data: bytes, mode=0o600):
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def test_with_a_mac_key_forged_records_are_misses_and_counted(tmp_path, valkey):
    server = valkey()
    key_a = _key_file(tmp_path / "k", os.urandom(32).hex().encode())
    honest = remote_cfg(tmp_path, url=server.url, auth_key_file=key_a)
    pool, io = open_io(honest)
    # a writer without the key (another tenant, a compromised instance) plants valid records
    # (right key names, right checksums) holding other bytes, and one with a wrong key
    key_b = _key_file(tmp_path / "other", os.urandom(32).hex().encode())
    pool_f, forger = open_io(remote_cfg(tmp_path, url=server.url))
    pool_g, wrong_key = open_io(remote_cfg(tmp_path, url=server.url, auth_key_file=key_b))
    try:
        want = fill(pool, range(8), seed=1)
        assert io.put_slots(list(range(8)), keys_of(8)) == [True] * 8
        r = io.fetch_slots(keys_of(8), list(range(8, 16)))
        assert r.failed == [] and all(torch.equal(pool.slot(8 + i), want[i]) for i in range(8))
        fill(pool_f, range(4), seed=9)
        fill(pool_g, range(4), seed=10)
        assert forger.put_slots([0, 1, 2, 3], keys_of(4)) == [True] * 4
        assert wrong_key.put_slots([0, 1], keys_of(2)) == [True] * 2
        before = io.stats()
        r = io.fetch_slots(keys_of(8), list(range(16, 24)))
        assert r.failed == [0, 1, 2, 3] and r.transient == []
        assert all(torch.equal(pool.slot(16 + i), want[i]) for i in range(4, 8))
        st = io.stats()
        assert st.unauthenticated - before.unauthenticated == 4
        assert st.rejected - before.rejected == 4
    finally:
        io.close(), forger.close(), wrong_key.close()


def test_secrets_refuse_exposed_short_or_missing_keys(tmp_path):
    base = {"url": "redis://127.0.0.1:9"}
    exposed = _key_file(tmp_path / "exposed", os.urandom(32), mode=0o644)
    with pytest.raises(RemoteSecretError, match="readable by others"):
        RemoteSecrets.load(remote_cfg(tmp_path, **base, auth_key_file=exposed))
    short = _key_file(tmp_path / "short", b"x" * 8)
    with pytest.raises(RemoteSecretError, match="fewer than 32"):
        RemoteSecrets.load(remote_cfg(tmp_path, **base, auth_key_file=short))
    with pytest.raises(RemoteSecretError, match="KVTIER_NO_SUCH_VAR"):
        RemoteSecrets.load(remote_cfg(tmp_path, **base, password_env="KVTIER_NO_SUCH_VAR"),
                           environ={})
    s = RemoteSecrets.load(remote_cfg(tmp_path, **base, password_env="PW"),
                           environ={"PW": "hunter2-secret"})
    assert s.password == "hunter2-secret" and "hunter2" not in repr(s)


def _cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f.read().decode("utf-8", "replace"))
            except OSError:
                pass
    return out


def test_acl_credentials_reach_the_server_never_a_command_line(tmp_path, valkey):
    server = valkey()
    admin = server.client()
    password = "s3cret-" + os.urandom(6).hex()
    admin.execute_command("ACL", "SETUSER", "kvtier", "on", f">{password}", "~*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")  # nobody else gets in
    pw_file = _key_file(tmp_path / "pw", password.encode() + b"\n")
    cfg = remote_cfg(tmp_path, url=server.url, username="kvtier", password_file=pw_file)
    pool, io = open_io(cfg)
    try:
        want = fill(pool, range(4))
        assert io.put_slots([0, 1, 2, 3], keys_of(4)) == [True] * 4
        r = io.fetch_slots(keys_of(4), [4, 5, 6, 7])
        assert r.failed == [] and all(torch.equal(pool.slot(4 + i), want[i]) for i in range(4))
        assert not any(password in c for c in _cmdlines())
        # the scheduler's presence directory authenticates the same way
        presence = connect_remote(cfg, geometry())
        try:
            assert presence.run(presence.count_present([[presence.keys.server_key(k)]
                                                        for k in keys_of(4)])) == [1] * 4
        finally:
            presence.close()
        for child in io._children:  # isolated: -I, started in /, not the test's directory
            assert os.readlink(f"/proc/{child.proc.pid}/cwd") == "/"
            with open(f"/proc/{child.proc.pid}/cmdline", "rb") as f:
                assert b"\0-I\0" in f.read()
    finally:
        io.close()
    wrong = _key_file(tmp_path / "wrong", b"not-the-password\n")
    pool, io = open_io(remote_cfg(tmp_path, url=server.url, username="kvtier",
                                  password_file=wrong))
    try:
        fill(pool, [0])
        assert io.put_slots([0], [b"x"]) == [False]  # refused AUTH: nothing stored, no crash
    finally:
        io.close()


def test_a_hung_io_process_misses_its_deadline_and_is_replaced(tmp_path, valkey):
    cfg = remote_cfg(tmp_path, url=valkey().url, timeout_s=0.2, connect_timeout_s=0.2,
                     retries=0)
    pool, io = open_io(cfg, respawn_after_s=0.5)
    try:
        assert io.warm_up() == 2
        n = 2 * 8  # two children's shares (8 blocks at least each)
        want = fill(pool, range(n))
        assert io.put_slots(list(range(n)), keys_of(n)) == [True] * n
        stopped = io._children[0].proc.pid
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        r = io.fetch_slots(keys_of(n), list(range(n, 2 * n)))
        took = time.monotonic() - t0
        assert took < io._deadline_s(8) + 2  # bounded by the deadline, not by the hang
        assert r.failed and set(r.failed) == set(r.transient)  # lost, not absent
        assert len(r.failed) == 8  # the other child served its share
        time.sleep(0.6)
        r = io.fetch_slots(keys_of(n), list(range(n, 2 * n)))
        assert r.failed == [] and io.respawns >= 1
        assert all(torch.equal(pool.slot(n + i), want[i]) for i in range(n))
        with pytest.raises(ProcessLookupError):
            os.kill(stopped, 0)  # the hung child was killed, not left behind
    finally:
        io.close()


def test_a_dead_server_degrades_the_tier_and_fails_fast(tmp_path, valkey):
    server = valkey()
    cfg = remote_cfg(tmp_path, url=server.url, timeout_s=0.2, connect_timeout_s=0.2,
                     probe_interval_s=30)
    pool, io = open_io(cfg)
    try:
        fill(pool, range(4))
        assert io.put_slots([0, 1, 2, 3], keys_of(4)) == [True] * 4
        server.kill()
        r = io.fetch_slots(keys_of(4), [4, 5, 6, 7])
        assert r.failed == [0, 1, 2, 3] == r.transient and io.health.degraded
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            io.fetch_slots(keys_of(4), [4, 5, 6, 7])
        assert time.monotonic() - t0 < 0.1  # no socket touched while degraded
    finally:
        io.close()


def _tls_server_binary() -> str | None:
    """A redis-server / valkey-server built with TLS (Debian's redis-server is)."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path and b"tls-port" in subprocess.run([path, "--help"], capture_output=True).stdout \
                + open(path, "rb").read():
            return path
    return None


def test_tls_with_a_ca_file_against_a_tls_server(tmp_path):
    binary = _tls_server_binary()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server built with TLS and openssl (Debian: apt install "
                    "redis-server openssl; CI installs them)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = __import__("support.valkey_servers", fromlist=["free_port"]).free_port()
    proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind",
                             "127.0.0.1", "--tls-cert-file", str(cert), "--tls-key-file",
                             str(key), "--tls-auth-clients", "no", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cfg = remote_cfg(tmp_path, url=f"rediss://127.0.0.1:{port}/0",
                         tls_ca_file=str(cert))
        pool, io = open_io(cfg)
        try:
            deadline = time.monotonic() + 10
            while io.warm_up() < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            want = fill(pool, range(4))
            assert io.put_slots([0, 1, 2, 3], keys_of(4)) == [True] * 4
            r = io.fetch_slots(keys_of(4), [4, 5, 6, 7])
            assert r.failed == []
            assert all(torch.equal(pool.slot(4 + i), want[i]) for i in range(4))
            presence = connect_remote(cfg, geometry())  # the scheduler's directory: TLS too
            try:
                assert presence.run(presence.count_present(
                    [[presence.keys.server_key(k)] for k in keys_of(4)])) == [1] * 4
            finally:
                presence.close()
        finally:
            io.close()
        # without the CA the server's certificate is not trusted: nothing is stored
        untrusted = remote_cfg(tmp_path, url=f"rediss://127.0.0.1:{port}/0")
        pool, io = open_io(untrusted)
        try:
            fill(pool, [0])
            assert io.put_slots([0], [b"x"]) == [False]
        finally:
            io.close()
    finally:
        proc.kill()
        proc.wait()


def test_block_io_in_process_matches_the_children(tmp_path, valkey):
    """The children run RemoteBlockIO; the same class over a plain buffer reads what they wrote."""
    cfg = remote_cfg(tmp_path, url=valkey().url)
    pool, io = open_io(cfg)
    try:
        want = fill(pool, range(3))
        assert io.put_slots([0, 1, 2], keys_of(3)) == [True] * 3
    finally:
        io.close()
    buf = bytearray(3 * BLOCK)
    direct = RemoteBlockIO(cfg, remote_keys(cfg, geometry()), RemoteSecrets(),
                           lambda s: memoryview(buf)[s * BLOCK:(s + 1) * BLOCK], BLOCK)
    try:
        assert direct.fetch(keys_of(3), [0, 1, 2]).failed == []
        assert all(bytes(buf[i * BLOCK:(i + 1) * BLOCK]) == want[i].numpy().tobytes()
                   for i in range(3))
    finally:
        direct.close()


def test_io_processes_run_on_every_cpu_though_the_worker_is_pinned(tmp_path, valkey):
    """An engine process pinned to a few cores (NUMA binding) must not squeeze its I/O
    processes onto them: a single hit's promotion then moves at a fraction of the server's
    speed. The children widen the affinity they inherited."""
    every = set(range(os.cpu_count() or 1))
    if len(every) < 2:
        pytest.skip("needs a machine with 2 or more CPUs to pin the worker to fewer")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(every)})
    try:
        pool, io = open_io(remote_cfg(tmp_path, url=valkey().url))
    finally:
        os.sched_setaffinity(0, before)
    try:
        assert io.warm_up() == 2
        for child in io._children:
            assert os.sched_getaffinity(child.proc.pid) == every
    finally:
        io.close()


def test_each_io_process_spreads_a_batch_over_its_connections(tmp_path, valkey):
    """One hit's blocks go over ``connections`` connections per process and node (a server
    serves each connection at a bounded rate); bytes stay exact and in order."""
    server = valkey()
    cfg = remote_cfg(tmp_path, url=server.url, io_processes=1, connections=3)
    pool, io = open_io(cfg)
    try:
        assert io.warm_up() == 1
        clients = server.client().client_list()
        assert len([c for c in clients if c.get("name", "") == "" and c["cmd"] != "client|list"]) \
            >= 3  # the child's three connections
        want = fill(pool, range(10), seed=5)
        assert io.put_slots(list(range(10)), keys_of(10)) == [True] * 10
        r = io.fetch_slots(keys_of(10)[::-1], list(range(10, 20)))
        assert r.failed == []
        assert all(torch.equal(pool.slot(10 + i), want[9 - i]) for i in range(10))
    finally:
        io.close()


def test_a_fetch_reports_slots_verified_while_it_runs(tmp_path, valkey):
    """A load's copies to the GPU start on the slots a fetch reports before it ends
    (kvtier.transfer.early): each reported slot must hold its block's exact bytes already,
    and be neither a miss nor reported twice."""
    n = 120  # one I/O process, several hash batches (16 blocks of 256 KiB each)
    cfg = remote_cfg(tmp_path, url=valkey().url, io_processes=1)
    geo = geometry()
    pool = CpuBlockPool(geo, 2 * n + 1, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg))
    try:
        want = fill(pool, range(n), seed=3)
        assert io.put_slots(list(range(n)), keys_of(n, "r")) == [True] * n
        dst = list(range(n, 2 * n + 1))
        for s in dst:
            pool.slot(s).zero_()
        reports: list[list[int]] = []
        exact_when_reported: list[bool] = []

        def ready(slots):
            reports.append(list(slots))
            exact_when_reported.extend(torch.equal(pool.slot(s), want[s - n]) for s in slots)

        r = io.fetch_slots(keys_of(n, "r") + [b"never-stored"], dst, ready)
    finally:
        io.close()
    assert r.failed == [n] and r.transient == []
    reported = [s for batch in reports for s in batch]
    assert reports and len(reported) < n  # some early, the last ones only in the reply
    assert len(set(reported)) == len(reported) and set(reported) <= set(dst[:n])
    assert all(exact_when_reported)
    assert all(torch.equal(pool.slot(n + i), want[i]) for i in range(n))


def test_a_partial_reply_that_does_not_fit_its_request_is_junk():
    from kvtier.tiers.child import wire
    from kvtier.tiers.remote.io.process import _part_positions

    assert _part_positions(memoryview(b'{"ready": [0, 3]}'), 4) == [0, 3]
    for junk in (b'{"ready": [4]}', b'{"ready": [-1]}', b'{"ready": "01"}', b'{"ready": [1.0]}',
                 b'{"other": []}', b"[]", b"\xff"):
        with pytest.raises(wire.WireError):
            _part_positions(memoryview(junk), 4)


def test_a_promotion_reports_its_progress_for_the_cost_model(tmp_path, valkey):
    """The REMOTE -> CPU handler's outcome carries (bytes verified, seconds) points taken as the
    read went on: cumulative, rising, below the whole hop (measured_hops feeds them to the
    cost model, which splits the tier's per-job latency from its bandwidth)."""
    import asyncio

    from kvtier.manager.specs import LoadStoreSpec
    from kvtier.transfer.remote_io import RemoteToCpuHandler

    n = 120
    cfg = remote_cfg(tmp_path, url=valkey().url, io_processes=1)
    geo = geometry()
    pool = CpuBlockPool(geo, 2 * n, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg))
    try:
        fill(pool, range(n), seed=4)
        assert io.put_slots(list(range(n)), keys_of(n, "p")) == [True] * n
        out = asyncio.run(RemoteToCpuHandler(pool, io).run(
            LoadStoreSpec.remote(keys_of(n, "p")), LoadStoreSpec.cpu(range(n, 2 * n))))
    finally:
        io.close()
    assert out.bytes == n * BLOCK and out.failed_keys == ()
    points = list(out.progress)
    assert points, "a read of several hash batches reports progress"
    sizes, times = [b for b, _ in points], [s for _, s in points]
    assert sizes == sorted(sizes) and times == sorted(times) and 0 < sizes[-1] < n * BLOCK
    assert all(b % BLOCK == 0 for b in sizes)


def test_an_io_process_lost_after_reporting_blocks_fails_them_all(tmp_path, valkey):
    """A block reported verified may already be on its way to the GPU; if its I/O process is
    then lost before it answers, the whole share (the reported blocks included) is a
    transient miss, so the load distrusts what it copied and vLLM recomputes it."""
    n = 360  # the first report comes at an eighth: the rest is far from answered by then
    cfg = remote_cfg(tmp_path, url=valkey().url, io_processes=1)
    geo = geometry()
    pool = CpuBlockPool(geo, 2 * n, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg),
                           respawn_after_s=0.2)
    try:
        fill(pool, range(n), seed=5)
        assert io.put_slots(list(range(n)), keys_of(n, "x")) == [True] * n
        dst = list(range(n, 2 * n))
        reported: list[int] = []

        def kill_on_first_report(slots):
            if not reported:
                os.kill(io._children[0].proc.pid, signal.SIGKILL)
            reported.extend(slots)

        r = io.fetch_slots(keys_of(n, "x"), dst, kill_on_first_report)
        assert reported, "the read reported blocks before its process was lost"
        lost = {dst[i] for i in r.failed}
        assert set(reported) <= lost and set(r.failed) == set(r.transient)
        assert len(r.failed) == n  # one process: its whole share
        time.sleep(0.3)
        assert io.fetch_slots(keys_of(n, "x"), dst).failed == []  # a new process serves
        assert io.respawns >= 1
    finally:
        io.close()

