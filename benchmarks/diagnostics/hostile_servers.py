"""Issue 48's targets, measured: the shared tier against slow, flooding and hostile servers.

Each part runs in its own child process (``--part NAME``) under a wall-clock limit, so one
that hangs is reported as such and never holds the script; the hostile fake servers run in
their own processes too, so their buffers do not count in the measured process's memory.

* ``lookups``: a fake RESP server (tests/support/fake_resp.py) that drips its EXISTS reply, one
  that drips CLUSTER SLOTS, one that floods CLUSTER SLOTS with entries, one that answers EXISTS
  with an endless array and one with a 1 GB bulk; ``flood_slots_big`` announces 60,000 slot
  entries (under the item cap) with 8 KiB host names each. The production ``RemoteDirectory``
  is asked about batches of 16 keys, polled every 2 ms (what the scheduler does each step):
  the longest any lookup stays pending, against ``remote.lookup_deadline_s``; the longest one
  presence batch holds the asker thread; the process's RSS growth (VmHWM after - VmRSS
  before) over the floods, against 16 MiB.
* ``stopped_child``: real Valkey, the real ``RemoteIOProcesses`` (4 children, 64 KiB blocks):
  a 256-block fetch with every child answering (the measured speed), then the same fetch with
  one child SIGSTOPped: its wall time against 2 s + 2 x bytes / measured speed.
* ``junk``: a keyless client plants junk under most of the keys an honest writer will write;
  two honest instances (the real manager + directory, the writes done as the I/O would) each
  look every block up, load the hits (a hit is honest only if the value is a valid record),
  store the rest; the second run's honest hits against the same on a clean server (target:
  within 5 %).

    PYTHONPATH=. python benchmarks/diagnostics/hostile_servers.py [--parts lookups,junk]
        [--json out.json] [--part-timeout-s 240]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

PARTS = ("lookups", "stopped_child", "junk")
MiB = 1 << 20


def rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            vals[line.split(":")[0]] = int(line.split()[1])
    return vals["VmRSS"], vals["VmHWM"]


# ---- hostile fake servers (each in its own process: ``--serve MODE``) ----------------------

def _drip(conn, data: bytes, gap_s: float = 0.2) -> None:
    for b in data:
        time.sleep(gap_s)
        conn.sendall(bytes([b]))


def _flood(conn, head: bytes, item: bytes, limit: int = 1 << 30) -> None:
    conn.sendall(head)
    chunk = item * max(1, MiB // len(item))
    sent = 0
    while sent < limit:
        conn.sendall(chunk)
        sent += len(chunk)


def serve(mode: str) -> None:
    from support.fake_resp import FakeResp

    port_holder = {}

    def slots_entry() -> bytes:
        return (b"*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port_holder["p"])

    def answer(args, conn):
        cmd = b" ".join(a.upper() for a in args[:2])
        if args[0].upper() == b"PING":
            return b"+PONG\r\n"
        if cmd == b"CLUSTER SLOTS":
            if mode == "drip_slots":
                _drip(conn, b"*1\r\n" + slots_entry() * 1)
                return None
            if mode == "flood_slots":
                _flood(conn, b"*100000000\r\n", slots_entry())
                return None
            if mode == "flood_slots_big":  # a count under the item cap, fat host names
                host = b"h" * 8192
                _flood(conn, b"*60000\r\n", b"*3\r\n:0\r\n:0\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n"
                       % (len(host), host, port_holder["p"]))
                return None
            return b"*1\r\n" + slots_entry()
        if args[0].upper() == b"EXISTS":
            if mode == "drip_exists":
                _drip(conn, b":" + b"1" * 200 + b"\r\n")
                return None
            if mode == "flood_array":
                _flood(conn, b"*100000000\r\n", b":1\r\n")
                return None
            if mode == "flood_bulk":
                _flood(conn, b"$1000000000\r\n", b"\0" * 4096)
                return None
            return b":1\r\n"
        return b"+OK\r\n"

    server = FakeResp(answer)
    port_holder["p"] = server.port
    print(server.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.close()


def start_fake(mode: str):
    proc = subprocess.Popen([sys.executable, __file__, "--serve", mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, port


# ---- part 1: lookups against dripping and flooding servers ---------------------------------

def part_lookups(args) -> dict:
    from kvtier.config import load_config
    from kvtier.tiers.remote import RemoteKeys, RemoteStore
    from kvtier.tiers.remote.directory import RemoteDirectory
    from kvtier.tiers.remote.exists import PresenceQueries
    from kvtier.tiers.remote.health import RemoteHealth
    from kvtier.tiers.remote.secrets import RemoteSecrets

    modes = [("drip_exists", False), ("drip_slots", True), ("flood_slots", True),
             ("flood_array", False), ("flood_bulk", False),
             ("flood_slots_big", True)]  # last: VmHWM keeps its peak for the modes after it
    out = {"modes": {}}
    rss0, _ = rss_kib()
    deadline_s = None
    for mode, cluster in modes:
        proc, port = start_fake(mode)
        remote = {"timeout_s": 1.0, "connect_timeout_s": 1.0, "probe_interval_s": 0.3}
        if cluster:
            remote["nodes"] = [f"127.0.0.1:{port}"]
        else:
            remote["url"] = f"redis://127.0.0.1:{port}"
        cfg = load_config(data={"tiers": {"remote": remote}}, env={}).remote
        deadline_s = cfg.lookup_deadline_s
        before = rss_kib()
        longest = asker_s = 0.0
        answers = {"present": 0, "absent": 0}
        late = 0
        t_mode = time.monotonic()
        try:
            for rnd in range(args.rounds):  # a fresh instance each round: not yet degraded
                store = RemoteStore(cfg, RemoteKeys(f"ns-{mode}", "geo"))
                directory = RemoteDirectory(store)
                try:
                    keys = [b"%s-%d-%d" % (mode.encode(), rnd, i) for i in range(16)]
                    t0 = time.monotonic()
                    while True:
                        got = directory.query(keys)
                        if all(g is not None for g in got):
                            break
                        time.sleep(0.002)
                    longest = max(longest, time.monotonic() - t0)
                    answers["present"] += sum(1 for g in got if g)
                    answers["absent"] += sum(1 for g in got if not g)
                    late += directory.late_answers
                finally:
                    directory.close()
                    store.close()
                # how long one presence batch holds the asker thread (no directory on top)
                presence = PresenceQueries(cfg, RemoteSecrets(), RemoteHealth(60.0))
                t0 = time.monotonic()
                counted = presence.count_present([[b"direct-%d" % i] for i in range(16)])
                asker_s = max(asker_s, time.monotonic() - t0)
                presence.close()
        finally:
            proc.stdin.close()
            proc.wait(timeout=10)
        after = rss_kib()
        out["modes"][mode] = {
            "longest_pending_s": round(longest, 3), "answers": answers,
            "asker_batch_s": round(asker_s, 3), "asker_answer": counted[:2],
            "late_answers": late,
            "rss_growth_mib": round((after[1] - before[0]) / 1024, 1),
            "mode_wall_s": round(time.monotonic() - t_mode, 2)}
    rss1, hwm1 = rss_kib()
    out["lookup_deadline_s"] = deadline_s
    out["longest_pending_s"] = max(m["longest_pending_s"] for m in out["modes"].values())
    out["rss_growth_mib"] = round((hwm1 - rss0) / 1024, 1)  # peak over all modes vs start
    out["pass_pending"] = out["longest_pending_s"] <= deadline_s + 0.05  # one poll + a step
    out["pass_rss"] = out["rss_growth_mib"] <= 16
    return out


# ---- part 2: a SIGSTOPped I/O child --------------------------------------------------------

def part_stopped_child(args) -> dict:
    import torch

    from kvtier.config import load_config
    from kvtier.tiers.cpu_pool import CpuBlockPool
    from kvtier.tiers.layout import BlockGeometry
    from kvtier.tiers.remote.io.process import RemoteIOProcesses
    from kvtier.tiers.remote.secrets import RemoteSecrets
    from kvtier.tiers.remote.wire.connect import remote_keys
    from support.valkey_servers import Server

    block, n, children = 64 << 10, 256, args.io_processes
    work = Path(tempfile.mkdtemp(prefix="kvtier-hostile-"))
    server = Server(work)
    geo = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1,
                        page_bytes=block // 2, model="hostile")
    cfg = load_config(data={"tiers": {"cpu": {"capacity": f"{3 * n * block}", "pin": False},
                                      "remote": {"url": server.url, "timeout_s": 5.0,
                                                 "connect_timeout_s": 1.0, "retries": 2,
                                                 "io_processes": children}}}, env={}).remote
    pool = CpuBlockPool(geo, 3 * n, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg),
                           respawn_after_s=0.2)
    out = {"blocks": n, "block_bytes": block, "io_processes": children}
    try:
        out["ready_children"] = io.warm_up()
        g = torch.Generator().manual_seed(0)
        for s in range(n):
            pool.slot(s).copy_(torch.randint(0, 256, (block,), dtype=torch.uint8, generator=g))
        keys = [b"blk-%d" % i for i in range(n)]
        assert all(io.put_slots(list(range(n)), keys))
        runs = []
        for _ in range(3):
            t0 = time.monotonic()
            r = io.fetch_slots(keys, list(range(n, 2 * n)))
            runs.append(time.monotonic() - t0)
            assert not r.failed
        healthy_s = sorted(runs)[1]  # the median of three
        speed = n * block / healthy_s
        out["healthy_fetch_s"] = [round(x, 3) for x in runs]
        out["measured_speed_mb_s"] = round(speed / 1e6, 1)
        trials = []
        for trial in range(args.trials):
            io.warm_up()  # the replaced child is back
            tier_speed = io.speed_bps
            stopped = io._children[trial % children].proc.pid
            os.kill(stopped, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                r = io.fetch_slots(keys, list(range(2 * n, 3 * n)))
                took = time.monotonic() - t0
            finally:
                try:
                    os.kill(stopped, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            bad = set(r.failed)
            wrong = sum(1 for i in range(n) if i not in bad
                        and not torch.equal(pool.slot(2 * n + i), pool.slot(i)))
            trials.append({"fetch_s": round(took, 3), "loaded": n - len(bad),
                           "failed": len(bad), "wrong_blocks": wrong,
                           "tier_speed_mb_s": round(tier_speed / 1e6, 1),
                           "target_tier_s": round(2.0 + 2 * n * block / tier_speed, 3),
                           "target_measured_s": round(2.0 + 2 * n * block / speed, 3)})
            pool_clear = torch.zeros(block, dtype=torch.uint8)
            for i in range(n):
                pool.slot(2 * n + i).copy_(pool_clear)
        out["trials"] = trials
        out["worst_fetch_s"] = max(t["fetch_s"] for t in trials)
        out["pass_tier_speed"] = all(t["fetch_s"] <= t["target_tier_s"] for t in trials)
        out["pass_measured_speed"] = all(t["fetch_s"] <= t["target_measured_s"] for t in trials)
        out["wrong_blocks"] = sum(t["wrong_blocks"] for t in trials)
    finally:
        io.close()
        server.stop()
    return out


# ---- part 3: planted junk vs honest hits ---------------------------------------------------

def part_junk(args) -> dict:
    from kvtier.tiers.remote import RemoteKeys
    from support.valkey_servers import Server

    work = Path(tempfile.mkdtemp(prefix="kvtier-junk-"))
    names = RemoteKeys("ns-junk", "geo")
    keys = [b"blk-%d" % i for i in range(args.junk_keys)]
    planted = keys[: int(len(keys) * 0.85)]
    out = {"keys": len(keys), "planted": len(planted), "max_writes_in_flight": 4}
    for label, plant in (("clean", False), ("junk", True)):
        server = Server(work)
        raw = server.client()
        try:
            if plant:
                for k in planted:
                    raw.set(names.server_key(k), b"junk from a keyless client " + k)
            runs = [_honest_run(server.url, names, keys, raw) for _ in range(2)]
            valid = sum(1 for k in keys if raw.get(names.server_key(k)) == _record(names, k))
            out[label] = {"runs": runs, "valid_records_after": valid,
                          "junk_left": len(keys) - valid}
        finally:
            server.stop()
    clean, junk = out["clean"]["runs"][1]["honest_hits"], out["junk"]["runs"][1]["honest_hits"]
    out["honest_hits_clean"], out["honest_hits_junk"] = clean, junk
    out["pass"] = abs(clean - junk) <= 0.05 * clean
    return out


def _record(names, block_key: bytes, payload: bytes = b"v" * 64) -> bytes:
    """A valid record for ``block_key`` (no MAC key), as the honest instance's I/O writes it."""
    from kvtier.tiers.layout import LAYOUT_VERSION
    from kvtier.tiers.record import data_checksum, encode_head

    rk = names.record_key(names.server_key(block_key))
    return encode_head(rk, codec=0, layout_version=LAYOUT_VERSION, seq=0, raw_len=len(payload),
                       stored_len=len(payload), checksum=data_checksum(rk, payload)) + payload


