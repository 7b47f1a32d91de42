"""Cost-aware loading: a hit is worth loading only while loading it beats recomputing it.

A disk hit is not always a win. A local disk can read slower than the engine recomputes the
same KV (prefill produces KV at a few GB/s for an 8B model), so loading from it is slower than
prefill, while the CPU tier is an order of magnitude faster than prefill (measured figures:
docs/design-measurements.md, "kvtier/manager/cost.py"). A model with more compute per KV byte,
or a faster disk, flips the disk's answer. So the manager
keeps, per tier, a running estimate of the load bandwidth it actually achieves (fed by whoever
runs the transfers: ``record_load``) and knows the engine's recompute time per token
(configured), and ``lookup`` reports only the leading hits whose loading pays off.

Per block, loading from CPU costs ``B / bw_cpu``; from disk ``B / bw_disk + B / bw_cpu`` (the
promotion goes DISK -> CPU -> GPU), from the shared tier likewise with its own measured
bandwidth; recomputing costs ``block_tokens * t_token``. Hits are a
prefix, so the choice is where to cut it: the cut that maximises the time saved (a slow disk
block is still worth loading when enough fast CPU blocks follow it). An unmeasured tier gets an
optimistic prior so that it is tried, and therefore measured. Loads under ``MIN_SAMPLE_BYTES``
teach no bandwidth: their time is the job's fixed cost (enqueue, events, a reader thread), not
bytes over a bus (one small first hit would teach the model a CPU tier slower than recompute,
and every later long CPU hit would be recomputed). They teach that fixed cost instead,
charged once per tier a lookup loads from: a one-block disk hit (whose time to first token
exceeds recomputing its tokens) is then recomputed, while a long one still pays. A tier found too slow is still probed
once every ``probe_every`` cut lookups, so a disk that was slow under contention gets measured
again instead of being shunned forever.

A hop's time is not bytes over a bandwidth alone: a promotion from the shared tier pays a
per-job latency (requests handed to the I/O processes, the slowest share's round trips) before
its bytes stream. Read as a bandwidth, one small first hit makes every larger hit look as slow
per byte, and the model declines larger hits that would move several times faster (figures:
docs/design-measurements.md). So each
tier fits its hops as ``latency + bytes / bandwidth`` once it has seen loads of different
sizes, and a declined hit at least twice the largest load it measured is loaded once anyway
(an *exploration*) when the pessimistic estimate loses no more than ``EXPLORE_MAX_LOSS`` of the
recompute time: that is how it learns the slope at all, at a bounded price, once per doubling.
A shared-tier read also reports how many bytes it had verified when (``measured_hops`` in
kvtier.transfer.jobs): those points are samples of the same line, so the tier's first hit
already shows its latency apart from its bandwidth.

All of it is O(hits) per lookup with no allocation proportional to the cache.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from kvtier.manager.specs import Medium

HISTORY_KEEP = 0.8  # weight left to the past per new sample (~5 samples of memory)
PROBE_EVERY = 100  # every Nth lookup cut for cost loads in full, to re-measure the slow tier
PROBE_AFTER_S = 60.0  # ... and the shared tier unmeasured this long is probed at its next cut
DEFAULT_PRIOR_BYTES_PER_S = 100e9
MIN_SAMPLE_BYTES = 16 << 20  # smaller loads measure per-job costs, not bandwidth
FIT_MIN_SPREAD = 0.25  # sizes whose spread (std / mean) is below this give no slope
EXPLORE_MAX_LOSS = 1.5  # explore a larger hit only if its estimate is <= 1.5x recompute


class LoadBandwidth:
    """Achieved load speed of one tier, from decayed sums over its hops (a large transfer
    weighs more than a small one; the estimate follows changes within a few samples).

    With hops of one size only, the speed is bytes over seconds. Once hops of different sizes
    were seen, a least-squares line through (bytes, seconds) splits each hop into a per-job
    latency (``latency_s``) and a bandwidth (the slope): what a larger hit will cost is then
    extrapolated from the slope, not from a small hit's latency-bound rate. A line that makes
    no sense (negative latency, no slope) falls back to bytes over seconds. Unmeasured, it
    reports ``prior``."""

    def __init__(self, prior_bytes_per_s: float, keep: float = HISTORY_KEEP,
                 min_bytes: int = MIN_SAMPLE_BYTES) -> None:
        if not prior_bytes_per_s > 0:
            raise ValueError(f"prior bandwidth must be > 0, got {prior_bytes_per_s}")
        if not 0.0 <= keep < 1.0:
            raise ValueError(f"keep must be within [0, 1), got {keep}")
        self.prior = float(prior_bytes_per_s)
        self.keep = keep
        self.min_bytes = min_bytes
        self.samples = 0
        # decayed sums: weight, bytes, seconds, bytes^2, bytes*seconds (in GB, for range)
        self._w = self._b = self._s = self._bb = self._bs = 0.0
        self.largest = 0  # bytes of the largest hop measured
        self.explored = 0  # bytes of the largest hop an exploration asked for
        self.measured_at = 0.0  # clock time of the last bandwidth sample or probe asked for
        self.fixed_s = 0.0  # per-load cost beyond the hops, from small loads or promotions
        self.fixed_samples = 0
        self.waits = 0  # promotions timed end to end: then they alone teach fixed_s
        self._line = (0.0, self.prior)  # (latency_s, bytes_per_s), refreshed per sample

    def record(self, nbytes: float, seconds: float) -> bool:
        """Add one finished load; nonsense (no bytes, no time, NaN) is ignored, not trusted.
        A load under ``min_bytes`` updates the fixed cost only (returns False: no bandwidth)."""
        if not (nbytes > 0 and seconds > 0 and math.isfinite(nbytes) and math.isfinite(seconds)):
            return False
        if nbytes < self.min_bytes:
            if not self.waits:  # a promotion's wall time says more (record_wait)
                self._learn_fixed(seconds - self.hop_s(nbytes))
            return False
        k, g = self.keep, nbytes / 1e9
        self._w = k * self._w + 1.0
        self._b = k * self._b + g
        self._s = k * self._s + seconds
        self._bb = k * self._bb + g * g
        self._bs = k * self._bs + g * seconds
        self.samples += 1
        self.largest = max(self.largest, int(nbytes))
        self._line = self._fit()
        return True

    def _fit(self) -> tuple[float, float]:
        """(latency_s, bytes_per_s) of the line through the samples, or (0, bytes/seconds)."""
        origin = (0.0, self._b * 1e9 / self._s)
        mean = self._b / self._w
        var = self._bb / self._w - mean * mean
        if var <= (FIT_MIN_SPREAD * mean) ** 2:  # one size: no slope to see
            return origin
        slope = (self._bs / self._w - mean * self._s / self._w) / var  # seconds per GB
        latency = self._s / self._w - slope * mean
        if not (slope > 0 and latency >= 0):
            return origin
        return latency, 1e9 / slope

    def _learn_fixed(self, over: float) -> None:
        w = 1.0 if not self.fixed_samples else 1.0 - self.keep
        self.fixed_s += w * (max(0.0, over) - self.fixed_s)
        self.fixed_samples += 1

    def record_wait(self, over: float) -> None:
        """A promotion's wall time beyond its hops (``LoadCostModel.record_promotion``)."""
        if math.isfinite(over):
            self.waits += 1
            self._learn_fixed(over)

    @property
    def bytes_per_s(self) -> float:
        return self._line[1] if self.samples else self.prior

    @property
    def latency_s(self) -> float:
        """A hop's per-job latency beyond its bytes (0 until sizes differed)."""
        return self._line[0] if self.samples else 0.0

    def hop_s(self, nbytes: float) -> float:
        """Estimated seconds of one hop of ``nbytes``."""
        return self.latency_s + nbytes / self.bytes_per_s


