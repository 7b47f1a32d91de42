"""Blocks shared between real vLLM instances on GPUs: hits on another's blocks, round-robin turns.

Two ways for the instances to share (``--tier``):

* ``remote`` (the default): kvtier's shared tier on one Valkey server on 127.0.0.1
  (``--cluster``: a 3-primary Cluster), with ``--io-threads``;
* ``host``: kvtier's host tier (``tiers.host``): one CPU pool per host, each instance's CPU
  tier its region of it, its service started by the first instance with its socket in a fresh
  ``0700`` directory (``--host-dir``, default under /dev/shm). No server. An instance's blocks
  stay in the pool only while it runs, so the instance that stored them must stay alive.

The engines are real (``vllm_remote_child.py``, one process each; with two GPUs one instance
per GPU, with one both share it and split ``--gpu-kv-bytes``):

* ``ttft``: instance A stores ``--reps`` prompts of each ``--lengths`` into kvtier; a FRESH
  instance B then asks for each prompt once: a hit on A's blocks (the very first one is B's
  first request after start-up), then the same prompt again after vLLM's GPU prefix cache was
  reset, and a prompt of the same length nobody stored (recompute). ``remote``: A exits once
  the server holds its blocks, and the second ask is a CPU hit on B's promoted copy.
  ``host``: A stays alive while B runs; the second ask is A's blocks again (B stores nothing
  another instance holds), and B's own CPU hit is the recomputed prompt asked again after a
  reset. Tokens of 8-token greedy answers to other stored prompts are compared between A
  (computed) and B (loaded from A's blocks).
* ``roundrobin``: ``--conversations`` conversations of ``--turns`` turns (each turn: the
  whole conversation so far plus ``--new-tokens`` user tokens, a 1-token answer, so a
  request's latency is its TTFT) routed round-robin between two instances with a router that
  ignores prefixes: each conversation's next turn lands on the other instance, after
  ``--think-ms``. Per configuration (``--configs``: ``private`` kvtier with private CPU tiers,
  ``host`` the two CPU tiers regions of one host pool, ``remote`` private tiers plus the
  shared tier, ``native`` vLLM's CPU offloading) and per turn size (``--new-tokens`` is a
  list; a configuration's instances start once and run each size in turn): requests/s and
  TTFT p50/p99, and each configuration against the private tiers. Each instance serves one
  request at a time.

Writes ``vllm_remote_<phases>_<layout>_<gpu>.json`` and ``.md`` (tables) into ``--out-dir``.

    python benchmarks/vllm_remote.py --phases ttft,roundrobin [--tier host] [--cluster] \\
        [--configs private,host,remote,native] [--new-tokens 2048,8192] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from vllm_e2e_engine import SHAPES  # noqa: E402

TAG = "@@kv "
VOCAB = 128256
CHILD = HERE / "vllm_remote_child.py"  # one instance (a test swaps in a stand-in)
GiB = 1 << 30

# --configs names -> the child's connectors, and how the tables call them
CONFIGS = {"private": "kvtier", "host": "kvtier_host", "remote": "kvtier_remote",
           "native": "native"}
LABELS = {"kvtier": "kvtier private CPU tiers", "kvtier_host": "kvtier host tier",
          "kvtier_remote": "kvtier + Valkey shared tier", "native": "vLLM native offloading"}
SHORT = {"kvtier": "private", "kvtier_host": "host", "kvtier_remote": "remote",
         "native": "native"}
# the pool beyond the instances' regions: a region freed by an exiting instance is taken
# back only once nobody reads its blocks, so the next one must not need exactly that room
HOST_MARGIN = 1 * GiB
# the service exits this long after its last instance: its pool (page-locked, resident) must
# be gone before the next configuration maps a pool of its own
HOST_IDLE_EXIT_S = 2.0
# two instances alive on one GPU: each one's start-up check wants this share of the card
# free, which the one already running must leave (vLLM's 0.9 cannot be met twice)
SHARED_GPU_UTIL = 0.4


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB - 1) for _ in range(n)]


def connectors(configs: str) -> list[str]:
    """``--configs`` (``private,host,remote,native``, or the child's connector names) as
    connectors, in order."""
    out = []
    for name in (n.strip() for n in configs.split(",")):
        if not name:
            continue
        connector = CONFIGS.get(name, name)
        if connector not in LABELS:
            raise ValueError(f"--configs: unknown configuration {name!r}; choose from "
                             f"{', '.join(CONFIGS)}")
        out.append(connector)
    return out


def default_configs(tier: str) -> str:
    """Without ``--configs``: the private tiers, the ``--tier`` one, and native."""
    return f"private,{tier},native"


def kv_bytes_per_token(shape: str) -> int:
    """KV bytes of one token of ``shape`` in bf16: K and V of every layer."""
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 2


def ttft_cpu_bytes(shape: str, lengths: list[int], reps: int, floor: int,
                   block_tokens: int = 16) -> int:
    """A's CPU tier for ``ttft`` on the host tier: every prompt A stores (``reps`` of each
    length and the checked one) must still be in its region when B asks, or B's "hit" is a
    recompute; 10% over their full blocks, at least ``floor``. (The shared tier keeps A's
    blocks on the server, so ``remote`` keeps ``--cpu-bytes``.)"""
    blocks = sum(L // block_tokens * (reps + 1) for L in lengths)
    need = int(blocks * block_tokens * kv_bytes_per_token(shape) * 1.1)
    return max(floor, need)


def host_section(directory: Path, cpu_bytes: int, instances: int = 2,
                 margin: int = HOST_MARGIN) -> dict:
    """kvtier's ``tiers.host`` for ``instances`` instances of ``tiers.cpu.capacity`` =
    ``cpu_bytes`` each: the pool holds every region (the loader checks it holds one) plus
    ``margin``; the service goes soon after the last instance (``HOST_IDLE_EXIT_S``)."""
    return {"capacity": instances * cpu_bytes + margin, "dir": str(directory),
            "idle_exit_s": HOST_IDLE_EXIT_S}


def new_host_dir(base: Path | None = None) -> Path:
    """A fresh ``0700`` directory for one pool's service (socket, lock, log): a run never
    meets a pool an earlier run left. Under /dev/shm by default: in memory, a short path (a
    socket's path must fit 107 bytes), and not in ``--out-dir``, whose files all come back
    from the GPU machine."""
    if base is None:
        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="kvtier-host-", dir=base))
    os.chmod(d, 0o700)
    return d


def service_running(directory: Path) -> bool:
    """Whether a pool's service listens in ``directory``: its socket takes a connection (an
    exited service may leave the socket file behind)."""
    for path in directory.glob("*.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return True
        except OSError:
            continue
        finally:
            s.close()
    return False


def retire_host_dir(directory: Path, logs: Path, limit_s: float = HOST_IDLE_EXIT_S + 30) -> dict:
    """Once a phase's instances are gone: wait for the pool's service to exit, so its memory
    is free before the next pool; keep its log beside the instances'."""
    t0 = time.monotonic()
    while service_running(directory) and time.monotonic() - t0 < limit_s:
        time.sleep(1.0)  # the service looks at its idle time only when accept() times out
    left = service_running(directory)
    for log in directory.glob("*.log"):
        shutil.copy(log, logs / f"host-service-{directory.name}.log")
    if not left:
        shutil.rmtree(directory, ignore_errors=True)
    return {"dir": str(directory), "service_exited": not left,
            "waited_s": round(time.monotonic() - t0, 2)}


