"""What one rate's requests add up to: throughput, latency percentiles, goodput, cache hits.

Why these definitions (``serving.py`` reports them per configuration and rate):

* **elapsed**: from the window's start until its last request ended (finished or was cut at
  the drain deadline). Requests/s and output tokens/s are finished requests and their tokens
  over it: a saturated server's queue drains inside it, so its rate is what it served.
* **TTFT**: sending the request to its first token, client clock, every request sent. One cut
  before its first token counts with the time it had waited (a lower bound, counted in
  ``ttft_censored``), so a saturated server's p99 is not flattered by leaving them out.
* **ITL**: the gaps between a request's streamed chunks; a chunk of n tokens gives n samples
  of gap/n (per token, as a user sees text arrive).
* **Goodput** at an SLO: finished requests whose TTFT met it, per elapsed second.
* **Hits**: the deltas of vLLM's Prometheus counters over the window (tokens per cache tier,
  ``vllm:prompt_tokens_cached_by_source``; the GPU prefix cache's and the connector's
  totals) and the clients' ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Record:
    """One request of a window (times in ms from the window's start, unless named otherwise)."""
    conv: int
    turn: int
    prompt_len: int
    scheduled_ms: float  # its Poisson arrival
    sent_ms: float  # when the client sent it (late: the client or the pool was behind)
    ttft_ms: float = -1.0  # -1: no token arrived
    token_ms: list[float] = field(default_factory=list)  # each token's arrival after sending
    cached_tokens: int = -1
    end_ms: float = -1.0  # finished, failed or cut
    error: str | None = None
    cut: bool = False  # still streaming at the drain deadline: its connection was closed

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's
    default); NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def itl_samples(token_ms: list[float]) -> list[float]:
    """Per-token inter-token latencies of one stream: tokens that arrived together form a
    chunk, and a chunk of n tokens arriving g ms after the previous one gives n samples g/n."""
    chunks: list[list[float]] = []  # [arrival, tokens]
    for t in token_ms:
        if chunks and t == chunks[-1][0]:
            chunks[-1][1] += 1
        else:
            chunks.append([t, 1])
    out = []
    for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
        out += [(t1 - t0) / n] * int(n)
    return out


def summarize(records: list[Record], duration_s: float, slos_ms: list[float]) -> dict:
    """A window's figures (see the module docstring); ``duration_s``: its arrival span."""
    sent = [r for r in records if r.sent_ms >= 0]
    ok = [r for r in sent if r.ok]
    ends = [r.end_ms for r in sent if r.end_ms >= 0]
    elapsed_s = max(ends + [duration_s * 1e3]) / 1e3
    ttft, censored = [], 0
    for r in sent:
        if r.error is not None:
            continue
        if r.ttft_ms >= 0:
            ttft.append(r.ttft_ms)
        else:  # cut before its first token: it waited at least this long
            ttft.append(r.end_ms - r.sent_ms)
            censored += 1
    itl = [x for r in ok for x in itl_samples(r.token_ms)]
    e2e = [r.token_ms[-1] for r in ok if r.token_ms]
    lag = [r.sent_ms - r.scheduled_ms for r in sent]
    out_tokens = sum(len(r.token_ms) for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens >= 0]
    out = {
        "sent": len(sent), "finished": len(ok), "errors": sum(r.error is not None for r in sent),
        "cut": sum(r.cut for r in sent), "elapsed_s": elapsed_s,
        "offered_rps": len(sent) / duration_s if duration_s > 0 else math.nan,
        "rps": len(ok) / elapsed_s, "out_tps": out_tokens / elapsed_s,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "ttft_censored": censored,
        "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
        "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99),
        "send_lag_p99_ms": percentile(lag, 99),
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "client_cached_tokens": sum(cached) if cached else -1,
        "goodput": {},
    }
    for slo in slos_ms:
        good = sum(1 for r in ok if r.ttft_ms <= slo)
        out["goodput"][f"{slo:g}"] = {"rps": good / elapsed_s, "attained": good / len(sent)
                                      if sent else math.nan}
    errs = [r.error for r in sent if r.error is not None]
    if errs:
        out["first_errors"] = sorted(set(errs))[:5]
    return out


CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TOTALS = {"gpu_prefix_hits": "vllm:prefix_cache_hits_total",
          "external_hits": "vllm:external_prefix_cache_hits_total",
          "prompt_tokens": "vllm:prompt_tokens_total"}


def hit_counters(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """vLLM's cache counters summed over engines: ``source:<tier>`` (device, host, disk, ...)
    and the ``TOTALS``."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == CACHED_BY_SOURCE:
            key = "source:" + labels.get("source", "?")
        else:
            key = next((k for k, v in TOTALS.items() if v == name), None)
            if key is None:
                continue
        out[key] = out.get(key, 0.0) + value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