class LoadCostModel:
    """Decides how many leading hits of a lookup are worth loading."""

    def __init__(
        self,
        *,
        block_bytes: int,
        block_tokens: int,
        recompute_s_per_token: float,
        prior_bytes_per_s: float = DEFAULT_PRIOR_BYTES_PER_S,
        probe_every: int = PROBE_EVERY,
        probe_after_s: float = PROBE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_bytes <= 0 or block_tokens <= 0:
            raise ValueError(f"block_bytes and block_tokens must be > 0, got {block_bytes}, "
                             f"{block_tokens}")
        if not (recompute_s_per_token > 0 and math.isfinite(recompute_s_per_token)):
            raise ValueError(f"recompute time per token must be > 0, got {recompute_s_per_token}")
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0 (0: never probe), got {probe_every}")
        if not probe_after_s > 0:
            raise ValueError(f"probe_after_s must be > 0, got {probe_after_s}")
        self.block_bytes = block_bytes
        self.recompute_block_s = block_tokens * recompute_s_per_token
        self.bandwidth = {m: LoadBandwidth(prior_bytes_per_s)
                          for m in (Medium.CPU, Medium.DISK, Medium.REMOTE)}
        self.probe_every = probe_every
        self.probe_after_s = probe_after_s
        self._clock = clock
        self.cuts = 0  # lookups cut short because loading lost to recompute
        self.probes = 0  # of those, loaded in full anyway to re-measure
        self.explorations = 0  # of those, loaded in full to measure a larger hop (doubling)

    def set_recompute(self, s_per_token: float, block_tokens: int) -> None:
        """A new estimate of the engine's recompute time (nonsense is ignored)."""
        if s_per_token > 0 and math.isfinite(s_per_token) and block_tokens > 0:
            self.recompute_block_s = block_tokens * s_per_token

    def record_load(self, medium: Medium, nbytes: float, seconds: float) -> bool:
        """One finished load hop *out of* ``medium`` (DISK: the DISK -> CPU hop of a promotion;
        CPU: CPU -> GPU). Returns whether the sample was used."""
        bw = self.bandwidth.get(Medium(medium))
        if bw is None or not bw.record(nbytes, seconds):
            return False
        bw.measured_at = self._clock()
        return True

    def record_promotion(self, medium: Medium, nbytes: float, seconds: float) -> None:
        """A promotion out of ``medium`` that the request waited ``seconds`` for, planning to
        settling (the manager times its own promotions). The hops teach the bandwidths; the time
        beyond them (engine steps until the read is seen, the step that loads it) is the
        tier's fixed cost per load: the hops' bandwidth alone makes small-model disk hits look
        cheaper than recompute while requests wait longer (figures:
        docs/design-measurements.md)."""
        medium = Medium(medium)
        bw = self.bandwidth.get(medium)
        if bw is None or medium is Medium.CPU or not (nbytes > 0 and seconds > 0):
            return
        bw.record_wait(seconds - bw.hop_s(nbytes) - self.bandwidth[Medium.CPU].hop_s(nbytes))

    def load_block_s(self, medium: Medium) -> float:
        """Estimated seconds to bring one block from ``medium`` into the engine, beyond the
        per-load costs (``fixed_s``, ``latency_s``: charged once per tier a load uses)."""
        t = self.block_bytes / self.bandwidth[Medium.CPU].bytes_per_s
        if medium is Medium.DISK or medium is Medium.REMOTE:  # promoted through CPU
            t += self.block_bytes / self.bandwidth[medium].bytes_per_s
        return t

    def worth_loading(self, tiers: Sequence[Medium], ends_prompt: bool = False) -> int:
        """How many of the leading hits (``tiers`` of each, in prompt order) to load: the cut
        that saves the most time against recomputing them (ties: load fewer).

        ``ends_prompt``: loading all of them leaves vLLM one token to compute, so the step
        becomes a one-token step (a full CUDA graph) instead of a prefill. That saves the
        prefill step's own overhead, which the per-token recompute estimate (timed on large
        forwards) does not see. Where a small prefill is launch-bound it exceeds a CPU load's
        fixed cost (the host's enqueue of a copy that runs under the step's input
        preparation): with one 16-token block, a small model's load beat both recompute and
        running with no connector; a model whose prefill is weight-bound (like the one-token
        step) was near break-even (figures: docs/design-measurements.md). So the
        CPU tier's fixed cost is not charged against loading all of such a hit; a disk or
        shared tier's still is (a promotion's wait is longer than a prefill step). Measuring
        the step's premium per model instead is left open."""
        if not tiers:
            return 0
        used = set(tiers)
        save = {m: self.recompute_block_s - self.load_block_s(m) for m in used}
        fixed = {m: self.bandwidth[m].fixed_s + self.bandwidth[m].latency_s for m in used}
        waived = fixed.get(Medium.CPU, 0.0) if ends_prompt else 0.0
        if all(v > 0 for v in save.values()) and (  # then loading all of them is the best cut
                sum(save[m] * tiers.count(m) - fixed[m] for m in used) + waived > 0):
            return len(tiers)
        best, best_n, acc, paid = 0.0, 0, 0.0, set()
        for n, medium in enumerate(tiers, 1):
            acc += save[medium]
            if medium not in paid:  # a tier's fixed cost, once per load
                paid.add(medium)
                acc -= fixed[medium]
            if n == len(tiers):  # all of them (waived is 0 unless the CPU tier is used)
                acc += waived
            if acc > best:
                best, best_n = acc, n
        if best_n < len(tiers):
            self.cuts += 1
            if self._explore(tiers, best_n, save, fixed):
                self.explorations += 1
                return len(tiers)
            if self._stale(tiers[best_n:]) or (
                    self.probe_every and self.cuts % self.probe_every == 0):
                self.probes += 1
                return len(tiers)
        return best_n

    def _stale(self, cut: Sequence[Medium]) -> bool:
        """Whether the ``cut`` hits include the shared tier, last measured (or probed)
        ``probe_after_s`` ago; it counts as probed now, so the next probe is another
        ``probe_after_s`` away even before this one's result comes back. A local disk's
        figure does not go stale the same way (the count-based probe re-measures it)."""
        bw = self.bandwidth[Medium.REMOTE]
        if Medium.REMOTE not in cut or not bw.samples:
            return False
        now = self._clock()
        if now - bw.measured_at < self.probe_after_s:
            return False
        bw.measured_at = now
        return True

    def _explore(self, tiers: Sequence[Medium], best_n: int, save: dict, fixed: dict) -> bool:
        """Whether to load a cut lookup in full to measure a promoted tier on a hop at least
        twice as large as any it measured (or explored): its estimate extrapolates a line it
        may have seen at one size only, where a small hop's latency reads as low bandwidth.
        Only when even that estimate loses at most ``EXPLORE_MAX_LOSS`` x recompute."""
        larger = []
        for medium in set(tiers[best_n:]) & {Medium.DISK, Medium.REMOTE}:
            bw = self.bandwidth[medium]
            nbytes = tiers.count(medium) * self.block_bytes
            if bw.samples and nbytes >= 2 * max(bw.largest, bw.explored):
                larger.append((bw, nbytes))
        if not larger:
            return False
        recompute = len(tiers) * self.recompute_block_s
        load = recompute - sum(save[m] * tiers.count(m) - fixed[m] for m in set(tiers))
        if load > EXPLORE_MAX_LOSS * recompute:
            return False
        for bw, nbytes in larger:
            bw.explored = nbytes
        return True

    def snapshot(self) -> dict:
        """Estimates in GB/s and the break-even bandwidth, for stats."""
        return {
            "load_gbps": {m.value: round(b.bytes_per_s / 1e9, 3) for m, b in self.bandwidth.items()},
            "measured": {m.value: b.samples for m, b in self.bandwidth.items()},
            "fixed_ms": {m.value: round(b.fixed_s * 1e3, 3) for m, b in self.bandwidth.items()},
            "fixed_measured": {m.value: b.fixed_samples for m, b in self.bandwidth.items()},
            "latency_ms": {m.value: round(b.latency_s * 1e3, 3) for m, b in self.bandwidth.items()},
            "recompute_ms_per_block": round(self.recompute_block_s * 1e3, 4),
            "break_even_gbps": round(self.block_bytes / self.recompute_block_s / 1e9, 3),
            "cuts": self.cuts,
            "probes": self.probes,
            "explorations": self.explorations,
        }