def gpu_budget(args, shared_gpu: bool) -> tuple[int, float | None]:
    """Per instance: vLLM's KV bytes and ``gpu_memory_utilization``. Two instances alive on
    one GPU split ``--gpu-kv-bytes``, and each asks the start-up check for only
    ``SHARED_GPU_UTIL`` of the card (with kv_cache_memory_bytes set, nothing else reads it)."""
    if not shared_gpu:
        return args.gpu_kv_bytes, args.gpu_util
    return args.gpu_kv_bytes // 2, args.gpu_util or SHARED_GPU_UTIL


def child_command(name: str, connector: str, args, log_dir: Path, *, gpu_kv_bytes: int,
                  cpu_bytes: int | None = None, remote: dict | None = None,
                  host: dict | None = None, gpu_util: float | None = None,
                  engine_id: str | None = None) -> list[str]:
    """The command line of one ``vllm_remote_child.py``. Every instance gets its own vLLM
    engine id (a name and a uuid): the host tier names an instance's region by it."""
    cmd = [sys.executable, str(CHILD), "--connector", connector,
           "--shape", args.shape, "--model-dir", str(log_dir / f"model-{args.shape}"),
           "--max-len", str(args.max_len),
           "--cpu-bytes", str(args.cpu_bytes if cpu_bytes is None else cpu_bytes),
           "--gpu-kv-bytes", str(gpu_kv_bytes),
           "--engine-id", engine_id or f"{name}-{uuid.uuid4().hex[:12]}",
           "--snapshot", str(log_dir / f"{name}-snapshot.json")]
    if remote is not None:
        cmd += ["--remote", json.dumps(remote)]
    if host is not None:
        cmd += ["--host", json.dumps(host)]
    if gpu_util is not None:
        cmd += ["--gpu-util", str(gpu_util)]
    return cmd


