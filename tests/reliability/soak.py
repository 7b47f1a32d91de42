"""A load loop over the full stack: overlapping prompts, many transfers in flight, RSS sampled.

Requests pick a "document" (Zipf-like popularity) and a prompt length; the prompt's blocks
are the document's first blocks, so requests share prefixes and hit the same keys from many
angles at once: loads of a prefix while it is still being stored, promoted, demoted or
dropped. The hit prefix is loaded and the rest stored, both asynchronously, with up to
``max_in_flight`` jobs running. Resident memory is sampled as the loop goes.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

from reliability.blocks import key
from reliability.rig import StackRig

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class SoakResult:
    requests: int = 0
    seconds: float = 0.0
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    max_pins: int = 0
    max_jobs_in_flight: int = 0

    def growth_after_warmup(self, warmup_share: float = 0.3) -> int:
        """Highest RSS in the last third minus highest RSS right after warm-up (bytes)."""
        samples = [r for _, r in self.rss[int(len(self.rss) * warmup_share):]]
        if len(samples) < 3:
            return 0
        third = max(1, len(samples) // 3)
        return max(samples[-third:]) - max(samples[:third])


def run_soak(rig: StackRig, *, requests: int | None = None, seconds: float | None = None,
             seed: int = 0, docs: int = 300, max_blocks: int = 8, max_in_flight: int = 8,
             sample_every: int = 50) -> SoakResult:
    """Run until ``requests`` are issued or ``seconds`` pass (whichever is given / first)."""
    if requests is None and seconds is None:
        raise ValueError("give requests or seconds")
    rng = random.Random(seed)
    weights = [1.0 / (d + 1) ** 0.9 for d in range(docs)]
    out = SoakResult()
    start = time.monotonic()
    while True:
        now = time.monotonic() - start
        if (requests is not None and out.requests >= requests) or \
                (seconds is not None and now >= seconds):
            break
        doc = rng.choices(range(docs), weights)[0]
        n = rng.randint(1, max_blocks)
        prompt = [key(doc * 64 + j) for j in range(n)]
        loading = rig.load_blocks(prompt)
        if loading < n:
            rig.store_blocks(prompt[loading:])
        if rng.random() < 0.05:
            rig.manager.touch(prompt)
        out.max_jobs_in_flight = max(out.max_jobs_in_flight, rig.in_flight())
        out.max_pins = max(out.max_pins, rig.manager.pins())
        rig.throttle(max_in_flight)
        out.requests += 1
        if out.requests % sample_every == 0:
            out.rss.append((now, rss_bytes()))
    rig.drain()
    out.seconds = time.monotonic() - start
    out.rss.append((out.seconds, rss_bytes()))
    return out
