"""kvtier under load behind ``vllm serve``: multi-turn chat at Poisson rates up to saturation.

Why: ``vllm_serve.py`` times one request at a time. A serving deployment is judged by what
many clients see at once: requests/s and output tokens/s, TTFT and inter-token latency
percentiles, and goodput (requests/s that met a TTFT SLO), with more conversations than the
GPU's KV cache holds, so returning conversations' prefixes come from the CPU (or disk) tier or
are recomputed.

One real ``vllm serve`` per configuration (``vllm_serve.server_args``: the same model shapes,
flags and ``--kv-transfer-config``), started on 127.0.0.1 and stopped by its process group:

* ``none``: vLLM's GPU prefix cache only.
* ``native``: vLLM's ``OffloadingConnector`` with ``cpu_bytes_to_use`` = ``--cpu-gib``.
* ``kvtier_cpu``: kvtier with a CPU tier of the same bytes.
* ``kvtier_disk``: the same CPU tier plus a disk tier (``--disk-dir``, ``--disk-gib``).

The GPU's KV cache is capped (``--gpu-kv-gib``: vLLM's ``--kv-cache-memory-bytes``). The load
(``serving_workload.py``) is a pool of conversations sized so that their histories, the
working set, are ``--working-set`` times the CPU tier's bytes (``--workload``: a published
multi-turn workload instead, ``serving_presets.py``; the sizes: ``serving_sizing.py``);
requests arrive as a Poisson process at each of ``--rates`` (requests/s), each the next turn
of an idle conversation. Before
the first rate every conversation speaks once (unmeasured), then each rate runs for
``--duration-s`` plus at most ``--drain-s``. Per configuration and rate: requests/s, output
tokens/s, TTFT and ITL p50/p99, goodput at each ``--ttft-slo-ms``, and the prompt tokens each
cache tier supplied (deltas of vLLM's ``/metrics``; kvtier's own per-tier hits from its stats
snapshot). Definitions: ``serving_stats.py``.

Results accumulate in ``<out-dir>/serving_<device>.json`` under a run label (one per shape and
sizing; a configuration rerun replaces its entry) and ``.md`` is rewritten from it after each
rate, so a run cut short keeps what it measured. GPU (one shape, four configurations, ~8 min):
``python benchmarks/serving.py --shape 1b``. CPU smoke (tiny model, vLLM's CPU backend):
``python benchmarks/serving.py --cpu-smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from serve_client import Server, metrics, server_version  # noqa: E402
from serving_driver import run_window, warm  # noqa: E402
from serving_report import report, size  # noqa: E402
from serving_stats import delta, hit_counters, summarize  # noqa: E402
from serving_sizing import WORKLOADS, choose_workload, size_memory, window_s  # noqa: E402
from serving_workload import Pool  # noqa: E402
from vllm_e2e_engine import SHAPES, VOCAB, write_model  # noqa: E402
from vllm_serve import (SERVE_MARKS, add_connector_key_args, device_name, free_port,  # noqa: E402
                        server_args, snapshot_path)

GiB = 1 << 30
CONFIGS = ("none", "native", "kvtier_cpu", "kvtier_disk")
# per shape: rates (requests/s), CPU bytes (GiB), GPU KV (GiB). The GPU's KV holds about 15
# conversations, a tenth of the pool at the default --working-set; the rates are meant to go
# from light load past saturation (a guess for an H100: tune with --rates).
DEFAULTS = {"1b": ("8,16,32", 8.0, 1.5), "8b": ("2,4,8", 12.0, 4.0),
            "tiny": ("1,2", 1.5 / 1024, 1.0 / 1024)}


def kv_bytes_per_token(shape: str) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * (
        4 if shape == "tiny" else 2)


def base_connector(config: str) -> str:
    return "kvtier" if config.startswith("kvtier") else config


def serve_args(a, model_dir: str, config: str, port: int) -> list[str]:
    """``vllm_serve.server_args`` for a configuration; ``kvtier_disk`` adds its disk tier
    through the kvtier section it deep-merges (the CPU tier keeps ``cpu_bytes``)."""
    extra = json.loads(a.kvtier_json) if a.kvtier_json else {}
    if config == "kvtier_disk":
        extra.setdefault("tiers", {})["disk"] = {"path": disk_path(a), "capacity": a.disk_bytes}
    ns = argparse.Namespace(shape=a.shape, block_size=a.block_size, max_len=a.max_len,
                            max_num_seqs=a.max_num_seqs, gpu_kv_bytes=a.gpu_kv_bytes,
                            tensor_parallel_size=a.tensor_parallel_size,
                            workdir=a.workdir, cpu_bytes=a.cpu_bytes,
                            kvtier_json=json.dumps(extra) if extra else None,
                            sync_budget=a.sync_budget, store_every_steps=a.store_every_steps,
                            store_answers=a.store_answers)
    return server_args(ns, model_dir, base_connector(config), port)


def disk_path(a) -> str:
    return os.path.join(a.disk_dir, f"serving-{a.shape}")  # this benchmark's own folder


def kvtier_snapshot(a) -> dict:
    """kvtier's latest stats snapshot (empty without one yet)."""
    try:
        with open(snapshot_path(a, "kvtier")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def kvtier_hits(a) -> dict[str, float]:
    """kvtier's prompt tokens planned from each tier so far (its stats snapshot: blocks times
    tokens per block); empty without a snapshot yet."""
    blocks = (kvtier_snapshot(a).get("manager") or {}).get("hit_blocks") or {}
    return {tier: float(n) * a.block_size for tier, n in blocks.items()}


def counters(server: Server, a, config: str) -> tuple[dict, dict]:
    vllm = hit_counters(metrics(server.url))
    return vllm, kvtier_hits(a) if config.startswith("kvtier") else {}


def server_env(a, config: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The environment of ``config``'s server and the folders leading its PYTHONPATH. With
    ``--timeline``, kvtier's servers mark where their steps' time goes; with ``--vllm-marks``
    too, every server (native's and no connector's included, to compare like with like)
    marks vLLM's own step phases (``diagnostics/serve_marks``)."""
    env = {"HF_HUB_OFFLINE": "1"}
    if a.shape == "tiny":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if a.timeline and (config.startswith("kvtier") or a.vllm_marks):
        os.makedirs(a.timeline, exist_ok=True)
        env["KVTIER_TIMELINE"] = os.path.join(a.timeline, f"{a.shape}-{config}-timeline.jsonl")
        env["KVTIER_TIMELINE_FLUSH_S"] = "1"  # the server is killed, not shut down
    path = (SERVE_MARKS,) if a.vllm_marks else ()
    return env, path


def run_config(a, model_dir: str, config: str, save) -> dict:
    port = free_port()
    log = os.path.join(a.out_dir, f"server-serving-{a.shape}-{config}.log")
    for path in (snapshot_path(a, "kvtier"), disk_path(a)):
        remove(path)
    if config == "kvtier_disk":
        os.makedirs(disk_path(a))
    env, path = server_env(a, config)
    server = Server(config, model_dir, serve_args(a, model_dir, config, port), port, log, env,
                    path)
    result: dict = {"config": config, "argv": a.argv, "setup": setup(a, config), "rates": {}}
    save(result)  # replaces what an earlier run of this label left for this configuration
    t0 = time.perf_counter()
    try:
        server.start(timeout_s=a.start_timeout)
        result["server_start_s"] = time.perf_counter() - t0
        result["setup"]["vllm"] = server_version(server.url)
        progress(f"{config}: server up after {result['server_start_s']:.0f} s")
        pool = Pool(a.pool, a.workload, VOCAB[a.shape], a.seed)
        result["warm_s"] = warm(server.url, model_dir, pool, a.max_num_seqs)
        progress(f"{config}: {a.pool} conversations warmed in {result['warm_s']:.0f} s")
        for i, rate in enumerate(a.rates):
            result["rates"][f"{rate:g}"] = one_rate(server, a, config, pool, rate, i)
            save(result)
    finally:
        server.stop()
        remove(disk_path(a))
    return result


def one_rate(server: Server, a, config: str, pool: Pool, rate: float, i: int) -> dict:
    vllm0, kvt0 = counters(server, a, config)
    t0, span = time.perf_counter(), window_s(a, rate)
    win = run_window(server.url, server.model, pool, rate, span, a.drain_s,
                     seed=a.seed * 7919 + i)
    if server.proc is not None and server.proc.poll() is not None:
        raise RuntimeError(f"{config}: vllm serve exited with {server.proc.returncode} at "
                           f"{rate:g} req/s; its log ends:\n{server.tail()}")
    time.sleep(1.0)  # vLLM's counters and kvtier's snapshot (0.2 s) catch up
    vllm1, kvt1 = counters(server, a, config)
    s = summarize(win.records, span, a.slos)
    ws = win.live_tokens or [pool.live_tokens()]
    s.update(rate=rate, window_s=span, unsent=win.unsent, hits=delta(vllm0, vllm1),
             kvtier_hits=delta(kvt0, kvt1),
             working_set_tokens_mean=sum(ws) / len(ws), working_set_tokens_max=max(ws),
             wall_s=time.perf_counter() - t0)
    if config.startswith("kvtier"):  # what explains the figures: skipped stores, cuts, usage
        snap = kvtier_snapshot(a)
        s["kvtier_stats"] = {k: snap.get(k) for k in ("manager", "usage", "cost")}
    slo = f"{a.slos[0]:g}"
    progress(f"{config} {rate:g} req/s: {s['rps']:.2f} req/s, {s['out_tps']:.0f} out tok/s, "
             f"TTFT p50 {s['ttft_p50_ms']:.0f} p99 {s['ttft_p99_ms']:.0f} ms, ITL p50 "
             f"{s['itl_p50_ms']:.1f} ms, goodput@{slo}ms {s['goodput'][slo]['rps']:.2f}, "
             f"errors {s['errors']}, cut {s['cut']}, hits "
             + ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["hits"].items()) if v))
    return s


