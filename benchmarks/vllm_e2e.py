"""kvtier inside real vLLM: TTFT of recompute, CPU hits and disk hits, a trace replay, and checks.

One process per configuration (``vllm_e2e_child.py``), all in one run so every ratio is taken
side by side on the same machine:

* ``none``: no connector (recompute); ``kvtier``: kvtier's CPU tier; ``native``: vLLM's
  ``OffloadingConnector`` with the same CPU bytes; ``kvtier_disk``: kvtier with a small CPU
  tier and a disk tier (prompts pushed out of CPU first; ``kvtier_disk_cold``: the disk
  files dropped from the page cache before each hit; the A/Bs of the early start, the lookup
  prefetch, the whole tail and the one-launch whole load are settled: results/vllm_e2e_*.md);
  ``check``: GPU page bytes and
  tokens/logprobs of kvtier hits against vLLM's own prefix-cache hits.
* Random-weight models built from a config (Llama-3.1-8B shape, Llama-3.2-1B shape), bf16,
  vLLM block size 16, CUDA graphs on (vLLM's default), prefix caching on.
* TTFT: ``LLM.generate`` of one prompt with ``max_tokens=1`` after vLLM's GPU prefix cache
  was reset (so a hit can only come from the connector); median and spread of ``--reps``.
  kvtier's hits are also paired with a recompute of the same prompt in the same engine
  (``skip_load``/``skip_store``): on a host whose CPU speed drifts between processes (the lent
  VM: up to 2x, ``host_probe.py`` prints it per configuration) only the paired ratio is
  trustworthy for host-bound small prompts.
* Trace replay (``--trace``): Mooncake-format requests ``--trace-offset`` on (the bundled
  trace reuses chunks in its tail, far apart), each hash_id a fixed random 512-token chunk
  (shared prefixes are real), arrivals compressed ``--trace-speedup`` times, GPU KV memory
  limited (``--gpu-kv-bytes``) so vLLM's prefix cache overflows; hit tokens per tier.
* A per-step timeline of one kvtier CPU hit (``KVTIER_TIMELINE``): where the time goes
  (``--vllm-marks``: vLLM's own step phases too; GC pauses over 1 ms are marked), and with
  ``--profile DIR`` a torch.profiler trace of one hit per length (``diagnostics/profile_summary.py``).

GPU:  ``python benchmarks/vllm_e2e.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl``
CPU smoke (tiny model, vLLM's CPU engine; what CI runs): ``python benchmarks/vllm_e2e.py
--cpu-smoke``. Writes ``<out-dir>/vllm_e2e_<gpu>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from host_probe import add_host_flags

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = {"recompute": "none", "kvtier_cpu": "kvtier", "native_cpu": "native",
           "kvtier_disk": "kvtier_disk", "kvtier_disk_cold": "kvtier_disk_cold",
           "kvtier_cpu_staged": "kvtier_staged",
           "kvtier_cpu_ab": "kvtier_ab", "kvtier_cpu_ab_late": "kvtier_ab:late",
           "kvtier_cpu_tail": "kvtier_ab_tail", "kvtier_cpu_tail_cut": "kvtier_ab_tail:late",
           "kvtier_cpu_prefetch": "kvtier_ab_prefetch",
           "kvtier_cpu_no_prefetch": "kvtier_ab_prefetch:late",
           "kvtier_cpu_whole": "kvtier_ab_whole", "kvtier_cpu_whole_layered": "kvtier_ab_whole:late",
           "kvtier_miss": "kvtier:miss", "native_miss": "native:miss",
           "kvtier_recompute": "kvtier:recompute", "kvtier_disk_recompute": "kvtier_disk:recompute"}
HEADERS = {"recompute": "recompute", "kvtier_cpu": "kvtier CPU hit", "native_cpu": "native CPU hit",
           "kvtier_disk": "kvtier disk hit", "kvtier_disk_cold": "kvtier disk hit, cold",
           "kvtier_cpu_staged": "kvtier CPU hit, staged copy",
           "kvtier_cpu_ab": "A/B: load started early", "kvtier_cpu_ab_late": "A/B: load at start_load",
           "kvtier_cpu_tail": "A/B: last block whole", "kvtier_cpu_tail_cut": "A/B: cut a block short",
           "kvtier_cpu_prefetch": "A/B: prefetched at lookup",
           "kvtier_cpu_no_prefetch": "A/B: no prefetch",
           "kvtier_cpu_whole": "A/B: whole load in one launch",
           "kvtier_cpu_whole_layered": "A/B: whole load layered",
           "kvtier_miss": "kvtier miss (first pass)", "native_miss": "native miss (first pass)",
           "kvtier_recompute": "recompute in kvtier's engine (paired)",
           "kvtier_disk_recompute": "recompute in kvtier_disk's engine (paired)"}


def run_child(args: list[str], env: dict, timeout: float, log_path: str) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "vllm_e2e_child.py"), *args]
    print("$", " ".join(cmd[1:]), f"  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    # own session: once the child printed its result (or on a timeout) the whole group goes:
    # vLLM's engine-core process included, or it would keep the GPU memory the next
    # configuration needs; and it holds the stdout pipe open (vLLM 0.34's outlives the
    # child's os._exit), so the result is read line by line, not at end of file
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                             start_new_session=True)
        lines: list[str] = []
        done = threading.Event()

        def read() -> None:
            for line in p.stdout:
                lines.append(line)
                if line.startswith("RESULT "):
                    break
            done.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not done.wait(0.5):
            if time.monotonic() > deadline:
                break
            if p.poll() is not None and not done.wait(5.0):  # exited, no result line
                break
        timed_out = not done.is_set() and p.poll() is None
        if done.is_set():  # the child flushes its timeline after the result line, then exits
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever the child left behind
        except ProcessLookupError:
            pass
        p.wait()
    with open(log_path, errors="replace") as f:
        stderr = "\n".join(x for x in f.read().splitlines() if "Capturing CUDA" not in x)
    for line in lines:
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            return out
    if timed_out:
        return {"error": f"timed out after {timeout:.0f}s", "stderr": stderr[-3000:]}
    return {"error": f"exit {p.returncode}", "stderr": stderr[-4000:]}


def summarize(samples: list) -> dict:
    ms = [s[0] for s in samples]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms),
            "cached_tokens": statistics.median(s[1] for s in samples),
            "samples": [[round(s[0], 2), s[1]] for s in samples]}


def timeline_of_one_hit(path: str, length: int) -> list[dict]:
    """Marks between the client's submit and return of the last timed rep at ``length``."""
    try:
        with open(path) as f:
            rows = [json.loads(x) for x in f if x.strip()]
    except OSError:
        return []
    rows.sort(key=lambda r: r["t"])
    subs = [i for i, r in enumerate(rows) if r["ev"] == "client_submit" and r.get("length") == length]
    if not subs:
        return []
    i = subs[-1]
    j = next((k for k in range(i, len(rows)) if rows[k]["ev"] == "client_done"), len(rows) - 1)
    t0 = rows[i]["t"]
    out = []
    for r in rows[i:j + 1]:
        extra = {k: v for k, v in r.items() if k not in ("t", "pid", "who", "ev")}
        out.append({"ms": round((r["t"] - t0) * 1e3, 3), "who": r["who"], "ev": r["ev"], **extra})
    return out


