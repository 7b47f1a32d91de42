"""``serving.py``'s results file as Markdown: per run, the sizing, a row per configuration and
rate, and kvtier against vLLM's native connector at each rate with the targets checked.

Why its own file: the report is rebuilt from the whole results file after every rate (runs of
several commands accumulate there), so it reads only that file's data, never the live run.
"""

from __future__ import annotations

import math

GiB = 1 << 30
TIERS = (("GPU", ("source:device", "gpu_prefix_hits")), ("CPU", ("source:host",)),
         ("disk", ("source:disk",)),
         ("other", ("source:external_unspecified", "source:p2p", "external_hits")))
LATE_MS = 20.0  # a send this late (p99) means the client, not the server, set the pace


def report(data: dict) -> str:
    lines = [f"# kvtier under load behind `vllm serve` — {data['device']}", "",
             "Multi-turn conversations at Poisson request rates (`benchmarks/serving.py`; "
             "definitions in `serving_stats.py`). Per row: requests/s and output tokens/s "
             "served, TTFT and ITL percentiles (ms, client clock), goodput (requests/s whose "
             "TTFT met the SLO, and the share of requests sent that did), the pool's working "
             "set (mean at each send), the share of prompt tokens served from a cache "
             "(`usage.prompt_tokens_details.cached_tokens`) and the prompt tokens each cache "
             "tier supplied (vLLM's `/metrics` deltas; kvtier's own count in brackets).", ""]
    for label, run in data["runs"].items():
        lines += run_section(label, run, data["device"])
    return "\n".join(lines) + "\n"


def run_section(label: str, run: dict, device: str = "?") -> list[str]:
    configs = run["configs"]
    lines = [f"## {label}", ""]
    commands = []
    for res in configs.values():  # the commands that measured this label's configurations
        cmd = f"`benchmarks/serving.py {' '.join(res.get('argv', []))}`"
        if cmd not in commands:
            commands.append(cmd)
    lines += [" and ".join(commands), ""] if commands else []
    first = next(iter(configs.values()), None)
    slo = None
    if first is not None:
        lines += [sizing(configs, device), ""]
        slo = f"{first['setup']['slos_ms'][0]:g}"
        lines += [f"| config | rate | sent | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | "
                  f"ITL p99 | goodput@{slo}ms | met | working set | cached | hit tokens GPU | "
                  "CPU | disk | other | errors / cut |", "|" + "---|" * 18]
        for name, res in configs.items():
            for rate, r in res["rates"].items():
                lines.append(row(name, rate, r, slo, res["setup"]["kv_bytes_per_token"]))
        lines += behind(configs)
    lines += versus(configs, slo) if slo else []
    for name, err in run.get("errors", {}).items():
        lines += ["", f"**{name} failed:**", "```", err.strip()[-1500:], "```"]
    return lines + [""]


def sizing(configs: dict, device: str = "?") -> str:
    """The first configuration's sizes (one command gives all the same), kvtier_disk's disk,
    and a note for any configuration sized otherwise (an earlier command of the label)."""
    s = next(iter(configs.values()))["setup"]
    ws = s["working_set_bytes"]
    tokens = s["gpu_kv_bytes"] / s["kv_bytes_per_token"]
    out = (f"{workload_text(s)}. vLLM {s.get('vllm', '? (not recorded)')} on "
           f"{s.get('gpu', device)}. Working set {size(ws)} ({s['pool']} conversations; "
           f"{s['kv_bytes_per_token']} KV bytes per token). GPU KV {size(s['gpu_kv_bytes'])}, "
           f"{tokens:.0f} tokens (the working set is {ws / s['gpu_kv_bytes']:.1f}x). "
           f"CPU bytes of every connector {size(s['cpu_bytes'])} (the working set is "
           f"{ws / s['cpu_bytes']:.2f}x).")
    disk = configs.get("kvtier_disk")
    if disk is not None:
        out += (f" kvtier_disk's disk tier {size(disk['setup']['disk_bytes'])} on "
                f"{disk['setup'].get('disk_fs', '?')}.")
    least = (f" (at least {s['min_requests']} requests' arrivals)"
             if s.get("min_requests") else "")
    out += (f" Each rate: {s['duration_s']:g} s of arrivals{least}, then up to "
            f"{s['drain_s']:g} s before unfinished requests are cut; vLLM max_num_seqs "
            f"{s['max_num_seqs']}, block {s['block_size']} tokens, seed {s['seed']}.")
    keys = [k for k in s if k not in ("disk_bytes", "vllm")]
    odd = [n for n, c in configs.items() if any(c["setup"].get(k) != s[k] for k in keys)]
    if odd:
        out += f" **Sized otherwise (see the .json): {', '.join(odd)}.**"
    versions = {c["setup"].get("vllm") for c in configs.values()}
    if len(versions) > 1:
        out += (" **vLLM releases differ: " + ", ".join(
            f"{n} {c['setup'].get('vllm', '?')}" for n, c in configs.items()) + ".**")
    return out


