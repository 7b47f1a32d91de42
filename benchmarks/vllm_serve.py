"""kvtier behind ``vllm serve``: TTFT over vLLM's OpenAI HTTP API, the way users run it.

Why: ``vllm_e2e.py`` drives vLLM's engine in the benchmark's own process (``LLM``, engine
multiprocessing off) to see inside a step. Users run ``vllm serve``: an API server process,
the engine core in a process of its own (on a GPU with TP 1 the worker runs in that process,
vLLM's uni-process executor; on vLLM's CPU backend a separate worker process), requests over
HTTP, tokens streamed back. This measures what their clients see, with the same one flag the
README gives.

One server per configuration (``none`` / ``kvtier`` / ``native``: vLLM's
``OffloadingConnector`` with the same CPU bytes), one after another on the same machine, each
started on 127.0.0.1 and stopped by its process group:

* **TTFT**: per length and repetition a fresh random prompt is sent once (a miss: computed;
  a connector stores it), vLLM's GPU prefix cache is reset (``POST /reset_prefix_cache``,
  ``VLLM_SERVER_DEV_MODE=1``; vLLM refuses while blocks are held, e.g. by stores in flight,
  so it is retried), then the same prompt again: a hit from the connector's CPU tier, or a
  recompute for ``none``. For kvtier the same prompt is also recomputed with
  ``kv_transfer_params.kvtier.skip_load`` (the paired recompute, same server). TTFT is the
  client's clock from sending the request to the first streamed token.
* **Tokens**: the hit's greedy token and logprob against the miss's, per request.
* **Burst** (``--burst K``): K prompts of ``--burst-length`` tokens stored, the cache reset, then
  all K sent at once: each one's TTFT and the time until the last first token.

GPU: ``python benchmarks/vllm_serve.py --shape 8b --lengths 1024,8192,32768``. CPU smoke
(tiny model, vLLM's CPU backend; CI runs it): ``python benchmarks/vllm_serve.py --cpu-smoke``.
Writes ``<out-dir>/vllm_serve_<device>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# put ahead on a server's PYTHONPATH: its processes mark vLLM's step phases (--vllm-marks)
SERVE_MARKS = os.path.join(HERE, "diagnostics", "serve_marks")
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from serve_client import Completion, Server, complete, reset_prefix_cache  # noqa: E402
from vllm_e2e_engine import VOCAB, connector_json, merge, tokens, write_model  # noqa: E402

SKIP = {"kvtier": {"skip_load": True, "skip_store": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_connector_key_args(p: argparse.ArgumentParser) -> None:
    """The kvtier ``kv_connector_extra_config`` keys a benchmark's A/B may set
    (:func:`connector_keys` reads them back)."""
    p.add_argument("--sync-budget", default=None,
                   help="kvtier's sync_load_budget_bytes (bytes or a size such as 512MiB; 0: "
                        "every hit loads asynchronously, so no engine step waits for a load)")
    p.add_argument("--store-every-steps", type=int, default=None,
                   help="kvtier's store_every_steps: running requests' decoded blocks are "
                        "stored every this many engine steps (default: kvtier's)")
    p.add_argument("--store-answers", action="store_true",
                   help="kvtier's offload_prompt_only false: store decoded blocks too (by "
                        "default kvtier stores prompt blocks only, as vLLM 0.34's native "
                        "connector does)")


def connector_keys(a: argparse.Namespace) -> dict:
    """The connector keys ``a`` sets (those :func:`add_connector_key_args` defines)."""
    keys = {} if a.sync_budget is None else {"sync_load_budget_bytes": a.sync_budget}
    if a.store_every_steps is not None:
        keys["store_every_steps"] = a.store_every_steps
    if a.store_answers:
        keys["offload_prompt_only"] = False
    return keys


def server_args(a, model_dir: str, connector: str, port: int) -> list[str]:
    args = ["--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
            "--skip-tokenizer-init", "--max-model-len", str(a.max_len), "--enable-prefix-caching", "--seed", "0",
            "--max-num-seqs", str(a.max_num_seqs), "--enable-prompt-tokens-details"]
    if a.block_size:  # 0: vLLM's default (64 tokens from vLLM 0.34), as a user who sets none
        args += ["--block-size", str(a.block_size)]
    if a.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(a.tensor_parallel_size)]
    if a.shape == "tiny":  # vLLM's CPU backend: its share of host memory, no graphs
        args += ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
    else:
        args += ["--dtype", "bfloat16"]
    if a.gpu_kv_bytes:
        args += ["--kv-cache-memory-bytes", str(a.gpu_kv_bytes)]
    section = {"stats": {"snapshot_path": snapshot_path(a, connector), "interval_s": 0.2}}
    if a.kvtier_json:  # an A/B of one kvtier setting
        merge(section, json.loads(a.kvtier_json))
    cfg = connector_json(connector, a.cpu_bytes, a.block_size, kvtier=section,
                         extra=connector_keys(a))
    if cfg is not None:
        args += ["--kv-transfer-config", json.dumps(cfg)]
    return args


def snapshot_path(a, connector: str) -> str:
    return os.path.join(a.workdir, f"serve-stats-{connector}.json")


def settle(server: Server, a) -> int:
    """Reset vLLM's GPU prefix cache, retried while blocks are held (a store in flight):
    returns the attempts it took."""
    deadline = time.monotonic() + a.settle_timeout
    n = 0
    while True:
        n += 1
        if reset_prefix_cache(server.url):
            return n
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: /reset_prefix_cache still refused after "
                               f"{a.settle_timeout} s (blocks held)")
        time.sleep(0.02)


def sweep(server: Server, a, connector: str) -> dict:
    out: dict = {}
    for length in a.lengths:
        row = out.setdefault(str(length), {"miss": [], "hit": [], "paired": [], "token_equal": 0,
                                            "logprob_diff": 0.0, "cached": [], "paired_cached": [],
                                            "resets": []})
        for r in range(a.reps):
            prompt = tokens(length, seed=7919 * length + r, vocab=a.vocab)
            miss = send(server, prompt, "miss", rep=r)
            row["resets"].append(settle(server, a))
            if connector == "kvtier" and r % 2 == 1:  # paired recompute first on odd reps
                paired(server, a, prompt, row)
            hit = send(server, prompt, "hit", rep=r)
            row["resets"].append(settle(server, a))
            if connector == "kvtier" and r % 2 == 0:
                paired(server, a, prompt, row)
            row["miss"].append(miss.ttft_ms)
            row["hit"].append(hit.ttft_ms)
            row["cached"].append(hit.cached_tokens)
            row["token_equal"] += int(hit.token == miss.token)
            row["logprob_diff"] = max(row["logprob_diff"], abs(hit.logprob - miss.logprob))
        progress(f"{server.name} {length}: hit {statistics.median(row['hit']):.1f} ms, "
                 f"miss {statistics.median(row['miss']):.1f} ms")
    return out


def send(server: Server, prompt: list[int], kind: str, kv_params: dict | None = None,
         **fields) -> Completion:
    """One timed request, between the client's two timeline marks."""
    mark("client_submit", length=len(prompt), kind=kind, config=server.name, **fields)
    done = complete(server.url, server.model, prompt, kv_params)
    mark("client_token", length=len(prompt), kind=kind, config=server.name, **fields)
    return done