def setup(a, config: str) -> dict:
    out = {"pool": a.pool, "working_set_bytes": a.ws_bytes, "cpu_bytes": a.cpu_bytes,
           "gpu_kv_bytes": a.gpu_kv_bytes, "kv_bytes_per_token": a.token_bytes,
           "workload": a.workload.describe(), "gpu": getattr(a, "device", "?"),
           "duration_s": a.duration_s,
           "min_requests": a.min_requests, "drain_s": a.drain_s,
           "max_num_seqs": a.max_num_seqs, "block_size": a.block_size, "slos_ms": a.slos,
           "tensor_parallel_size": a.tensor_parallel_size,
           "sync_budget": a.sync_budget, "store_every_steps": a.store_every_steps,
           "store_answers": a.store_answers,
           "seed": a.seed}
    if config == "kvtier_disk":
        out["disk_bytes"], out["disk_fs"] = a.disk_bytes, fs_type(a.disk_dir)
    return out


def fs_type(path: str) -> str:
    """The file system ``path`` is on (/proc/mounts' longest mount point above it): a disk
    tier on tmpfs is memory, not disk."""
    path, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def progress(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


def save_result(a, label: str, config: str, result: dict | None, error: str | None) -> None:
    """Merge one configuration's entry into the results file and rewrite the report."""
    path = results_path(a) + ".json"
    data = {"device": a.device, "runs": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    run = data["runs"].setdefault(label, {"shape": a.shape, "configs": {}, "errors": {}})
    if result is not None:
        run["configs"][config] = result
    if error is None:
        run["errors"].pop(config, None)
    else:
        run["errors"][config] = error
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    with open(results_path(a) + ".md", "w") as f:
        f.write(report(data))


def results_path(a) -> str:
    return os.path.join(a.out_dir, f"serving_{a.device.replace(' ', '-')}")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as every kvtier command line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


D = " (default: %(default)s)"


def parser() -> Parser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Defaults per --shape: " + "; ".join(
                   f"{s}: --rates {r} --cpu-gib {c:g} --gpu-kv-gib {g:g}"
                   for s, (r, c, g) in DEFAULTS.items() if s != "tiny") + ". --cpu-smoke: "
                   "the tiny shape's defaults, none,kvtier_cpu,kvtier_disk, 128+32/8-token "
                   "turns x 3, 6 s per rate.")
    p.add_argument("--shape", default="1b", choices=["1b", "8b", "tiny"],
                   help="model shape (random weights; tiny: vLLM's CPU backend)" + D)
    p.add_argument("--connectors", default=",".join(CONFIGS),
                   help="comma list of: " + ", ".join(CONFIGS) + ", run in that order" + D)
    p.add_argument("--rates", default=None,
                   help="comma list of Poisson arrival rates in requests/s, run in this order "
                        "on the same server (default: per --shape)")
    p.add_argument("--duration-s", type=float, default=15.0,
                   help="seconds of arrivals per rate" + D)
    p.add_argument("--drain-s", type=float, default=5.0,
                   help="after the arrivals, how long requests may still stream before their "
                        "connections are closed (counted as cut)" + D)
    p.add_argument("--ttft-slo-ms", default="500",
                   help="comma list of TTFT SLOs for goodput, ms; the first is the report's" + D)
    p.add_argument("--workload", dest="workload_name", default="synthetic", choices=WORKLOADS,
                   help="synthetic: the --first/--user/--answer-tokens and --turns below; or "
                        "a published multi-turn workload (serving_presets.py): its pool, "
                        "lengths, rates and --min-requests" + D)
    p.add_argument("--rounds", type=int, default=0,
                   help="lmcache-mrqa*: rounds per user (LMCache's --num-rounds; default 5)")
    p.add_argument("--working-set", type=float, default=2.0,
                   help="the conversation pool's working set (its histories' KV bytes) as a "
                        "multiple of the CPU bytes: 2 = twice the CPU tier (kvtier_disk's "
                        "case), 0.75 = fits it. Synthetic: sizes the pool from --cpu-gib; a "
                        "preset: sizes the CPU bytes from its pool" + D)
    p.add_argument("--gpu-working-set", type=float, default=None,
                   help="the working set as a multiple of vLLM's GPU KV cache, which it sizes "
                        "(instead of --gpu-kv-gib; default 4 with a preset)")
    p.add_argument("--pool", type=int, default=0,
                   help="conversations in the pool, overriding --working-set (a preset: its "
                        "conversations, LMCache's --num-users)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="each rate lasts at least this many requests' arrivals: max(--duration-s"
                        ", N / rate) s (default: a preset's, else 0)")
    p.add_argument("--first-tokens", type=int, default=2048,
                   help="a conversation's first prompt (system prompt and document)" + D)
    p.add_argument("--user-tokens", type=int, default=192,
                   help="new user tokens per later turn" + D)
    p.add_argument("--answer-tokens", type=int, default=128,
                   help="tokens generated per turn (max_tokens, ignore_eos)" + D)
    p.add_argument("--turns", type=int, default=6,
                   help="turns before a conversation retires and a new one starts" + D)
    p.add_argument("--cpu-gib", type=float, default=None,
                   help="CPU bytes of every connector: kvtier's CPU tier, native's "
                        "cpu_bytes_to_use (default: per --shape)")
    p.add_argument("--gpu-kv-gib", type=float, default=None,
                   help="vLLM's KV cache on the GPU, --kv-cache-memory-bytes (default: per "
                        "--shape)")
    p.add_argument("--disk-gib", type=float, default=0.0,
                   help="kvtier_disk's disk tier (default: 1.5x the working set)")
    p.add_argument("--disk-dir", default="/tmp/kvtier-serving-disk",
                   help="kvtier_disk's tier lives in DIR/serving-SHAPE, removed before and "
                        "after" + D)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block" + D)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's tensor parallelism (GPUs per server)" + D)
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="vLLM's running-request cap, and the warm-up's concurrency" + D)
    p.add_argument("--seed", type=int, default=0, help="seeds tokens, arrivals and picks" + D)
    p.add_argument("--label", default=None,
                   help="the run's key in the results file (default: SHAPE-cpuSIZE-wsX)")
    p.add_argument("--kvtier-json", default=None,
                   help="a JSON object deep-merged into kvtier's configuration (both kvtier "
                        "configurations)")
    add_connector_key_args(p)  # both kvtier configurations
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to become healthy" + D)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on vLLM's CPU backend, a small pool, short rates")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sizes and the plan, start nothing")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"),
                   help="serving_DEVICE.json and .md, and the servers' logs" + D)
    p.add_argument("--timeline", default=None,
                   help="a folder for each kvtier server's timeline (KVTIER_TIMELINE)")
    p.add_argument("--vllm-marks", action="store_true",
                   help="with --timeline: every server also marks vLLM's own step phases "
                        "(diagnostics/vllm_marks.py; summed by diagnostics/serve_phases.py)")
    p.add_argument("--workdir", default="/tmp/kvtier-serving",
                   help="the model's config and kvtier's stats snapshot" + D)
    return p


