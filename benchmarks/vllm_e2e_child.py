"""One configuration of ``vllm_e2e.py`` in its own process: a real vLLM engine, measured.

Runs in a fresh process per configuration (vLLM, CUDA graphs and pinned pools do not share a
process cleanly), and prints one JSON line (``RESULT {...}``) for the parent. Connectors:

* ``none``   - no connector: recompute (vLLM's GPU prefix cache reset between repetitions);
* ``kvtier`` - kvtier, CPU tier only: CPU hits, each paired with a recompute of the same
  prompt in the same engine (``kv_transfer_params`` ``skip_load``/``skip_store``; order
  alternating), the ratio that host-speed drift between processes cannot bend;
* ``kvtier_disk`` - kvtier with a small CPU tier and a disk tier: every prompt is written,
  pushed out of CPU by filler prompts, then timed (cost-aware loading may recompute instead);
* ``kvtier_ab`` - kvtier, CPU tier only, each repetition timed twice in the same engine:
  synchronous loads started early (the default: handed over when planned, or at vLLM's first
  worker hook) and at ``start_load_kv`` (the paired A/B of the early start);
* ``kvtier_ab_tail`` - the same pairing for the last block of a hit that reaches the prompt's
  last token: loaded whole (one token computed, the default) or not (a block computed);
* ``kvtier_ab_prefetch`` - the same pairing for a hit's copy started at the lookup (its first
  pieces prefetched, the default) or once the load is planned;
* ``kvtier_ab_whole`` - the same pairing for a hit's load that its forward waits for whole
  (``LoadStoreSpec.whole``): one kernel launch at any size, or layer by layer (as before);
* ``native`` - vLLM's ``OffloadingConnector`` with the same CPU bytes;
* ``check``  - kvtier, in-process engine: GPU page bytes after a load against the bytes vLLM
  computed, and tokens/logprobs against vLLM's own prefix-cache hit.

Model weights are random (``load_format="dummy"``) in the shape of a real model's config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

from host_probe import add_host_flags

SHAPES = {  # Llama-3.1-8B and Llama-3.2-1B configs (weights random)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=False),
}
VOCAB = {"8b": 128256, "1b": 128256, "tiny": 1000}


def write_model(path: str, shape: str, max_len: int) -> str:
    os.makedirs(path, exist_ok=True)
    dtype = "float32" if shape == "tiny" else "bfloat16"
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
               vocab_size=VOCAB[shape], max_position_embeddings=max(max_len, 131072),
               rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype=dtype, bos_token_id=1,
               eos_token_id=2, hidden_act="silu")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def connector_json(connector: str, cpu_bytes: int, block_size: int, *, tiers: dict | None = None,
                   kvtier: dict | None = None, extra: dict | None = None) -> dict | None:
    """``--kv-transfer-config`` of a configuration as JSON (None: no connector): kvtier with a
    CPU tier of ``cpu_bytes`` (or ``tiers``; ``kvtier`` deep-merged into its section, ``extra``
    into kv_connector_extra_config), or vLLM's ``OffloadingConnector`` with the same bytes."""
    if connector == "none":
        return None
    if connector == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    section = {"block_tokens": block_size, "tiers": tiers or {"cpu": {"capacity": cpu_bytes}}}
    merge(section, kvtier or {})
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra or {}, kvtier=section)}


def transfer_config(a):
    from vllm.config import KVTransferConfig

    tiers = None
    if a.connector == "kvtier_disk":
        tiers = {"cpu": {"capacity": a.disk_cpu_bytes},
                 "disk": {"path": a.disk_dir, "capacity": a.disk_bytes, "fsync": not a.disk_no_fsync}}
    section = {"stats": {"snapshot_path": a.snapshot, "interval_s": 0.2}}
    if a.gil_switch_ms is not None:
        section["gil_switch_interval_ms"] = a.gil_switch_ms
    if a.kvtier_json:  # an A/B of one setting (pool pinning, stats thread, ...)
        merge(section, json.loads(a.kvtier_json))
    extra = {} if a.sync_budget is None else {"sync_load_budget_bytes": a.sync_budget}
    name = "native" if a.connector == "native" else "none" if a.connector == "none" else "kvtier"
    d = connector_json(name, a.cpu_bytes, a.block_size, tiers=tiers, kvtier=section, extra=extra)
    return None if d is None else KVTransferConfig(**d)