def _honest_run(url, names, keys, raw) -> dict:
    """One honest instance: look every block up, load each hit (honest only if the value is a
    valid record), store what it recomputed; write-back driven as the transfer layer does,
    the bytes written by the plain client."""
    from kvtier.config import load_config
    from kvtier.manager.factory import build_manager
    from kvtier.manager.specs import Medium
    from kvtier.tiers.remote import RemoteStore
    from kvtier.tiers.remote.directory import RemoteDirectory

    cfg = load_config(data={"tiers": {"cpu": {"capacity": "64MiB"},
                                      "remote": {"url": url, "max_writes_in_flight": 4,
                                                 "timeout_s": 1.0}}}, env={})
    store = RemoteStore(cfg.remote, names)
    directory = RemoteDirectory(store)
    manager = build_manager(cfg, 64 << 10, remote=directory)
    hits = honest = 0
    try:
        deadline = time.monotonic() + 20
        while any(g is None for g in directory.query(keys)) and time.monotonic() < deadline:
            time.sleep(0.005)
        recompute, written = [], 0

        def drive() -> int:
            """Runs what the transfer layer would: REMOTE -> CPU promotions (a load succeeds
            only if the value is a valid record) and write-backs (the bytes set here)."""
            done = 0
            for _ in range(10 * len(keys) + 10):
                t_end = time.monotonic() + 10
                while directory.pending() and time.monotonic() < t_end:
                    time.sleep(0.002)
                batch = manager.take_background_transfers()
                if not batch:
                    return done
                for t in batch:
                    if t.src.medium is Medium.REMOTE:
                        ok = all(raw.get(names.server_key(k)) == _record(names, k)
                                 for k in t.keys)
                        manager.complete_background(t.id, ok)
                        continue
                    if t.dst.medium is Medium.REMOTE:
                        for k in t.keys:
                            raw.set(names.server_key(k), _record(names, k))
                        done += len(t.keys)
                    manager.complete_background(t.id, True)
            return done

        for k in keys:
            for _ in range(20):
                found = manager.lookup([k])
                if not found.pending:
                    break
                written += drive()
            if found.num_hits:
                hits += 1
                honest += 1  # a REMOTE hit now CPU-resident: its load verified
                continue
            recompute.append(k)  # a miss, or a hit whose load failed verification
        manager.prepare_store(recompute)
        manager.complete_store(recompute)
        written += drive()
        held = manager.stats.snapshot().get("remote_writes_already_held")
    finally:
        directory.close()
        store.close()
    return {"lookup_hits": hits, "honest_hits": honest, "recomputed": len(recompute),
            "written": written, "skipped_as_held": held}