def paired(server: Server, a, prompt: list[int], row: dict) -> None:
    """The prompt recomputed in kvtier's server (its hit skipped, nothing stored)."""
    done = send(server, prompt, "paired", SKIP)
    row["paired"].append(done.ttft_ms)
    row["paired_cached"].append(done.cached_tokens)
    row["resets"].append(settle(server, a))


def burst(server: Server, a, k: int) -> dict:
    """K prompts stored, the cache reset, then all sent at once."""
    length = a.burst_length or max(a.lengths)
    prompts = [tokens(length, seed=104729 + i, vocab=a.vocab) for i in range(k)]
    for p in prompts:
        complete(server.url, server.model, p)
    settle(server, a)
    results: list = [None] * k
    start = threading.Barrier(k + 1)

    def one(i: int) -> None:
        start.wait()
        mark("client_submit", length=length, kind="burst", config=server.name, rep=i)
        try:
            results[i] = complete(server.url, server.model, prompts[i])
            mark("client_token", length=length, kind="burst", config=server.name, rep=i,
                 ttft_ms=results[i].ttft_ms, cached=results[i].cached_tokens)
        except (RuntimeError, OSError, ValueError) as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    wall = (time.perf_counter() - t0) * 1e3
    failed = [r for r in results if not isinstance(r, Completion)]
    if failed:
        raise RuntimeError(f"{server.name}: {len(failed)} of {k} burst requests failed: {failed[0]}")
    ttfts = sorted(r.ttft_ms for r in results)
    return {"length": length, "k": k, "ttft_ms": ttfts, "median_ms": statistics.median(ttfts),
            "last_first_token_ms": max(ttfts), "wall_ms": wall,
            "cached_tokens": sum(r.cached_tokens for r in results)}