def workload_text(s: dict) -> str:
    """The workload and its parameters: a preset's own sentence, or the synthetic shape's
    lengths (results written before presets carry no name)."""
    w = s["workload"]
    if w.get("summary"):
        return "Workload " + w["summary"]
    return (f"Workload `synthetic`: first prompt {w['first']} tokens, +{w['user']} user and "
            f"{w['answer']} generated tokens per turn, {w['turns']} turns")


def row(name: str, rate: str, r: dict, slo: str, token_bytes: int) -> str:
    hits, kvt = r.get("hits", {}), r.get("kvtier_hits", {})
    cells = []
    for tier, keys in TIERS:
        v = next((hits[k] for k in keys if k in hits), None)
        own = {"CPU": "CPU", "disk": "DISK"}.get(tier)
        cell = "-" if v is None else count(v)
        if own and own in kvt:
            cell += f" [{count(kvt[own])}]"
        cells.append(cell)
    g = r["goodput"].get(slo, {"rps": math.nan, "attained": math.nan})
    censored = f" (+{r['ttft_censored']} cut)" if r.get("ttft_censored") else ""
    cached = (f"{100 * r['client_cached_tokens'] / r['prompt_tokens']:.0f}%"
              if r["client_cached_tokens"] >= 0 and r["prompt_tokens"] else "-")
    return (f"| {name} | {rate} | {r['sent']} | {r['rps']:.2f} | {r['out_tps']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f}{censored} | {r['itl_p50_ms']:.1f} | "
            f"{r['itl_p99_ms']:.1f} | {g['rps']:.2f} | {100 * g['attained']:.0f}% | "
            f"{size(r['working_set_tokens_mean'] * token_bytes)} | {cached} | "
            + " | ".join(cells) + f" | {r['errors']} / {r['cut']} |")


def behind(configs: dict) -> list[str]:
    """Rows whose arrivals did not go out on time: the client was late (p99 over LATE_MS) or
    every conversation was busy (arrivals dropped), so the offered rate was lower."""
    late = [f"{name} at {rate} (send lag p99 {r.get('send_lag_p99_ms', 0):.0f} ms, "
            f"{r.get('unsent', 0)} arrivals found no idle conversation)"
            for name, res in configs.items() for rate, r in res["rates"].items()
            if r.get("send_lag_p99_ms", 0) > LATE_MS or r.get("unsent", 0)]
    return ["", "**Offered less than the rate:** " + "; ".join(late) + "."] if late else []


def count(n: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def size(n: float) -> str:
    for div, unit in ((GiB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def versus(configs: dict, slo: str) -> list[str]:
    """kvtier's configurations against native's at each rate both ran."""
    native = configs.get("native")
    if native is None:
        return []
    lines = ["", "kvtier against native at each rate (req/s and goodput: kvtier / native; TTFT: "
             "native / kvtier, so above 1 is kvtier faster). Targets: kvtier_cpu serves at "
             "least native's req/s with TTFT p50 and p99 no higher; kvtier_disk, with a "
             "working set at least twice the CPU tier, at least 1.3x native's goodput.", "",
             f"| config | rate | req/s | TTFT p50 | TTFT p99 | goodput@{slo}ms | target |",
             "|---|---|---|---|---|---|---|"]
    for name in ("kvtier_cpu", "kvtier_disk"):
        res = configs.get(name)
        if res is None:
            continue
        for rate, k in res["rates"].items():
            n = native["rates"].get(rate)
            if n is None:
                continue
            rps, p50 = ratio(k["rps"], n["rps"]), ratio(n["ttft_p50_ms"], k["ttft_p50_ms"])
            p99 = ratio(n["ttft_p99_ms"], k["ttft_p99_ms"])
            good = ratio(k["goodput"][slo]["rps"], n["goodput"][slo]["rps"])
            lines.append(f"| {name} | {rate} | {rps:.3f} | {p50:.2f} | {p99:.2f} | {good:.2f} | "
                         f"{target(name, res['setup'], rps, p50, p99, good)} |")
    return lines


def ratio(x: float, y: float) -> float:
    if y == 0:
        return math.inf if x > 0 else math.nan
    return x / y


def target(name: str, setup: dict, rps: float, p50: float, p99: float, good: float) -> str:
    if name == "kvtier_cpu":
        return "met" if rps >= 1.0 and p50 >= 1.0 and p99 >= 1.0 else "not met"
    if setup["working_set_bytes"] < 2 * setup["cpu_bytes"]:
        return "n/a (working set under 2x CPU)"
    return "met" if good >= 1.3 else "not met"