class Instance:
    """One ``vllm_remote_child.py`` process and its command pipe."""

    def __init__(self, name: str, gpu: str, connector: str, args, log_dir: Path,
                 **settings) -> None:
        self.name = name
        cmd = child_command(name, connector, args, log_dir, **settings)
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


def server_keys(servers: list) -> int:
    return sum(int(s.client().dbsize()) for s in servers)


def stored_cpu_blocks(inst: Instance) -> int:
    """Blocks ``inst`` stored into its CPU tier so far (its stats snapshot)."""
    manager = inst.call(op="stats").get("manager") or {}
    return int((manager.get("stored_blocks") or {}).get("CPU", 0))


def wait_quiet(count, inst: Instance, quiet_s: float = 3.0, limit_s: float = 240.0) -> int:
    """Until ``count()`` stopped growing for ``quiet_s``: the stores ``inst`` queued are done
    (the server's keys: written back; A's CPU blocks: in its region, published to the pool)."""
    last, since, end = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < end:
        inst.call(op="settle", seconds=0.2)
        n = count()
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


def reset_settled(inst: Instance) -> None:
    """Drop vLLM's GPU prefix cache once the stores queued so far are done: the next ask can
    only hit a kvtier tier."""
    inst.call(op="settle", seconds=0.1)
    inst.call(op="reset")


def probe_length(b: Instance, tier: str, L: int, prompts: list[list[int]]) -> dict:
    """B's asks at one length, per stored prompt: a hit on A's blocks (``tier``), the same
    prompt again after a reset, and a fresh prompt (recompute). ``cpu`` is B's own CPU tier:
    with ``remote`` the second ask (B promoted A's blocks into it); with ``host`` the second
    ask is A's blocks again (B stores none another instance holds: ``host_again``), so the
    fresh prompt is asked again after a reset instead."""
    row: dict = {tier: [], f"{tier}_cached": [], "cpu": [], "cpu_cached": [], "recompute": []}
    if tier == "host":
        row["host_again"] = []
    for r, p in enumerate(prompts):
        got = b.call(op="gen", prompt=p)
        row[tier].append(got["ms"])
        row[f"{tier}_cached"].append(got["cached"])
        reset_settled(b)
        again = b.call(op="gen", prompt=p)
        fresh = tokens(L, 555 * L + r)
        row["recompute"].append(b.call(op="gen", prompt=fresh)["ms"])
        if tier == "host":
            row["host_again"].append(again["ms"])
            # B's store of a 32k prompt (4 GiB at 8B) outlasts a settle: wait for all of it
            wait_quiet(lambda: stored_cpu_blocks(b), b, quiet_s=0.6, limit_s=30.0)
            b.call(op="reset")
            again = b.call(op="gen", prompt=fresh)
        row["cpu"].append(again["ms"])
        row["cpu_cached"].append(again["cached"])
        b.call(op="reset")
    return row