# ---- driver --------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--part", help=argparse.SUPPRESS)  # run one part here, print its JSON
    p.add_argument("--serve", help=argparse.SUPPRESS)  # be a hostile fake server
    p.add_argument("--part-timeout-s", type=float, default=240.0)
    p.add_argument("--rounds", type=int, default=3, help="lookup batches per server mode")
    p.add_argument("--io-processes", type=int, default=4)
    p.add_argument("--trials", type=int, default=3, help="SIGSTOPped fetches")
    p.add_argument("--junk-keys", type=int, default=360)
    p.add_argument("--json", help="write all figures here")
    args = p.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.part:
        res = globals()[f"part_{args.part}"](args)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results = {}
    for part in [x for x in args.parts.split(",") if x]:
        cmd = [sys.executable, __file__, "--part", part, "--rounds", str(args.rounds),
               "--io-processes", str(args.io_processes),
               "--trials", str(args.trials), "--junk-keys", str(args.junk_keys)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # its servers die with it
        try:
            stdout, stderr = proc.communicate(timeout=args.part_timeout_s)
            line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            results[part] = (json.loads(line[-1][7:]) if line else
                             {"error": f"rc {proc.returncode}: {stderr[-600:]}"})
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            results[part] = {"error": f"timed out after {args.part_timeout_s:.0f} s"}
        results[part]["part_wall_s"] = round(time.monotonic() - t0, 1)
        print(f"{part}: {json.dumps(results[part], indent=1)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