def floats(p: Parser, flag: str, text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag}: not a comma list of numbers: {text!r}")
    if not xs or any(not x > 0 for x in xs):
        p.error(f"{flag}: give one or more numbers > 0, got {text!r}")
    return xs


def configure(p: Parser, argv) -> argparse.Namespace:
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.cpu_smoke:
        # vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE when that is set,
        # over --kv-cache-memory-bytes: the cap that makes the working set leave vLLM's cache
        # must win, or every turn is a prefix-cache hit and no tier is exercised
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        a.shape, a.block_size, a.max_num_seqs = "tiny", 32, 16
        if a.connectors == p.get_default("connectors"):
            a.connectors = "none,kvtier_cpu,kvtier_disk"
        a.first_tokens, a.user_tokens, a.answer_tokens, a.turns = 128, 32, 8, 3
        a.duration_s, a.drain_s = min(a.duration_s, 6.0), min(a.drain_s, 20.0)
    rates, cpu, gpu = DEFAULTS[a.shape]
    choose_workload(p, a)
    a.rates = floats(p, "--rates", a.rates or rates)
    a.slos = floats(p, "--ttft-slo-ms", a.ttft_slo_ms)
    a.configs = [c for c in a.connectors.split(",") if c]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad or not a.configs or len(set(a.configs)) != len(a.configs):
        p.error(f"--connectors: a comma list of distinct {', '.join(CONFIGS)}; "
                f"got {a.connectors!r}")
    for flag in ("duration_s", "working_set", "first_tokens", "user_tokens", "answer_tokens",
                 "turns", "block_size", "max_num_seqs", "tensor_parallel_size"):
        if not getattr(a, flag) > 0:
            p.error(f"--{flag.replace('_', '-')}: must be > 0")
    if a.drain_s < 0 or a.pool < 0 or a.disk_gib < 0 or a.min_requests < 0:
        p.error("--drain-s, --pool, --disk-gib and --min-requests: must be >= 0")
    if not 2 <= a.turns < 1000:
        p.error("--turns: 2 to 999 (a conversation of one turn reuses nothing)")
    if a.vllm_marks and not a.timeline:
        p.error("--vllm-marks: needs --timeline (the marks are written there)")
    a.max_len = a.workload.max_len() + 64
    a.token_bytes = kv_bytes_per_token(a.shape)
    size_memory(p, a, cpu, gpu)
    cpu_size = size(a.cpu_bytes).replace(" ", "")
    ws = a.ws_bytes / a.cpu_bytes
    a.label = a.label or (f"{a.shape}-cpu{cpu_size}-ws{ws:.2g}x" if a.workload_name ==
                          "synthetic" else f"{a.shape}-{a.workload_name}-cpu{cpu_size}-ws{ws:.2g}x")
    return a


