"""The shared tier between real vLLM instances on GPUs: REMOTE hits and round-robin multi-turn.

Starts one Valkey server on 127.0.0.1 (``--cluster``: a 3-primary Cluster), with
``--io-threads``, then runs real vLLM engines (``vllm_remote_child.py``, one process each; with
two GPUs one instance per GPU):

* ``ttft``: instance A stores ``--reps`` prompts of each ``--lengths`` into kvtier (CPU tier +
  shared tier) and exits once the server holds them; a FRESH instance B then asks for each
  prompt once: a REMOTE hit (the very first one is B's first request after start-up), then
  the same prompt again after vLLM's GPU prefix cache was reset (a CPU hit), and a prompt of
  the same length nobody stored (recompute). Tokens of 8-token greedy answers to other stored
  prompts are compared between A (computed) and B (loaded from the shared tier).
* ``roundrobin``: ``--conversations`` conversations of ``--turns`` turns (each turn: the
  whole conversation so far plus ``--new-tokens`` user tokens, a 1-token answer, so a
  request's latency is its TTFT) routed round-robin between two instances with a router that
  ignores prefixes: each conversation's next turn lands on the other instance, after
  ``--think-ms``. Per configuration (kvtier with private CPU tiers; the same plus the shared
  tier; vLLM's native CPU offloading): requests/s and TTFT p50/p99. Each instance serves one
  request at a time.

    python benchmarks/vllm_remote.py --phases ttft,roundrobin [--cluster] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support.valkey_servers import Server, start_cluster  # noqa: E402

TAG = "@@kv "
VOCAB = 128256


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB - 1) for _ in range(n)]


class Instance:
    """One ``vllm_remote_child.py`` process and its command pipe."""

    def __init__(self, name: str, gpu: str, connector: str, args, remote: dict | None,
                 log_dir: Path, gpu_kv_bytes: int) -> None:
        self.name = name
        cmd = [sys.executable, str(HERE / "vllm_remote_child.py"), "--connector", connector,
               "--shape", args.shape, "--model-dir", str(log_dir / f"model-{args.shape}"),
               "--max-len", str(args.max_len), "--cpu-bytes", str(args.cpu_bytes),
               "--gpu-kv-bytes", str(gpu_kv_bytes),
               "--snapshot", str(log_dir / f"{name}-snapshot.json")]
        if remote is not None:
            cmd += ["--remote", json.dumps(remote)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, VLLM_USE_FLASHINFER_SAMPLER="0")
        if args.timeline:  # kvtier's per-step marks of this instance (where a hit's time goes)
            env["KVTIER_TIMELINE"] = str(Path(args.timeline) / f"{name}-timeline.jsonl")
            # the engine process may be killed at shutdown before it writes its marks
            env["KVTIER_TIMELINE_FLUSH_S"] = "1"
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.ready: dict = {}

    def wait_ready(self) -> "Instance":
        self.ready = self._answer()
        return self

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.log.write(line)
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}); see {self.log.name}")

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.call(op="quit")
        except (OSError, RuntimeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        self.log.close()


def server_keys(servers: list[Server]) -> int:
    return sum(int(s.client().dbsize()) for s in servers)


def wait_written(servers: list[Server], inst: Instance, quiet_s: float = 3.0,
                 limit_s: float = 240.0) -> int:
    """Until the server's key count stopped growing for ``quiet_s`` (write-back done)."""
    last, since, end = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < end:
        inst.call(op="settle", seconds=0.2)
        n = server_keys(servers)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