def run_config(a, model_dir: str, connector: str) -> dict:
    port = free_port()
    log = os.path.join(a.out_dir, f"server-{a.shape}-{connector}.log")
    snap = snapshot_path(a, connector)
    if os.path.exists(snap):
        os.remove(snap)
    env = {"HF_HUB_OFFLINE": "1"}
    if a.timeline:  # the server's engine processes end killed: write marks as they age
        env["KVTIER_TIMELINE_FLUSH_S"] = "1"
    if a.shape == "tiny":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    path = (SERVE_MARKS,) if a.vllm_marks else ()
    server = Server(connector, model_dir, server_args(a, model_dir, connector, port), port, log,
                    env, path)
    t0 = time.perf_counter()
    try:
        server.start(timeout_s=a.start_timeout)
        progress(f"{connector}: server up after {time.perf_counter() - t0:.0f} s")
        result = {"connector": connector, "server_start_s": time.perf_counter() - t0,
                  "ttft": sweep(server, a, connector)}
        if a.burst:
            result["burst"] = burst(server, a, a.burst)
            settle(server, a)
        if connector == "kvtier":
            time.sleep(0.5)  # the stats thread's next snapshot
            with open(snap) as f:
                result["kvtier_stats"] = json.load(f)
    finally:
        if a.timeline:
            flush_marks(server)
        server.stop()
    return result


def flush_marks(server: Server) -> None:
    """The server's processes write their marks when one comes a second after their last
    write (``KVTIER_TIMELINE_FLUSH_S``) and are killed at the end: a call after that second
    makes the API server and the engine core (on a GPU, where the worker runs too) write the
    last requests' marks."""
    time.sleep(1.2)
    try:
        reset_prefix_cache(server.url)
    except OSError:  # a server that died keeps what it wrote
        pass


def mark(ev: str, **fields) -> None:
    """A client mark on kvtier's timeline (``--timeline``; one clock with the server's)."""
    from kvtier.observe.timeline import timeline

    timeline().mark("client", ev, **fields)