def plan(a) -> str:
    ws, w = a.ws_bytes, a.workload
    spans = [window_s(a, r) for r in a.rates]
    est = len(a.configs) * (45.0 + 10.0 + sum(s + 2.0 for s in spans))
    shared = f"{w.shared} shared + " if w.shared else ""
    desc = w.describe()
    what = desc.get("summary") or "`synthetic` (" + ", ".join(
        f"{k} {v}" for k, v in desc.items() if k != "name") + ")"
    return (f"{a.shape}, workload {what}. {a.pool} conversations x {shared}"
            f"{w.mean_held():.0f} tokens x {a.token_bytes} B/token = working set {size(ws)}; "
            f"CPU {size(a.cpu_bytes)} ({ws / a.cpu_bytes:.2f}x), GPU KV "
            f"{size(a.gpu_kv_bytes)} ({ws / a.gpu_kv_bytes:.1f}x, "
            f"{a.gpu_kv_bytes // a.token_bytes} tokens), disk {size(a.disk_bytes)}; max_len "
            f"{a.max_len}; rates {','.join(f'{r:g}' for r in a.rates)} req/s x "
            f"{'/'.join(f'{s:g}' for s in spans)} s (+ up to {a.drain_s:g} s drain); configs "
            f"{','.join(a.configs)}; about {est / 60:.0f} min with 45 s server starts, more if "
            f"saturated; label {a.label}")


def main(argv=None) -> int:
    a = configure(parser(), argv)
    progress(plan(a))
    if a.dry_run:
        return 0
    a.device = device_name(a.shape)
    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(a.workdir, exist_ok=True)
    model_dir = write_model(os.path.join(a.workdir, f"model-{a.shape}"), a.shape, a.max_len)
    failed = False
    for config in a.configs:
        def save(result: dict, config: str = config) -> None:
            save_result(a, a.label, config, result, None)
        try:
            result = run_config(a, model_dir, config, save)
        except (RuntimeError, OSError, ValueError) as exc:
            failed = True
            progress(f"{config} failed: {exc}")
            save_result(a, a.label, config, None, str(exc)[-3000:])
            continue
        failed |= any(r["errors"] for r in result["rates"].values())
        save(result)
    with open(results_path(a) + ".md") as f:
        print(f.read())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