def phase_ttft(args, remote: dict | None, servers: list, gpus: list[str], logs: Path) -> dict:
    tier = args.tier
    host = tier == "host"
    connector = "kvtier_host" if host else "kvtier_remote"
    lengths = [int(x) for x in args.lengths.split(",")]
    stored = {L: [tokens(L, 1000 * L + r) for r in range(args.reps)] for L in lengths}
    checked = {L: tokens(L, 7 * L + 1) for L in lengths}
    # host: A stays alive beside B (its blocks leave the pool with it)
    kv, util = gpu_budget(args, host and len(gpus) == 1)
    cpu = ttft_cpu_bytes(args.shape, lengths, args.reps, args.cpu_bytes) if host else args.cpu_bytes
    host_dir = new_host_dir(args.host_dir) if host else None
    section = host_section(host_dir, cpu) if host else None
    settings = dict(gpu_kv_bytes=kv, cpu_bytes=cpu, gpu_util=util, host=section,
                    remote=None if host else remote)
    out: dict = {"tier": tier, "cpu_bytes": cpu, "gpu_kv_bytes": kv, "gpu_util": util,
                 "host": section, "lengths": lengths, "reps": args.reps}
    a = b = None
    try:
        a = Instance("A", gpus[0], connector, args, logs, **settings).wait_ready()
        out["start_s"] = {"A": a.ready["start_s"]}
        want = {}
        for L in lengths:
            for p in stored[L]:
                a.call(op="gen", prompt=p)
            want[L] = a.call(op="gen", prompt=checked[L], max_tokens=8)["tokens"]
        if host:
            out["stored_blocks_A"] = wait_quiet(lambda: stored_cpu_blocks(a), a)
        else:
            out["server_keys"] = wait_quiet(lambda: server_keys(servers), a)
        out["stats_A"] = a.call(op="stats")
        if not host:  # the server holds A's blocks: B starts on a GPU A left
            a.close()
            a = None
        b = Instance("B", gpus[-1], connector, args, logs, **settings).wait_ready()
        out["start_s"]["B"] = b.ready["start_s"]
        rows = {}
        for L in lengths:
            row = probe_length(b, tier, L, stored[L])
            got = b.call(op="gen", prompt=checked[L], max_tokens=8)
            row["tokens_equal"] = got["tokens"] == want[L]
            row["check_cached"] = got["cached"]
            rows[L] = row
        first = rows[lengths[0]]
        out["first_hit_after_start"] = {"ms": first[tier][0], "cached": first[f"{tier}_cached"][0]}
        out["stats_B"] = b.call(op="stats")
    finally:
        for inst in (b, a):  # B first: it may be reading A's blocks
            if inst is not None:
                inst.close()
        if host_dir is not None:
            out["host_service"] = retire_host_dir(host_dir, logs)
    out["rows"] = rows
    return out


def run_workload(insts: list[Instance], args, new_tokens: int, w: int) -> dict:
    """One round-robin workload on running instances: turns of ``new_tokens`` user tokens;
    ``w``-th of the run, its conversations seeded apart from the earlier ones' (the first's
    seeds are the single-size run's)."""
    lock = threading.Lock()
    queues: list[list] = [[], []]
    cv = threading.Condition(lock)
    latencies: list[float] = []
    cached: list[int] = []
    per_turn: dict[int, list[tuple[float, int]]] = {}  # turn -> (ms, cached tokens)
    convs = {c: tokens(args.first_tokens, 90000 + 1000 * w + c) for c in range(args.conversations)}
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
                convs[c] = (convs[c] + got["tokens"]
                            + tokens(new_tokens, 31 * c + turn + 7919 * w))
                cv.notify_all()
            if turn + 1 < args.turns:
                submit(c, turn + 1, time.monotonic() + args.think_ms / 1e3)

    t0 = time.monotonic()
    for c in range(args.conversations):
        submit(c, 0, t0)
    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    n = len(latencies)
    return {"requests": n, "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 3),
            "ttft_p50_ms": pct(latencies, 0.5), "ttft_p99_ms": pct(latencies, 0.99),
            "cached_tokens": sum(cached), "think_ms": args.think_ms,
            "conversations": args.conversations, "first_tokens": args.first_tokens,
            "new_tokens": new_tokens,
            "turns": {t: {"ttft_p50_ms": med([m for m, _ in v]),
                          "cached_tokens": sum(c for _, c in v)}
                      for t, v in sorted(per_turn.items())}}