def phase_ttft(args, remote: dict, servers: list[Server], gpus: list[str], logs: Path) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    stored = {L: [tokens(L, 1000 * L + r) for r in range(args.reps)] for L in lengths}
    checked = {L: tokens(L, 7 * L + 1) for L in lengths}
    a = Instance("A", gpus[0], "kvtier_remote", args, remote, logs,
                 args.gpu_kv_bytes).wait_ready()
    out: dict = {"start_s": {"A": a.ready["start_s"]}}
    want = {}
    try:
        for L in lengths:
            for p in stored[L]:
                a.call(op="gen", prompt=p)
            want[L] = a.call(op="gen", prompt=checked[L], max_tokens=8)["tokens"]
        out["server_keys"] = wait_written(servers, a)
        out["stats_A"] = a.call(op="stats")
    finally:
        a.close()
    b = Instance("B", gpus[-1], "kvtier_remote", args, remote, logs,
                 args.gpu_kv_bytes).wait_ready()
    out["start_s"]["B"] = b.ready["start_s"]
    rows = {}
    try:
        for L in lengths:
            row = {"remote": [], "remote_cached": [], "cpu": [], "recompute": []}
            for r, p in enumerate(stored[L]):
                got = b.call(op="gen", prompt=p)
                row["remote"].append(got["ms"])
                row["remote_cached"].append(got["cached"])
                if L == lengths[0] and r == 0:
                    out["first_hit_after_start"] = got
                b.call(op="settle", seconds=0.1)
                b.call(op="reset")
                got = b.call(op="gen", prompt=p)
                row["cpu"].append(got["ms"])
                row["recompute"].append(b.call(op="gen", prompt=tokens(L, 555 * L + r))["ms"])
                b.call(op="reset")
            got = b.call(op="gen", prompt=checked[L], max_tokens=8)
            row["tokens_equal"] = got["tokens"] == want[L]
            row["check_cached"] = got["cached"]
            rows[L] = row
        out["stats_B"] = b.call(op="stats")
    finally:
        b.close()
    out["rows"] = rows
    return out


def phase_roundrobin(args, remote: dict | None, connector: str, gpus: list[str],
                     logs: Path) -> dict:
    two = len(gpus) > 1
    kv = args.gpu_kv_bytes if two else args.gpu_kv_bytes // 2
    insts = [Instance(f"rr-{connector}-{i}", gpus[i % len(gpus)], connector, args, remote,
                      logs, kv) for i in range(2)]
    for inst in insts:  # both engines start at once
        inst.wait_ready()
    lock = threading.Lock()
    queues: list[list] = [[], []]
    cv = threading.Condition(lock)
    latencies: list[float] = []
    cached: list[int] = []
    per_turn: dict[int, list[tuple[float, int]]] = {}  # turn -> (ms, cached tokens)
    convs = {c: tokens(args.first_tokens, 90000 + c) for c in range(args.conversations)}
    left = [args.conversations * args.turns]

    def submit(c: int, turn: int, at: float) -> None:
        with cv:
            queues[(c + turn) % 2].append((at, c, turn))
            cv.notify_all()

    def serve(i: int) -> None:
        while True:
            with cv:
                while left[0] > 0 and not any(at <= time.monotonic() for at, _, _ in queues[i]):
                    cv.wait(0.01)
                if left[0] <= 0:
                    return
                job = min((j for j in queues[i] if j[0] <= time.monotonic()))
                queues[i].remove(job)
            _, c, turn = job
            got = insts[i].call(op="gen", prompt=convs[c])
            with cv:
                latencies.append(got["ms"])
                cached.append(got["cached"])
                per_turn.setdefault(turn, []).append((got["ms"], got["cached"]))
                left[0] -= 1
                convs[c] = convs[c] + got["tokens"] + tokens(args.new_tokens, 31 * c + turn)
                cv.notify_all()
            if turn + 1 < args.turns:
                submit(c, turn + 1, time.monotonic() + args.think_ms / 1e3)

    try:
        t0 = time.monotonic()
        for c in range(args.conversations):
            submit(c, 0, t0)
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        stats = [summary(inst.call(op="stats")) for inst in insts] \
            if connector.startswith("kvtier") else []
    finally:
        for inst in insts:
            inst.close()
    n = len(latencies)
    return {"connector": connector, "requests": n, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 3), "ttft_p50_ms": pct(latencies, 0.5),
            "ttft_p99_ms": pct(latencies, 0.99), "cached_tokens": sum(cached),
            "think_ms": args.think_ms, "conversations": args.conversations,
            "first_tokens": args.first_tokens, "new_tokens": args.new_tokens,
            "turns": {t: {"ttft_p50_ms": med([m for m, _ in v]),
                          "cached_tokens": sum(c for _, c in v)}
                      for t, v in sorted(per_turn.items())},
            "kvtier": stats, "start_s": [inst.ready["start_s"] for inst in insts]}


