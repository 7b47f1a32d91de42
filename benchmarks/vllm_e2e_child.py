"""One configuration of ``vllm_e2e.py`` in its own process: a real vLLM engine, measured.

Runs in a fresh process per configuration (vLLM, CUDA graphs and pinned pools do not share a
process cleanly), and prints one JSON line (``RESULT {...}``) for the parent. Connectors:

* ``none``   - no connector: recompute (vLLM's GPU prefix cache reset between repetitions);
* ``kvtier`` - kvtier, CPU tier only: CPU hits, each paired with a recompute of the same
  prompt in the same engine (``kv_transfer_params`` ``skip_load``/``skip_store``; order
  alternating), the ratio that host-speed drift between processes cannot bend;
* ``kvtier_disk`` - kvtier with a small CPU tier and a disk tier: every prompt is written,
  pushed out of CPU by filler prompts, then timed (cost-aware loading may recompute instead);
* ``native`` - vLLM's ``OffloadingConnector`` with the same CPU bytes;
* ``check``  - kvtier, in-process engine: GPU page bytes after a load against the bytes vLLM
  computed, and tokens/logprobs against vLLM's own prefix-cache hit.

Model weights are random (``load_format="dummy"``) in the shape of a real model's config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from host_probe import add_host_flags
from vllm_e2e_engine import (SHAPES, VOCAB, write_model, tokens, make_llm, BYPASS, gen, settle,
                             reset, timed)


def profiled(llm, prompt: list[int], a, length: int) -> tuple[float, int]:
    """``timed`` under torch.profiler (host calls and CUDA runtime, kernels and copies on the
    GPU): a chrome trace per length in ``--profile DIR``, summarised by diagnostics/profile_summary.py."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    with profile(activities=activities) as prof:
        result = timed(llm, prompt)
    os.makedirs(a.profile, exist_ok=True)
    path = os.path.join(a.profile, f"{a.shape}-{a.connector}-{length}.json")
    prof.export_chrome_trace(path)
    return result


def ttft_sweep(llm, a) -> dict:
    """Per prompt length: first (store or miss) then, after a GPU prefix-cache reset, the
    timed repetition; for disk, every prompt is written first and pushed out of CPU."""
    out: dict = {}
    for length in a.lengths:
        gen(llm, tokens(length, 7, a.vocab))  # warm-up at this length (graphs, allocator)
        progress(f"warm-up {length} done")
    if a.connector == "kvtier_disk":
        for length in a.lengths:
            disk_hits(llm, a, length, out)
        return out
    for length in a.lengths:
        for r in range(a.reps):
            p = tokens(length, 1000 * length + r, a.vocab)
            if a.connector != "none":  # computes and offloads it: a miss, timed too
                timed_rep(llm, a, p, length, r, out, f"{length}:miss", miss=True)
                settle(llm, a)
            if a.new_tokens:  # the next turn: the stored prompt, then new tokens to compute
                p = p + tokens(a.new_tokens, 7_000_000 + 1000 * length + r, a.vocab)
            paired = a.connector == "kvtier" and r % 2 == 1  # the recompute first on odd reps
            if paired:
                timed_rep(llm, a, p, length, r, out, f"{length}:recompute", recompute=True)
            timed_rep(llm, a, p, length, r, out, str(length),
                      profile=bool(a.profile) and r == a.reps - 1)
            if a.connector == "kvtier" and not paired:
                timed_rep(llm, a, p, length, r, out, f"{length}:recompute", recompute=True)
    return out