def phase_roundrobin(args, remote: dict | None, connector: str, gpus: list[str],
                     logs: Path) -> list[dict]:
    """One configuration: two instances started once, then one workload per ``--new-tokens``
    size. kvtier's counters (``kvtier``) are cumulative since the instances started."""
    kv, util = gpu_budget(args, len(gpus) == 1)
    host_dir = new_host_dir(args.host_dir) if connector == "kvtier_host" else None
    settings = dict(gpu_kv_bytes=kv, gpu_util=util,
                    remote=remote if connector == "kvtier_remote" else None,
                    host=None if host_dir is None else host_section(host_dir, args.cpu_bytes))
    insts: list[Instance] = []
    results = []
    try:
        insts = [Instance(f"rr-{connector}-{i}", gpus[i % len(gpus)], connector, args, logs,
                          **settings) for i in range(2)]
        for inst in insts:  # both engines start at once
            inst.wait_ready()
        for w, new_tokens in enumerate(int(x) for x in str(args.new_tokens).split(",")):
            rr = run_workload(insts, args, new_tokens, w)
            stats = ([summary(inst.call(op="stats")) for inst in insts]
                     if connector.startswith("kvtier") else [])
            rr = {"config": SHORT[connector], "connector": connector, **rr, "kvtier": stats,
                  "start_s": [inst.ready["start_s"] for inst in insts],
                  "gpu_kv_bytes": kv, "gpu_util": util, "cpu_bytes": args.cpu_bytes,
                  "host": settings["host"]}
            print(json.dumps(rr), flush=True)
            results.append(rr)
    finally:
        for inst in insts:
            inst.close()
        if host_dir is not None:
            service = retire_host_dir(host_dir, logs)
            for rr in results:
                rr["host_service"] = service
    return results


def ratios(rows: list[dict], base: str = "private") -> list[dict]:
    """Each configuration against ``base`` at the same turn size: requests/s and TTFT
    p50/p99 as ratios (host / private is issue 47's figure; > 1 is more req/s or slower)."""
    by = {(r["config"], r["new_tokens"]): r for r in rows}
    out = []
    for (config, n), r in by.items():
        b = by.get((base, n))
        if config == base or b is None:
            continue
        out.append({"ratio": f"{config}/{base}", "new_tokens": n,
                    "requests_per_s": _ratio(r["requests_per_s"], b["requests_per_s"]),
                    "ttft_p50": _ratio(r["ttft_p50_ms"], b["ttft_p50_ms"]),
                    "ttft_p99": _ratio(r["ttft_p99_ms"], b["ttft_p99_ms"])})
    return out


def _ratio(x: float, y: float) -> float:
    return round(x / y, 3) if y else float("nan")


