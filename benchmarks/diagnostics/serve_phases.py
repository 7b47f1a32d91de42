"""Where a ``vllm serve`` request's time goes, process by process: the milestones of its path.

With ``vllm_serve.py --timeline T --vllm-marks`` the API server and the engine core mark
vLLM's intake (the engine's input thread decodes the request, its busy loop takes it), each
step's phases and the output path (the engine's output thread encodes and sends the step's
outputs, the API server decodes them and builds the response) on kvtier's timeline, whose
clock every process shares with the client's own ``client_submit`` / ``client_token`` marks.
For each timed request this finds, in ms after the client sent it:

* ``decoded``: the engine core's input thread has decoded it;
* ``taken``: the engine's busy loop takes it (``_handle_client_request``);
* ``scheduled``: the first ``Scheduler.schedule`` after that;
* ``updated``: the last ``update_from_output`` to end before the token (the step's output);
* ``encode``: the engine's output thread starts encoding that output;
* ``sent``: the output thread has sent it;
* ``api_out``: the API server has turned it into the response;
* ``token``: the client has the token;

plus how many engine steps ran in between and the engine thread's CPU ms inside the request's
first ``execute_model`` (``exec_cpu``: launching a prefill's forward is CPU-bound under
piecewise CUDA graphs, so it shows how fast the vCPU ran), and prints the medians per
configuration, prompt length and kind of request. A gap that grows with a connector while the
phases around it do not is time a thread spent waiting (the GIL, a queue). The requests of a
burst (``--burst K``, kind ``burst``) overlap: each one's milestones are the first such events
after its own send, which may belong to another request of the burst.

    python benchmarks/diagnostics/serve_phases.py OUT/timeline.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict

MILESTONES = ("decoded", "taken", "scheduled", "updated", "encode", "sent", "api_out", "token")


def load(path: str) -> tuple[list[dict], dict[int, list[dict]], dict[int, str]]:
    """Client marks, server marks per pid (sorted), and each server pid's role."""
    client, by_pid = [], defaultdict(list)
    with open(path) as f:
        for line in f:
            m = json.loads(line) if line.strip() else {}
            if m.get("who") == "client":
                client.append(m)
            elif m.get("who") == "vllm":
                by_pid[m["pid"]].append(m)
    roles = {}
    for pid, marks in by_pid.items():
        marks.sort(key=lambda m: m["t"])
        evs = {m["ev"] for m in marks}
        roles[pid] = ("engine" if "Scheduler.schedule>" in evs else
                      "api" if "OutputProcessor.process_outputs>" in evs else "other")
    client.sort(key=lambda m: m["t"])
    return client, by_pid, roles


def _first(marks: list[dict], ev: str, lo: float, hi: float) -> float | None:
    return next((m["t"] for m in marks if lo <= m["t"] <= hi and m["ev"] == ev), None)


def _last(marks: list[dict], ev: str, lo: float, hi: float) -> float | None:
    return next((m["t"] for m in reversed(marks) if lo <= m["t"] <= hi and m["ev"] == ev), None)


def milestones(t0: float, t1: float, engine: list[dict], api: list[dict]) -> dict:
    """Milestones (ms after ``t0``) of the one request in flight between ``t0`` and ``t1``."""
    ts = [m["t"] for m in engine]
    window = engine[bisect.bisect_left(ts, t0):bisect.bisect_right(ts, t1)]
    at = {"decoded": _first(window, "MsgpackDecoder.decode<", t0, t1),
          "taken": _first(window, "EngineCoreProc._handle_client_request>", t0, t1)}
    at["scheduled"] = _first(window, "Scheduler.schedule>", at["taken"] or t0, t1)
    at["sent"] = _last(window, "EngineCoreProc._send_msg_tracking_payload<", t0, t1)
    at["encode"] = _last(window, "MsgpackEncoder.encode_into>", t0, at["sent"] or t1)
    at["updated"] = _last(window, "Scheduler.update_from_output<", t0, at["encode"] or t1)
    at["api_out"] = _last(api, "OutputProcessor.process_outputs<", t0, t1)
    at["token"] = t1
    out = {k: (v - t0) * 1e3 if v is not None else None for k, v in at.items()}
    out["steps"] = sum(1 for m in window if m["ev"] == "Scheduler.schedule>")
    out["exec_cpu"] = _exec_cpu_ms(window, at["taken"] or t0)
    return out


def _exec_cpu_ms(window: list[dict], after: float) -> float | None:
    """CPU ms of the engine thread inside the request's first ``execute_model`` (its forward
    launched; CPU-bound under piecewise CUDA graphs, so it follows the vCPU's speed)."""
    enter = next((m for m in window if m["t"] >= after and m["ev"].endswith(".execute_model>")
                  and "cpu" in m), None)
    if enter is None:
        return None
    leave = next((m for m in window if m["t"] >= enter["t"] and m["ev"].endswith(".execute_model<")
                  and "cpu" in m), None)
    return (leave["cpu"] - enter["cpu"]) * 1e3 if leave is not None else None


def requests(path: str) -> list[tuple[tuple, dict]]:
    client, by_pid, roles = load(path)
    engines = [p for p, r in roles.items() if r == "engine"]
    apis = [p for p, r in roles.items() if r == "api"]
    out = []
    open_: dict[tuple, dict] = {}
    for m in client:
        key = (m.get("config"), m.get("length"), m.get("kind"), m.get("rep"))
        if m["ev"] == "client_submit":
            open_[key] = m
        elif m["ev"] == "client_token" and key in open_:
            t0, t1 = open_.pop(key)["t"], m["t"]
            # the server of this request: the engine pid with marks inside its window
            engine = next((by_pid[p] for p in engines
                           if by_pid[p][0]["t"] <= t1 and by_pid[p][-1]["t"] >= t0), [])
            api = next((by_pid[p] for p in apis
                        if by_pid[p][0]["t"] <= t1 and by_pid[p][-1]["t"] >= t0), [])
            out.append((key[:3], milestones(t0, t1, engine, api)))
    return out


def table(path: str) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for key, ms in requests(path):
        groups[key].append(ms)
    lines = ["| config | tokens | request | n | " + " | ".join(MILESTONES)
             + " | steps | exec_cpu |", "|" + "---|" * (len(MILESTONES) + 6)]

    def med(rows, k):
        xs = [r[k] for r in rows if r.get(k) is not None]
        return f"{statistics.median(xs):.2f}" if xs else "-"

    for (config, length, kind), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        lines.append(f"| {config} | {length} | {kind} | {len(rows)} | "
                     + " | ".join(med(rows, k) for k in MILESTONES)
                     + f" | {med(rows, 'steps')} | {med(rows, 'exec_cpu')} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timeline", help="the timeline.jsonl of a vllm_serve.py --vllm-marks run")
    print("\n".join(table(p.parse_args().timeline)))


if __name__ == "__main__":
    main()