def timed_rep(llm, a, p: list[int], length: int, r: int, out: dict, key: str, *,
              profile: bool = False, **tags) -> None:
    """One timed request after a GPU prefix-cache reset, marked on the timeline (``tags``
    too, and the CPU time of each busy thread of the process during the request) and
    appended to ``out[key]`` as (ms, cached tokens)."""
    from host_probe import engine_counters, engine_delta, thread_cpu, thread_cpu_delta

    reset(llm)
    if a.quiet_core:  # the request runs on the fastest vCPU of the moment (host_probe.py)
        from host_probe import quiet_core

        tags["core"], tags["core_probe_ms"] = quiet_core(a.cpus)
    cpu = thread_cpu() if a.timeline else {}
    engine = engine_counters() if a.timeline else {}
    mark(a, "client_submit", length=length, rep=r, **tags)
    extra = BYPASS if tags.get("recompute") else None  # same prompt, kvtier told to stay out
    if a.cprofile and not tags.get("miss"):  # paired recomputes apart: like with like vs none
        from diagnostics.cprofile_tables import profiled_call

        what = "-recompute" if extra else ""
        ms, cached = profiled_call(lambda: timed(llm, p, extra), a.cprofile,
                                   f"{a.shape}-{a.connector}-{length}{what}",
                                   f"{a.shape} {a.connector}{what} {length} tokens")
    elif extra:
        ms, cached = timed(llm, p, extra)
    else:
        ms, cached = profiled(llm, p, a, length) if profile else timed(llm, p)
    mark(a, "client_done", length=length, rep=r, ms=ms, cached=cached, connector=a.label,
         **tags, **({"thread_cpu_ms": thread_cpu_delta(cpu)} if cpu else {}),
         **({"engine": engine_delta(engine)} if engine else {}))
    out.setdefault(key, []).append((ms, cached))