def summary(stats: dict) -> dict:
    """What explains a configuration's figures: hits per tier, hits declined as slower than
    recompute, presence answers still pending when asked, the cost model's estimates."""
    m = stats.get("manager", {})
    keep = ("hit_blocks", "stored_blocks", "evicted_blocks", "skipped_slower_than_recompute",
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


def out_name(result: dict) -> str:
    """``vllm_remote_<phases>_<layout>_<gpu>`` (the phases asked for, run or not): a ttft
    run and a roundrobin run into one ``--out-dir`` do not overwrite each other."""
    phases = "-".join(p for p in ("ttft", "roundrobin") if p in result.get("phases", result))
    layout = ("host" if result["tier"] == "host"
              else "cluster" if result["cluster"] else "standalone")
    return f"vllm_remote_{phases or 'none'}_{layout}_{result['gpu']}"


def _cell(ms: list[float], cached: list[int] | None = None) -> str:
    """Median ms, with the tokens each ask found cached."""
    if not ms:
        return ""
    text = f"{med(ms)}"
    return text if cached is None else f"{text} ({', '.join(f'{c:,}' for c in cached)})"


def markdown(result: dict) -> str:
    """The run's tables: ttft per length (median ms, tokens loaded in brackets) and the
    round-robin per configuration and turn size."""
    lines = [f"# vllm_remote: {result['gpus']}x {result['gpu']}, {result['shape']} shape, "
             f"tier {result['tier']}", ""]
    t = result.get("ttft")
    if t:
        tier = t["tier"]
        again = "host_again" if tier == "host" else None
        lines += [f"## TTFT in a fresh instance B of prompts A stored ({tier} tier)", "",
                  f"reps {t['reps']}, CPU tier {t['cpu_bytes'] / GiB:.1f} GiB per instance"
                  + (f", host pool {t['host']['capacity'] / GiB:.1f} GiB" if t.get("host") else "")
                  + "; B's first request after start-up: "
                  + "{ms} ms, {cached:,} tokens loaded".format(**t["first_hit_after_start"]), "",
                  f"| prompt | {tier} hit (B's first ask) | "
                  + ("A's blocks again | " if again else "")
                  + "B's own CPU hit | recompute | tokens equal |",
                  "|---|---|" + ("---|" if again else "") + "---|---|---|"]
        for L, row in t["rows"].items():
            n = int(L)
            cells = [f"{n // 1024}k" if n % 1024 == 0 else str(n),
                     _cell(row[tier], row[f"{tier}_cached"])]
            if again:
                cells.append(_cell(row[again]))
            cells += [_cell(row["cpu"], row.get("cpu_cached")), _cell(row["recompute"]),
                      f"{row['tokens_equal']} ({row['check_cached']:,} loaded)"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    rr = result.get("roundrobin")
    if rr:
        vs = {(x["ratio"].split("/")[0], x["new_tokens"]): x for x in result.get("ratios", [])}
        lines += ["## Round-robin multi-turn between two instances", "",
                  f"{rr[0]['conversations']} conversations x {len(rr[0]['turns'])} turns, "
                  f"first {rr[0]['first_tokens']} tokens, think {rr[0]['think_ms']} ms", "",
                  "| config | new tokens / turn | req/s | TTFT p50 / p99 ms | cached tokens "
                  "| vs private: req/s, p50 |", "|---|---|---|---|---|---|"]
        for r in rr:
            x = vs.get((r["config"], r["new_tokens"]))
            ratio = f"{x['requests_per_s']}x, {x['ttft_p50']}x" if x else ""
            lines.append(f"| {LABELS[r['connector']]} | {r['new_tokens']} | {r['requests_per_s']} "
                         f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['cached_tokens']:,} "
                         f"| {ratio} |")
        lines.append("")
    return "\n".join(lines)


def needs_valkey(args, configs: list[str]) -> bool:
    return ((args.tier == "remote" and "ttft" in args.phases)
            or ("roundrobin" in args.phases and "kvtier_remote" in configs))


def start_servers(args, work: Path) -> tuple[list, dict | None]:
    """The Valkey server(s) the shared tier uses, and its ``tiers.remote`` section."""
    from support.valkey_servers import Server, start_cluster

    extra = ("--io-threads", str(args.io_threads), "--maxmemory", "100gb",
             "--maxmemory-policy", "allkeys-lru", *args.server_args.split())
    servers = start_cluster(work, 3, *extra) if args.cluster else [Server(work, *extra)]
    remote = ({"nodes": [s.node for s in servers]} if args.cluster else {"url": servers[0].url})
    remote.update(io_processes=args.io_processes, timeout_s=2.0)
    return servers, remote


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="ttft,roundrobin", help="ttft, roundrobin or both")
    ap.add_argument("--tier", default="remote", choices=["remote", "host"],
                    help="how ttft's instances share blocks, and roundrobin's default "
                         "--configs: remote = kvtier's shared tier on Valkey (default); host "
                         "= kvtier's host tier (tiers.host: one CPU pool per host, no server)")
    ap.add_argument("--configs", default=None,
                    help="roundrobin's configurations, in order, from private (kvtier, "
                         "private CPU tiers), host (kvtier host tier), remote (kvtier + "
                         "Valkey shared tier), native (vLLM's offloading); default: "
                         "private,<--tier>,native")
    ap.add_argument("--cluster", action="store_true", help="a 3-primary Cluster, not one server")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--io-processes", type=int, default=8, help="kvtier's tiers.remote.io_processes")
    ap.add_argument("--host-dir", type=Path, default=None,
                    help="where each host pool's fresh 0700 directory goes (default /dev/shm)")
    ap.add_argument("--shape", default="8b", choices=["8b", "1b"])
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=34000)
    ap.add_argument("--cpu-bytes", type=int, default=16 * GiB,
                    help="each instance's CPU tier (its region with --tier host; ttft raises "
                         "it there to hold every prompt A stores); a host pool is 2x this + "
                         f"{HOST_MARGIN // GiB} GiB")
    ap.add_argument("--gpu-kv-bytes", type=int, default=24 * GiB,
                    help="vLLM's KV bytes per instance; halved when two instances run on one GPU")
    ap.add_argument("--gpu-util", type=float, default=None,
                    help="gpu_memory_utilization per instance (default: vLLM's, "
                         f"{SHARED_GPU_UTIL} when two instances run on one GPU)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", default="2048",
                    help="user tokens per turn; a list (2048,8192) runs one workload per size "
                         "on the same instances")
    ap.add_argument("--think-ms", type=float, default=300.0)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--log-dir", default=None,
                    help="the instances' logs and snapshots (default: a fresh temp dir)")
    ap.add_argument("--timeline", default=None, help="a folder for each instance's timeline")
    ap.add_argument("--gpus", default=None,
                    help="comma list of GPU indexes the instances use (default: every GPU); "
                         "with one, both instances share it")
    ap.add_argument("--server-args", default="",
                    help='more server settings, e.g. "--events-per-io-thread 0" (Valkey 8+)')
    return ap


