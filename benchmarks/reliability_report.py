"""Reliability figures: crash kills, corruption, disk faults, model checking and a soak, in one run.

Runs the same machinery as tests/reliability/test_reliability_*.py (helpers beside them) for
longer and prints what the issue asks for: runs, kills, injected faults by kind, wrong blocks
served (must be 0), pins leaked (must be 0) and peak RSS, plus per-section detail.

    python benchmarks/reliability_report.py            # moderate: a few minutes
    python benchmarks/reliability_report.py --quick    # ~1 minute smoke run
    python benchmarks/reliability_report.py --long     # >= 200 kills, 1M ops, 30 min soak
    python benchmarks/reliability_report.py --json

Sections:

* crash: a child process stores / deletes / compacts / reopens a DiskStore (fsync on) and is
  SIGKILLed at a random point, ``--crash`` times; every restart is checked against the child's
  journal (nothing acknowledged lost, every listed block verifies and is a version written for
  its key, batches atomic).
* corruption: each kind of damage x {raw, zstd} through manager + transfer engine.
* faults: the full stack under load while the disk misbehaves, in phases: random faults of
  every kind, a completely full disk (degraded mode, then recovery), healthy.
* model: the manager against its reference model, ``--model-ops`` random operations.
* soak: overlapping concurrent requests for ``--soak-s`` seconds; RSS growth after warm-up.

The rig and the model checker make the vLLM connector's calls (``lookup`` until promotions are
done, ``prepare_load``, ``kvtier.transfer.jobs`` to read results), so "wrong blocks served"
is about the path vLLM runs.

Exit status 1 if any section found a violation.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reliability.blocks import identify  # noqa: E402
from reliability.corrupt import CODECS, CORRUPTIONS, disk_only_rig, load_after_damage  # noqa: E402
from reliability.crash_loop import run_crash_iterations  # noqa: E402
from reliability.faults import DiskFaults  # noqa: E402
from reliability.model import ManagerModel, run_random  # noqa: E402
from reliability.rig import StackRig  # noqa: E402
from reliability.soak import peak_rss_bytes, rss_bytes, run_soak  # noqa: E402

from kvtier.manager.disk_health import DiskHealth  # noqa: E402

MODES = {
    "quick": dict(crash=20, model_ops=40_000, soak_s=15.0, fault_s=12.0),
    "moderate": dict(crash=200, model_ops=300_000, soak_s=90.0, fault_s=60.0),
    "long": dict(crash=500, model_ops=1_000_000, soak_s=1800.0, fault_s=300.0),
}
MiB = 2**20


def section_crash(root: Path, iterations: int) -> dict:
    s = run_crash_iterations(root, iterations, seed=int(time.time()) % 1000)
    out = s.to_dict()
    out["violation_details"] = s.violations[:5]
    out["ok"] = not s.violations
    return out


def section_corruption(root: Path) -> dict:
    cases, problems, wrong, injected = 0, [], 0, Counter()
    for codec in sorted(CODECS):
        for corrupt in CORRUPTIONS:
            rig, keys = disk_only_rig(root / f"{codec}-{corrupt.__name__}", codec)
            try:
                out = load_after_damage(rig, keys, corrupt)
            finally:
                rig.close()
            cases += 1
            injected[f"corrupt:{corrupt.__name__}"] += 1
            wrong += out.wrong_blocks
            problems += [f"{codec}/{corrupt.__name__}: {p}" for p in out.problems]
    return {"cases": cases, "injected": dict(injected), "wrong_blocks": wrong,
            "pins_leaked": 0 if not any("leaks" in p for p in problems) else 1,
            "problems": problems, "ok": not problems}


def section_faults(root: Path, seconds: float) -> dict:
    health = DiskHealth(fail_threshold=3, retry_after_s=0.5, max_retry_after_s=2.0)
    rig = StackRig(root, cpu_blocks=32, disk_blocks=160, gpu_blocks=256, fsync=True,
                   segment_bytes=32 * 2120, health=health, disk_write_jobs=2)
    phases = Counter()
    requests = 0
    with DiskFaults(seed=17) as faults:
        start = time.monotonic()
        phase = 0
        while time.monotonic() - start < seconds:
            kind = ("storm", "full", "healthy")[phase % 3]
            faults.disarm()
            if kind == "storm":
                for k in ("write_enospc", "write_eio", "torn_write", "fsync_eio", "index_full"):
                    faults.arm(k, 0.04)
                faults.arm("read_eio", 0.03)
            elif kind == "full":
                faults.arm("write_enospc", 1.0)
                faults.arm("index_full", 1.0)
            requests += run_soak(rig, seconds=min(4.0, seconds / 6), seed=phase,
                                 max_in_flight=10).requests
            phases[kind] += 1
            phase += 1
        faults.disarm()
        requests += run_soak(rig, seconds=3.0, seed=phase, max_in_flight=10).requests  # recover
    rig.drain()
    bad_listed = sum(1 for k in rig.store.keys_by_age()
                     if (d := rig.store.get(k)) is None or identify(k, d) != 0)
    leaks = rig.leaks()
    st = rig.store.stats()
    out = {
        "requests": requests, "phases": dict(phases), "injected": dict(faults.injected),
        "wrong_blocks": rig.c.wrong_blocks, "failed_load_blocks": rig.c.failed_load_blocks,
        "degradations": rig.manager.stats.disk_degradations,
        "degraded_at_end": rig.manager.stats.disk_degraded,
        "disk_blocks_stored": rig.manager.stats.stored_blocks["DISK"],
        "loaded_blocks": dict(rig.c.loaded_blocks), "promoted_blocks": rig.c.promoted_blocks,
        "bad_blocks_indexed": bad_listed,
        "store_counters": {"write_errors": st.write_errors, "read_errors": st.read_errors,
                           "checksum_failures": st.checksum_failures},
        "pins_leaked": leaks["pins"], "leaks": leaks,
    }
    rig.close()
    out["ok"] = (out["wrong_blocks"] == 0 and bad_listed == 0 and not any(leaks.values())
                 and not out["degraded_at_end"])
    return out


def section_model(ops: int) -> dict:
    done, error, pins_checked, resets, degradations = 0, None, 0, 0, 0
    for policy in ("lru", "arc"):
        model = ManagerModel(policy)
        try:
            run_random(model, random.Random(f"report-{policy}-{time.time()}"), ops // 2)
        except AssertionError as exc:
            error = f"{policy}: {exc}"
        c = model.counts
        done += c.ops
        pins_checked += c.pins_checked
        resets += c.resets
        degradations += c.degradations
        if error:
            break
    return {"ops": done, "pins_checked": pins_checked, "resets": resets,
            "disk_degradations": degradations, "violation": error,
            "pins_leaked": 0 if error is None or "pins" not in error else 1, "ok": error is None}


def section_soak(root: Path, seconds: float) -> dict:
    rig = StackRig(root, cpu_blocks=32, disk_blocks=160, gpu_blocks=256, compression="zstd",
                   compressible=True, segment_bytes=64 * 2120)
    r = run_soak(rig, seconds=seconds, seed=1, max_in_flight=10,
                 sample_every=max(50, int(seconds * 2)))
    leaks = rig.leaks()
    out = {
        "requests": r.requests, "seconds": round(r.seconds, 1),
        "max_jobs_in_flight": r.max_jobs_in_flight, "max_pins": r.max_pins,
        "loaded_blocks": dict(rig.c.loaded_blocks), "promoted_blocks": rig.c.promoted_blocks,
        "wrong_blocks": rig.c.wrong_blocks,
        "rss_first_mib": round(r.rss[0][1] / MiB, 1), "rss_last_mib": round(r.rss[-1][1] / MiB, 1),
        "rss_growth_after_warmup_mib": round(r.growth_after_warmup() / MiB, 2),
        "pins_leaked": leaks["pins"], "leaks": leaks,
    }
    rig.close()
    out["ok"] = out["wrong_blocks"] == 0 and not any(leaks.values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--long", action="store_true")
    ap.add_argument("--crash", type=int, help="child processes to SIGKILL")
    ap.add_argument("--model-ops", type=int, help="manager operations to model-check")
    ap.add_argument("--soak-s", type=float, help="soak duration in seconds")
    ap.add_argument("--fault-s", type=float, help="fault-injection duration in seconds")
    ap.add_argument("--dir", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = dict(MODES["quick" if args.quick else "long" if args.long else "moderate"])
    for name in ("crash", "model_ops", "soak_s", "fault_s"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    logging.basicConfig(level=logging.CRITICAL)  # injected faults log on purpose
    scratch = tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-reliability-")
    root = Path(scratch.name)
    t0 = time.monotonic()
    report: dict = {"config": cfg, "rss_at_start_mib": round(rss_bytes() / MiB, 1)}
    steps = [("crash", lambda: section_crash(root / "crash", cfg["crash"])),
             ("corruption", lambda: section_corruption(root / "corruption")),
             ("faults", lambda: section_faults(root / "faults", cfg["fault_s"])),
             ("model", lambda: section_model(cfg["model_ops"])),
             ("soak", lambda: section_soak(root / "soak", cfg["soak_s"]))]
    for name, fn in steps:
        s = time.monotonic()
        if not args.json:
            print(f"[{name}] running ...", file=sys.stderr, flush=True)
        report[name] = fn()
        report[name]["seconds"] = round(time.monotonic() - s, 1)
    scratch.cleanup()
    injected = Counter(report["faults"]["injected"]) + Counter(report["corruption"]["injected"])
    report["summary"] = {
        "runs": report["crash"]["runs"],
        "kills": report["crash"]["kills"],
        "kills_by_phase": report["crash"]["kills_by_phase"],
        "injected_faults": dict(sorted(injected.items())),
        "injected_faults_total": sum(injected.values()),
        "wrong_blocks_served": (report["crash"]["wrong_blocks"] + report["corruption"]["wrong_blocks"]
                                + report["faults"]["wrong_blocks"] + report["soak"]["wrong_blocks"]),
        "acknowledged_blocks_lost": report["crash"]["lost_acked"],
        "pins_leaked": sum(report[s]["pins_leaked"] for s in ("corruption", "faults", "model", "soak")),
        "model_ops": report["model"]["ops"],
        "peak_rss_mib": round(peak_rss_bytes() / MiB, 1),
        "soak_rss_growth_mib": report["soak"]["rss_growth_after_warmup_mib"],
        "seconds": round(time.monotonic() - t0, 1),
        "ok": all(report[s]["ok"] for s, _ in steps),
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0 if report["summary"]["ok"] else 1


def print_report(r: dict) -> None:
    s = r["summary"]
    print("kvtier reliability report")
    print(f"  mode: {r['config']}")
    print(f"  runs (crash children)        {s['runs']}")
    print(f"  kills (SIGKILL)              {s['kills']}  by phase: {s['kills_by_phase']}")
    print(f"  injected faults              {s['injected_faults_total']}")
    for kind, n in s["injected_faults"].items():
        print(f"      {kind:32s} {n}")
    print(f"  wrong blocks served          {s['wrong_blocks_served']}   (must be 0)")
    print(f"  acknowledged blocks lost     {s['acknowledged_blocks_lost']}   (must be 0)")
    print(f"  pins leaked                  {s['pins_leaked']}   (must be 0)")
    print(f"  manager ops model-checked    {s['model_ops']}")
    print(f"  peak RSS                     {s['peak_rss_mib']} MiB  "
          f"(soak growth after warm-up {s['soak_rss_growth_mib']} MiB)")
    print(f"  total time                   {s['seconds']} s   verdict: {'OK' if s['ok'] else 'FAIL'}")
    c, f, m, k = r["crash"], r["faults"], r["model"], r["soak"]
    print("details")
    print(f"  crash: {c['acked_ops']} acknowledged ops, {c['blocks_verified']} blocks verified "
          f"after restarts, torn {c['torn']}, resurrected {c['resurrected']} ({c['seconds']} s)")
    print(f"  corruption: {r['corruption']['cases']} cases, problems: {r['corruption']['problems'] or 'none'}")
    print(f"  faults: {f['requests']} requests, phases {f['phases']}, {f['degradations']} degradations, "
          f"degraded at end: {f['degraded_at_end']}, failed load keys {f['failed_load_blocks']}, "
          f"bad blocks indexed {f['bad_blocks_indexed']}, store {f['store_counters']}")
    print(f"  model: {m['ops']} ops, pins checked {m['pins_checked']} times, {m['resets']} restarts, "
          f"{m['disk_degradations']} degradations, violation: {m['violation']}")
    print(f"  soak: {k['requests']} requests in {k['seconds']} s, up to {k['max_jobs_in_flight']} jobs "
          f"in flight, loads {k['loaded_blocks']} ({k['promoted_blocks']} blocks promoted from "
          f"disk first), RSS {k['rss_first_mib']} -> {k['rss_last_mib']} MiB")


if __name__ == "__main__":
    sys.exit(main())