def disk_hits(llm, a, length: int, out: dict) -> None:
    """Disk hits at one length, into ``out``: each prompt is written (a settle lets
    write-back copy it to disk), filler prompts push them all out of the CPU tier, then each
    is timed, right after a recompute of the same prompt with kvtier told to stay out (the
    paired baseline). One length at a time, so a CPU tier holding one prompt is enough.
    ``--disk-cold``: the disk files' pages are dropped from the page cache before each timed
    hit (the disk's own read rate; otherwise recently written records read from memory)."""
    prompts = [tokens(length, 1000 * length + r, a.vocab) for r in range(a.reps)]
    for p in prompts:
        gen(llm, p)
        settle(llm, a, quiet_s=1.0)
    step = min(2048, a.max_len - 64)
    for i in range(0, a.disk_cpu_bytes // a.kv_bytes_per_token + step, step):
        gen(llm, tokens(step, 50_000 + 7 * length + i, a.vocab))
        settle(llm, a)
    settle(llm, a, quiet_s=2.0)
    for r, p in enumerate(prompts):
        # the paired recompute goes first: the hit promotes the prompt into the CPU tier
        timed_rep(llm, a, p, length, r, out, f"{length}:recompute", recompute=True)
        if a.disk_cold:
            from diagnostics.vllm_e2e_diag import drop_page_cache

            drop_page_cache(a.disk_dir)
        timed_rep(llm, a, p, length, r, out, str(length))


def progress(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mark(a, ev: str, **fields) -> None:
    if a.timeline:
        from kvtier.observe.timeline import timeline

        timeline().mark("client", ev, **fields)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--connector", required=True,
                   choices=["none", "kvtier", "kvtier_disk", "native",
                            "check"])
    p.add_argument("--lengths", default="1024,2048,8192,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=0,
                   help="hits and recomputes send the stored prompt plus this many new tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-bytes", type=int, default=16 << 30)
    p.add_argument("--disk-cpu-bytes", type=int, default=6 << 30,
                   help="kvtier_disk's CPU tier: must hold one prompt and its write-back")
    p.add_argument("--disk-cold", action="store_true",
                   help="kvtier_disk: drop the disk files from the page cache before each hit")
    p.add_argument("--disk-bytes", type=int, default=40 << 30)
    p.add_argument("--disk-no-fsync", action="store_true",
                   help="kvtier_disk: the disk tier without fsync (isolates fsync's share)")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="kvtier's gil_switch_interval_ms (default: kvtier's own default)")
    p.add_argument("--disk-dir", default=None, help="default: /tmp/kvtier-e2e-disk-<shape>")
    p.add_argument("--gpu-kv-bytes", type=int, default=8 << 30)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--sync-budget", type=int, default=None)
    p.add_argument("--trace", default=None)
    p.add_argument("--trace-requests", type=int, default=300)
    p.add_argument("--trace-offset", type=int, default=0,
                   help="skip the trace's first N requests (its reuse grows towards its end)")
    p.add_argument("--trace-chunks", type=int, default=32)
    p.add_argument("--trace-speedup", type=float, default=4.0)
    p.add_argument("--trace-max-out", type=int, default=32)
    p.add_argument("--timeline", default=None)
    p.add_argument("--profile", default=None,
                   help="directory: torch.profiler chrome trace of the last timed rep per length")
    p.add_argument("--cprofile", default=None,
                   help="directory: cProfile text of the timed hits per length (not misses)")
    p.add_argument("--vllm-marks", action="store_true",
                   help="with --timeline: also mark vLLM's own step phases (diagnostics/vllm_marks.py)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this process (GIL hand-over), seconds")
    p.add_argument("--kvtier-json", default=None,
                   help="a JSON object deep-merged into kvtier's configuration")
    p.add_argument("--label", default=None,
                   help="the configuration's name on timeline marks (default: --connector)")
    add_host_flags(p)
    p.add_argument("--pyspy-dir", default="/tmp/kvtier-e2e-pyspy")
    p.add_argument("--workdir", default="/tmp/kvtier-e2e")
    a = p.parse_args(argv)
    a.label = a.label or a.connector
    a.cpus = sorted(os.sched_getaffinity(0))  # --quiet-core and --cpu-scan pin within these
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    a.vocab = VOCAB[a.shape]
    if not a.disk_dir:  # our own directory, one per geometry and mode: start it empty
        a.disk_dir = f"/tmp/kvtier-e2e-disk-{a.shape}" + ("-cold" if a.disk_cold else "")
        shutil.rmtree(a.disk_dir, ignore_errors=True)
    a.max_len = max(a.lengths + [a.trace_chunks * 512 if a.trace else 0]) + 64 + a.new_tokens
    if a.new_tokens < 0:
        p.error("--new-tokens must be >= 0")
    s = SHAPES[a.shape]
    elem = 4 if a.shape == "tiny" else 2
    a.kv_bytes_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * elem
    a.snapshot = os.path.join(a.workdir, f"stats-{a.connector}.json")
    if a.timeline:
        os.environ["KVTIER_TIMELINE"] = a.timeline
        if a.vllm_marks:
            from diagnostics import vllm_marks

            progress("vLLM phases marked: " + ", ".join(vllm_marks.install()))
    if a.timeline:
        from host_probe import mark_gc_pauses

        mark_gc_pauses()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    os.makedirs(a.workdir, exist_ok=True)
    model_dir = write_model(os.path.join(a.workdir, f"model-{a.shape}"), a.shape, a.max_len)
    if a.connector == "check":
        from vllm_e2e_check import run_check

        print("RESULT " + json.dumps(run_check(a, model_dir)), flush=True)
        return
    from host_probe import probe

    probes = [probe("before engine")]
    t0 = time.perf_counter()
    progress(f"starting {a.connector} {a.shape}")
    llm = a.llm = make_llm(a, model_dir)
    progress(f"engine up after {time.perf_counter() - t0:.0f} s")
    result = {"shape": a.shape, "connector": a.connector, "engine_start_s": time.perf_counter() - t0,
              "host_probe": probes}
    probes.append(probe("engine up"))
    result["ttft"] = ttft_sweep(llm, a)
    if a.quiet_core:  # the engine thread may use every CPU again
        os.sched_setaffinity(0, a.cpus)
    probes.append(probe("after the sweep"))
    if a.cpu_scan:
        from diagnostics.vllm_e2e_diag import cpu_scan

        progress("CPU scan")
        result["cpu_scan"] = cpu_scan(llm, a)
    if a.pyspy:
        from diagnostics.vllm_e2e_diag import sampled_loop

        progress("sampled loop")
        result["sampled_loop"] = sampled_loop(llm, a)
    if a.trace:
        reset(llm)
        progress("trace replay")
        from vllm_e2e_replay import replay

        result["trace"] = replay(llm, a)
    if a.connector.startswith("kvtier") and os.path.exists(a.snapshot):
        settle(llm, a)
        time.sleep(0.5)
        with open(a.snapshot) as f:
            result["kvtier_stats"] = json.load(f)
    print("RESULT " + json.dumps(result), flush=True)
    from kvtier.observe.timeline import timeline

    timeline().flush()  # os._exit skips atexit
    os._exit(0)  # skip vLLM's slow teardown; the parent only needs the line above


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