def main() -> int:
    args = parser().parse_args()
    configs = connectors(args.configs or default_configs(args.tier))
    gpus = args.gpus.split(",") if args.gpus else gpu_list()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="kvtier-vllm-remote-"))
    servers, remote = start_servers(args, work) if needs_valkey(args, configs) else ([], None)
    result: dict = {"gpu": gpu_name(), "gpus": len(gpus), "shape": args.shape,
                    "phases": args.phases, "tier": args.tier, "configs": configs,
                    "cluster": args.cluster, "io_threads": args.io_threads,
                    "server_args": args.server_args,
                    "io_processes": args.io_processes, "cpu_count": os.cpu_count()}
    print(f"logs: {work}", flush=True)
    try:
        if "ttft" in args.phases:
            result["ttft"] = phase_ttft(args, remote, servers, gpus, work)
            for s in servers:
                s.client().flushall()
            print(json.dumps({k: v for k, v in result["ttft"].items()
                              if not k.startswith("stats")}, indent=1), flush=True)
        if "roundrobin" in args.phases:
            result["roundrobin"] = []
            for connector in configs:
                result["roundrobin"] += phase_roundrobin(args, remote, connector, gpus, work)
                for s in servers:
                    s.client().flushall()
            result["ratios"] = ratios(result["roundrobin"])
            print(json.dumps(result["ratios"]), flush=True)
    finally:
        for s in servers:
            s.stop()
        os.makedirs(args.out_dir, exist_ok=True)
        path = Path(args.out_dir) / out_name(result)
        path.with_suffix(".json").write_text(json.dumps(result, indent=1))
        try:
            path.with_suffix(".md").write_text(markdown(result))
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # a run cut short
            path.with_suffix(".md").write_text(f"no tables: {exc!r}; see the JSON\n")
        print(f"wrote {path}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