def progress(msg: str) -> None:
    print(f"[vllm_serve] {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]" if xs else "-"


def ratio(results: dict, base: str, name: str, length: str) -> str:
    """How many times faster ``name``'s hit is than ``base``'s (none's is a recompute)."""
    if base == name or base not in results:
        return "-"
    b, x = results[base]["ttft"][length]["hit"], results[name]["ttft"][length]["hit"]
    return f"{statistics.median(b) / statistics.median(x):.2f}x"


def report(a, results: dict, errors: dict) -> str:
    lines = [f"# kvtier behind `vllm serve` — {a.device}, {a.shape} shape", "",
             f"`{' '.join(sys.argv)}`", "",
             "TTFT at the HTTP client (ms, median [min-max] of "
             f"{a.reps}); hit = the prompt again after vLLM's GPU prefix cache was reset.", "",
             "| tokens | config | hit | miss | paired recompute | vs none | vs native | "
             "tokens equal | max logprob diff | cached tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for length in map(str, a.lengths):
        for name, res in results.items():
            row = res["ttft"][length]
            lines.append(f"| {length} | {name} | {med(row['hit'])} | {med(row['miss'])} | "
                         f"{med(row['paired'])} | {ratio(results, 'none', name, length)} | "
                         f"{ratio(results, 'native', name, length)} | {row['token_equal']}/{a.reps} | "
                         f"{row['logprob_diff']:.3g} | {statistics.median(row['cached']):.0f} |")
    bursts = [(n, r["burst"]) for n, r in results.items() if "burst" in r]
    if bursts:
        lines += ["", "| burst | config | median TTFT | last first token | cached tokens |",
                  "|---|---|---|---|---|"]
        for n, b in bursts:
            lines.append(f"| {b['k']} x {b['length']} | {n} | {b['median_ms']:.1f} | "
                         f"{b['last_first_token_ms']:.1f} | {b['cached_tokens']} |")
    lines += ["", "Server start-up (launch to a healthy `/health`, TP "
              f"{a.tensor_parallel_size}): " + ", ".join(
                  f"{n} {r['server_start_s']:.1f} s" for n, r in results.items())]
    lines += [f"\n**{n} failed:** {e}" for n, e in errors.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", choices=["8b", "1b", "tiny"])
    p.add_argument("--connectors", default="none,kvtier,native")
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--burst", type=int, default=0, help="K stored prompts sent at once")
    p.add_argument("--burst-length", type=int, default=0, help="default: the largest length")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block; 0: vLLM's default, and kvtier's block_tokens "
                        "left to follow it")
    p.add_argument("--cpu-bytes", type=int, default=16 << 30,
                   help="kvtier's CPU tier and native's cpu_bytes_to_use")
    p.add_argument("--gpu-kv-bytes", type=int, default=0,
                   help="vLLM's --kv-cache-memory-bytes (default: vLLM's own sizing)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's TP degree (server start-up is reported per configuration)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--settle-timeout", type=float, default=60.0)
    p.add_argument("--kvtier-json", default=None,
                   help="a JSON object deep-merged into kvtier's configuration")
    add_connector_key_args(p)
    p.add_argument("--timeline", default=None,
                   help="file: kvtier's per-step marks (KVTIER_TIMELINE) and the client's")
    p.add_argument("--vllm-marks", action="store_true",
                   help="with --timeline: also mark vLLM's step, intake and output phases in the "
                        "server's processes (diagnostics/vllm_marks.py; summed by diagnostics/serve_phases.py)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on vLLM's CPU backend, none and kvtier, lengths 64,512")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--workdir", default="/tmp/kvtier-serve")
    a = p.parse_args(argv)
    if a.vllm_marks and not a.timeline:
        p.error("--vllm-marks needs --timeline")
    if a.timeline:  # before the first mark and before any server starts: they inherit it
        os.environ["KVTIER_TIMELINE"] = a.timeline
    if a.cpu_smoke:
        a.shape, a.block_size, a.cpu_bytes = "tiny", 32, 64 << 20
        a.gpu_kv_bytes = a.gpu_kv_bytes or 256 << 20
        if a.connectors == p.get_default("connectors"):
            a.connectors = "none,kvtier"
        if a.lengths == p.get_default("lengths"):
            a.lengths = "64,512"
        a.reps = min(a.reps, 3)
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    if not a.lengths:
        p.error("--lengths: at least one length")
    a.vocab = VOCAB[a.shape]
    a.max_len = max(a.lengths + [a.burst_length]) + 64
    a.device = device_name(a.shape)
    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(a.workdir, exist_ok=True)
    model_dir = write_model(os.path.join(a.workdir, f"model-{a.shape}"), a.shape, a.max_len)
    names = a.connectors.split(",")
    for connector in names:
        if connector not in ("none", "kvtier", "native"):
            p.error(f"--connectors: unknown {connector!r} (none, kvtier, native)")
    results: dict = {}
    errors: dict = {}
    for connector in names:  # written after each one: a run cut short keeps what it measured
        try:
            results[connector] = run_config(a, model_dir, connector)
        except (RuntimeError, OSError, ValueError) as exc:
            errors[connector] = str(exc)
            progress(f"{connector} failed: {exc}")
        write(a, results, errors)
    print(report(a, results, errors))
    return 1 if errors else 0


def write(a, results: dict, errors: dict) -> None:
    stem = os.path.join(a.out_dir, f"vllm_serve_{a.device.replace(' ', '-')}")
    with open(stem + ".json", "w") as f:
        json.dump({"device": a.device, "shape": a.shape, "argv": sys.argv[1:],
                   "results": results, "errors": errors}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report(a, results, errors))
    return 0


def device_name(shape: str) -> str:
    if shape == "tiny":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