def summary(stats: dict) -> dict:
    """What explains a configuration's figures: hits per tier, hits declined as slower than
    recompute, presence answers still pending when asked, the cost model's estimates."""
    m = stats.get("manager", {})
    keep = ("hit_blocks", "stored_blocks", "skipped_slower_than_recompute",
            "remote_pending_lookups", "remote_writes_skipped", "failed_loads", "lookups")
    return {**{k: m.get(k) for k in keep}, "cost": stats.get("cost")}


def gpu_list() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["0"]
    return [line.split(",")[0].strip() for line in out.splitlines() if line.strip()] or ["0"]


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].strip().replace(" ", "-")
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown-gpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="ttft,roundrobin")
    ap.add_argument("--cluster", action="store_true", help="a 3-primary Cluster, not one server")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--io-processes", type=int, default=8, help="kvtier's tiers.remote.io_processes")
    ap.add_argument("--shape", default="8b", choices=["8b", "1b"])
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=34000)
    ap.add_argument("--cpu-bytes", type=int, default=16 << 30)
    ap.add_argument("--gpu-kv-bytes", type=int, default=24 << 30)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--think-ms", type=float, default=300.0)
    ap.add_argument("--configs", default="kvtier,kvtier_remote,native")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--timeline", default=None, help="a folder for each instance's timeline")
    ap.add_argument("--gpus", default=None,
                    help="comma list of GPU indexes the instances use (default: every GPU); "
                         "with one, both instances share it")
    ap.add_argument("--server-args", default="",
                    help='more server settings, e.g. "--events-per-io-thread 0" (Valkey 8+)')
    args = ap.parse_args()
    gpus = args.gpus.split(",") if args.gpus else gpu_list()
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-remote-"))
    extra = ("--io-threads", str(args.io_threads), "--maxmemory", "100gb",
             "--maxmemory-policy", "allkeys-lru", *args.server_args.split())
    servers = start_cluster(work, 3, *extra) if args.cluster else [Server(work, *extra)]
    remote = ({"nodes": [s.node for s in servers]} if args.cluster else {"url": servers[0].url})
    remote.update(io_processes=args.io_processes, timeout_s=2.0)
    result: dict = {"gpu": gpu_name(), "gpus": len(gpus), "shape": args.shape,
                    "cluster": args.cluster, "io_threads": args.io_threads,
                    "server_args": args.server_args,
                    "io_processes": args.io_processes, "cpu_count": os.cpu_count()}
    try:
        if "ttft" in args.phases:
            result["ttft"] = phase_ttft(args, remote, servers, gpus, work)
            for s in servers:
                s.client().flushall()
            print(json.dumps({k: v for k, v in result["ttft"].items()
                              if not k.startswith("stats")}, indent=1), flush=True)
        if "roundrobin" in args.phases:
            result["roundrobin"] = []
            for connector in args.configs.split(","):
                rr = phase_roundrobin(args, remote if connector == "kvtier_remote" else None,
                                      connector, gpus, work)
                print(json.dumps(rr), flush=True)
                result["roundrobin"].append(rr)
                for s in servers:
                    s.client().flushall()
    finally:
        for s in servers:
            s.stop()
    os.makedirs(args.out_dir, exist_ok=True)
    layout = "cluster" if args.cluster else "standalone"
    path = Path(args.out_dir) / f"vllm_remote_{result['gpu']}_{layout}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