def report(results: dict, gpu: str) -> str:
    lines = [f"# kvtier in real vLLM: {gpu}", ""]
    if results.get("new_tokens"):
        lines += [f"Next turns: each hit and recompute sends the stored prompt (\"prompt tokens\") "
                  f"plus {results['new_tokens']} new tokens; misses store the prompt alone.", ""]
    for shape, res in results["shapes"].items():
        seen = {c for cols in res["ttft"].values() for c in cols}
        shown = [c for c in COLUMNS if c in seen] + sorted(seen - set(COLUMNS))
        lines += [f"## {shape} shape", "", "TTFT (ms, median [min-max] of n); ratio = recompute / hit "
                  "(paired: the same prompt recomputed in kvtier's own engine, kvtier told to stay "
                  "out, order alternating: immune to the host's speed drifting between processes)",
                  "",
                  "| prompt tokens | " + " | ".join(HEADERS.get(c, c) for c in shown)
                  + " | kvtier vs recompute | kvtier vs paired recompute | disk vs paired recompute"
                  " | kvtier vs native |",
                  "|---|" + "---|" * (len(shown) + 4)]
        for length, cols in sorted(res["ttft"].items(), key=lambda kv: int(kv[0])):
            cells = []
            for c in shown:
                s = cols.get(c)
                cells.append(f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] n={s['n']}"
                             if s else "-")
            rec, kv, nat = (cols.get(c, {}).get("median") for c in ("recompute", "kvtier_cpu",
                                                                     "native_cpu"))
            kv = kv or cols.get("kvtier_cpu_ab", {}).get("median")
            same, disk, disk_same = (cols.get(c, {}).get("median") for c in (
                "kvtier_recompute", "kvtier_disk", "kvtier_disk_recompute"))
            lines.append(f"| {length} | " + " | ".join(cells) + " | "
                         + (f"{rec / kv:.2f}x" if rec and kv else "-") + " | "
                         + (f"{same / kv:.2f}x" if same and kv else "-") + " | "
                         + (f"{disk_same / disk:.2f}x" if disk and disk_same else "-") + " | "
                         + (f"{nat / kv:.2f}x" if nat and kv else "-") + " |")
        if res.get("trace"):
            lines += ["", "Trace replay", "", "| connector | req/s | TTFT p50 ms | TTFT p99 ms |"
                      " prompt tokens | GPU-cache hit tokens | connector hit tokens |"
                      " hit tokens per tier |",
                      "|---|---|---|---|---|---|---|---|"]
            for name, t in res["trace"].items():
                tiers = ", ".join(f"{k} {v:.0f}" for k, v in t.get("hit_tokens_per_tier",
                                                                   {}).items()) or "-"
                lines.append(f"| {name} | {t['requests_per_s']:.2f} | {t['ttft_p50_ms']:.0f} | "
                             f"{t['ttft_p99_ms']:.0f} | {t['prompt_tokens']:.0f} | "
                             f"{t['gpu_hit_tokens']:.0f} | {t['external_hit_tokens']:.0f} | "
                             f"{tiers} |")
        if res.get("check"):
            lines += ["", "Correctness: " + json.dumps(res["check"])]
        for conn, rows in res.get("timelines", {}).items():
            if rows:
                lines += ["", f"Timeline of one timed request, {conn} (ms after the client's "
                          "submit):", ""]
                lines += [f"- {r['ms']:8.3f} {r['who']:6} {r['ev']} "
                          + json.dumps({k: v for k, v in r.items() if k not in ("ms", "who", "ev")})
                          for r in rows]
        for conn, cost in res.get("kvtier_cost", {}).items():
            lines += ["", f"Cost model at the end, {conn}: " + json.dumps(cost)]
        for conn, probes in res.get("host_probe", {}).items():
            lines += ["", f"Host probe, {conn} (host_probe.py: pure-Python and memory-copy ms, "
                      "resident pages per NUMA node):", ""]
            lines += [f"- {p['at']}: python {p['python_ms']} ms, memory {p['memory_ms']} ms, "
                      f"pages {p['pages_per_node']}, CPUs {p.get('Cpus_allowed_list')}, "
                      f"nodes {p.get('Mems_allowed_list')}, locked {p.get('VmLck')}" for p in probes]
        if res.get("errors"):
            lines += ["", "Errors: " + json.dumps(res["errors"])[:3000]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8b,1b")
    p.add_argument("--connectors", default="none,kvtier,native,kvtier_disk,check",
                   help="comma list of: none, kvtier, native, kvtier_disk, kvtier_disk_cold "
                        "(page cache dropped before each disk hit), check")
    p.add_argument("--lengths", default="1024,2048,8192,32768",
                   help="prompt lengths in tokens (16 = one vLLM block)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=0,
                   help="next turns: hits and recomputes send each stored prompt plus N new "
                        "tokens (vLLM computes them after the load; not for disk or check)")
    p.add_argument("--disk-reps", type=int, default=3, help="repetitions of the disk configs")
    p.add_argument("--disk-no-fsync", action="store_true",
                   help="disk configs without fsync (isolates fsync's share of a disk-config request)")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="kvtier's gil_switch_interval_ms for every kvtier config (0: Python's 5 ms; "
                        "default: kvtier's default)")
    p.add_argument("--kvtier-json", default=None,
                   help="a JSON object deep-merged into every kvtier config's settings (an A/B of "
                        "one setting, e.g. '{\"tiers\": {\"cpu\": {\"pin\": false}}}'); "
                        "its marks are labelled with --label")
    p.add_argument("--label", default=None,
                   help="suffix of the configurations' names on the timeline (runs compared "
                        "in one timeline file)")
    p.add_argument("--cpu-bytes", type=int, default=None,
                   help="the kvtier and native configs' CPU bytes (default: the child's 16 GiB)")
    p.add_argument("--disk-cpu-bytes", type=int, default=None,
                   help="kvtier_disk's CPU tier bytes (default: the child's 6 GiB, small so the "
                        "TTFT sweep's prompts reach the disk; give --cpu-bytes' value to replay "
                        "a trace with the disk behind the same CPU tier as kvtier and native)")
    p.add_argument("--disk-bytes", type=int, default=None,
                   help="kvtier_disk's disk tier bytes (default: the child's 40 GiB)")
    p.add_argument("--trace", default=None, help="Mooncake trace to replay (none, kvtier, "
                   "native and kvtier_disk each replay it)")
    p.add_argument("--trace-requests", type=int, default=200)
    p.add_argument("--trace-offset", type=int, default=0,
                   help="skip the trace's first N requests (the bundled trace's reuse is in its "
                        "tail: 67%% of the last 400 requests' 512-token chunks were seen before)")
    p.add_argument("--trace-chunks", type=int, default=32,
                   help="512-token chunks kept per request (prompt length cap)")
    p.add_argument("--trace-speedup", type=float, default=4.0,
                   help="arrival times divided by this")
    p.add_argument("--trace-shapes", default="8b", help="shapes that replay the trace")
    p.add_argument("--gpu-kv-bytes", type=int, default=None,
                   help="vLLM's GPU KV cache bytes for every configuration (default: the child's "
                        "8 GiB)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on vLLM's CPU engine (no GPU): checks the harness runs")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--workdir", default=None,
                   help="scratch for the children (models, stats, the timeline; --cpu-smoke's "
                        "disk tiers); default: fixed names under /tmp")
    p.add_argument("--timeout", type=float, default=560.0, help="per configuration, seconds")
    p.add_argument("--vllm-marks", action="store_true",
                   help="kvtier's timeline also marks vLLM's own step phases (diagnostics/vllm_marks.py)")
    p.add_argument("--profile", default=None, help="directory for torch.profiler traces of the "
                   "last timed hit per length (benchmarks/diagnostics/profile_summary.py reads them)")
    p.add_argument("--cprofile", default=None, help="directory for cProfile text of the timed "
                   "hits per length and configuration (function-level host time)")
    add_host_flags(p)
    a = p.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    shapes, lengths, reps = a.shapes.split(","), a.lengths, a.reps
    connectors = a.connectors.split(",")
    if a.cpu_smoke:
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")  # its engine-core process hangs on CPU
        shapes, lengths, reps = ["tiny"], "64,256", min(reps, 2)
        a.trace_shapes = "tiny"
        connectors = [c for c in connectors if c != "native"]  # CUDA only
        gpu = "cpu-smoke"
    else:
        import torch

        gpu = torch.cuda.get_device_name(0)
    scratch = a.workdir or "/tmp"
    tl_path = (os.path.join(a.workdir, "timeline.jsonl") if a.workdir
               else os.path.join("/tmp", f"kvtier-timeline-{os.getpid()}.jsonl"))
    results: dict = {"gpu": gpu, "shapes": {}, "new_tokens": a.new_tokens}
    for shape in shapes:
        res: dict = {"ttft": {}, "trace": {}, "errors": {}}
        for conn in connectors:
            disk = conn.startswith("kvtier_disk")
            args = ["--shape", shape, "--connector", "kvtier_disk" if disk else conn,
                    "--lengths", lengths, "--reps", str(a.disk_reps if disk else reps)]
            if a.new_tokens and not disk and conn != "check":
                args += ["--new-tokens", str(a.new_tokens)]
            if a.cpu_bytes is not None and not a.cpu_smoke:
                args += ["--cpu-bytes", str(a.cpu_bytes)]
            if a.gpu_kv_bytes is not None and not a.cpu_smoke:
                args += ["--gpu-kv-bytes", str(a.gpu_kv_bytes)]
            if disk and not a.cpu_smoke and a.disk_cpu_bytes is not None:
                args += ["--disk-cpu-bytes", str(a.disk_cpu_bytes)]
            if disk and not a.cpu_smoke and a.disk_bytes is not None:
                args += ["--disk-bytes", str(a.disk_bytes)]
            if conn == "kvtier_disk_cold":
                args += ["--disk-cold"]
            if disk and a.disk_no_fsync:
                args += ["--disk-no-fsync"]
            if conn.startswith("kvtier") and a.gil_switch_ms is not None:
                args += ["--gil-switch-ms", str(a.gil_switch_ms)]
            if conn.startswith("kvtier") and a.kvtier_json:
                args += ["--kvtier-json", a.kvtier_json]
            if a.label:
                args += ["--label", f"{conn}@{a.label}"]
            if a.cpu_smoke:
                args += ["--block-size", "32", "--cpu-bytes", str(64 << 20),
                         "--disk-cpu-bytes", str(8 << 20), "--disk-bytes", str(256 << 20),
                         "--disk-dir", os.path.join(scratch, f"kvtier-e2e-smoke-{os.getpid()}-{conn}")]
            if a.workdir:
                args += ["--workdir", os.path.join(a.workdir, "child")]
            if conn == "check":
                args[args.index("--lengths") + 1] = lengths.split(",")[0] + "," + lengths.split(",")[-1] \
                    if not a.cpu_smoke else lengths
            if a.trace and shape in a.trace_shapes.split(",") and conn in ("none", "kvtier", "native", "kvtier_disk"):
                args += ["--trace", a.trace, "--trace-requests", str(a.trace_requests),
                         "--trace-offset", str(a.trace_offset), "--trace-speedup",
                         str(a.trace_speedup),
                         "--trace-chunks", "1" if a.cpu_smoke else str(a.trace_chunks)]
            marked = conn in ("kvtier", "kvtier_staged") \
                or disk or (
                a.vllm_marks and conn in ("none", "native"))  # vLLM's phases: compare like with like
            if marked:
                args += ["--timeline", tl_path]
                if a.vllm_marks:
                    args += ["--vllm-marks"]
            if a.profile and conn in ("none", "kvtier", "native"):
                args += ["--profile", a.profile]
            if a.cprofile:
                args += ["--cprofile", a.cprofile]
            if a.quiet_core:
                args += ["--quiet-core"]
            if a.cpu_scan and conn != "check":
                args += ["--cpu-scan", str(a.cpu_scan)]
            if a.pyspy and conn != "check":
                args += ["--pyspy", str(a.pyspy), "--pyspy-bin", a.pyspy_bin,
                         "--pyspy-dir", os.path.join(a.out_dir, "pyspy")]
            os.makedirs(os.path.join(a.out_dir, "logs"), exist_ok=True)
            out = run_child(args, env, a.timeout,
                            os.path.join(a.out_dir, "logs", f"{shape}-{conn}.log"))
            if "error" in out:
                res["errors"][conn] = out
                print(f"  {conn}: {out['error']}\n{out.get('stderr', '')[-1500:]}", flush=True)
                continue
            print(f"  {conn}: done in {out['wall_s']} s (engine start {out.get('engine_start_s', 0):.0f} s)",
                  flush=True)
            if out.get("host_probe"):
                res.setdefault("host_probe", {})[conn] = out["host_probe"]
            if conn == "check":
                res["check"] = out
                continue
            for key, samples in out["ttft"].items():
                length, _, variant = key.partition(":")
                name = f"{conn}:{variant}" if variant else conn
                col = next((k for k, v in COLUMNS.items() if v == name), name)
                res["ttft"].setdefault(length, {})[col] = summarize(samples)
            if out.get("trace"):
                res["trace"][conn] = out["trace"]
            if out.get("cpu_scan"):
                res.setdefault("cpu_scan", {})[conn] = out["cpu_scan"]
                print(f"  {conn}: 16-token ms per CPU: " + ", ".join(
                    f"{c}:{v['ms']}" for c, v in out["cpu_scan"].items()), flush=True)
                print(f"  {conn}: python probe ms per CPU: " + ", ".join(
                    f"{c}:{v['python_ms']}" for c, v in out["cpu_scan"].items()), flush=True)
            if out.get("sampled_loop"):
                res.setdefault("sampled_loop", {})[conn] = out["sampled_loop"]
                loop = out["sampled_loop"]["ms"]
                print(f"  {conn}: sampled 16-token loop median {statistics.median(loop):.2f} ms "
                      f"(n={len(loop)}); {out['sampled_loop']['pyspy'][-200:]}", flush=True)
            if out.get("kvtier_stats"):
                res.setdefault("kvtier_stats", {})[conn] = out["kvtier_stats"].get("manager")
                if out["kvtier_stats"].get("cost"):
                    res.setdefault("kvtier_cost", {})[conn] = out["kvtier_stats"]["cost"]
            if marked and lengths:
                hit = timeline_of_one_hit(tl_path, int(lengths.split(",")[-2 if
                                          len(lengths.split(",")) > 1 else 0]))
                res.setdefault("timelines", {})[conn] = hit
                if conn.startswith("kvtier") and not disk:
                    res["timeline"] = hit
        results["shapes"][shape] = res
    first = results["shapes"][shapes[0]]
    if os.path.exists(tl_path):  # every mark of the run, for a closer look
        shutil.copy(tl_path, os.path.join(a.out_dir, "timeline.jsonl"))
    results["model"] = shapes[0]
    results["ttft_ms"] = {length: {c: s["median"] for c, s in cols.items()}
                          for length, cols in first["ttft"].items()}
    results["trace_replay"] = first.get("trace", {})
    text = report(results, gpu)
    print(text)
    os.makedirs(a.out_dir, exist_ok=True)
    stem = os.path.join(a.out_dir, "vllm_e2e_" + gpu.replace(" ", "-").replace("/", "-"))
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    return 1 if any(r.get("errors") for r in results["shapes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