def merge(into: dict, extra: dict) -> None:
    """Deep-merge ``extra`` into ``into`` (mappings merged, anything else replaced)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def make_llm(a, model_dir: str):
    from vllm import LLM

    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              block_size=a.block_size, max_model_len=a.max_len, seed=0,
              enable_prefix_caching=True, kv_transfer_config=transfer_config(a),
              disable_log_stats=False, max_num_seqs=a.max_num_seqs)
    if a.shape == "tiny":
        kw.update(dtype="float32", enforce_eager=True)
    else:
        kw.update(dtype="bfloat16", kv_cache_memory_bytes=a.gpu_kv_bytes)
    return LLM(**kw)


BYPASS = {"kv_transfer_params": {"kvtier": {"skip_load": True, "skip_store": True}}}


def sampling(max_tokens: int = 1, logprobs: bool = False, extra_args: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False, logprobs=0 if logprobs else None,
                          extra_args=extra_args)


def gen(llm, prompt: list[int], max_tokens: int = 1, logprobs: bool = False,
        extra_args: dict | None = None):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                        sampling(max_tokens, logprobs, extra_args), use_tqdm=False)[0]


def settle(llm, a, quiet_s: float = 0.0) -> None:
    """Let offloads finish: ``generate`` returns before stores settle, and the engine keeps
    stepping while a connector has pending work. ``quiet_s``: also wait until kvtier's stats
    snapshot has not changed for that long (disk demotions)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:  # in-process engine: nobody steps it but us
        connector = core.scheduler.connector
        for _ in range(100_000):
            if connector is None or not connector.has_pending_push_work():
                break
            llm.llm_engine.step()
            time.sleep(0.001)
    else:  # the engine-core process keeps stepping while a connector has pending work
        time.sleep(0.2)
        gen(llm, tokens(8, 998, a.vocab))
        time.sleep(0.1)
    if not quiet_s or not a.connector.startswith("kvtier"):
        return
    last, since, deadline = None, time.monotonic(), time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with open(a.snapshot) as f:
                usage = json.load(f).get("usage")
        except (OSError, ValueError):
            usage = None
        if usage != last:
            last, since = usage, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def reset(llm) -> None:
    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        if getattr(llm.llm_engine.engine_core, "engine_core", None) is not None:
            llm.llm_engine.step()  # in-process: finish what holds the blocks
        time.sleep(0.05)
    raise RuntimeError("vLLM refused to reset its prefix cache (blocks still in use)")


def timed(llm, prompt: list[int], extra_args: dict | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = gen(llm, prompt, extra_args=extra_args)
    return (time.perf_counter() - t0) * 1e3, int(out.num_cached_tokens or 0)


def profiled(llm, prompt: list[int], a, length: int) -> tuple[float, int]:
    """``timed`` under torch.profiler (host calls and CUDA runtime, kernels and copies on the
    GPU): a chrome trace per length in ``--profile DIR``, summarised by profile_summary.py."""
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
    from vllm_e2e_diag import ab_switch

    switch = ab_switch(a)
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
            for early in ((False, True) if r % 2 == 0 else (True, False)) if switch else (None,):
                if switch:
                    switch(early)
                timed_rep(llm, a, p, length, r, out,
                          str(length) if early in (True, None) else f"{length}:late",
                          profile=bool(a.profile) and r == a.reps - 1 and early in (True, None))
            if a.connector == "kvtier" and not paired:
                timed_rep(llm, a, p, length, r, out, f"{length}:recompute", recompute=True)
    if switch:
        switch(True)
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
        from cprofile_tables import profiled_call

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
            from vllm_e2e_diag import drop_page_cache

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
                   choices=["none", "kvtier", "kvtier_ab", "kvtier_ab_tail", "kvtier_ab_prefetch", "kvtier_ab_whole", "kvtier_disk", "native",
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
                   help="with --timeline: also mark vLLM's own step phases (vllm_marks.py)")
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
            import vllm_marks

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
        from vllm_e2e_diag import cpu_scan

        progress("CPU scan")
        result["cpu_scan"] = cpu_scan(llm, a)
    if a.pyspy:
        from vllm_e2e_diag import sampled_loop

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
