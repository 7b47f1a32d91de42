"""Write health of the disk tier, as the manager sees it through demotion results.

A full or failing disk (ENOSPC, EIO) fails every demotion. Retrying each one would keep CPU
blocks pinned by flushes that cannot succeed, and their dirty copies could not be evicted, so
the CPU tier would clog behind a dead disk. After ``fail_threshold`` demotions fail in a row
the tier is *degraded*: the manager stops admitting blocks to disk (dirty CPU blocks become
plain evictable blocks, dropped instead of written) while reads, deletions and the CPU tier
carry on. Every ``retry_after_s`` (doubling up to ``max_retry_after_s`` while it keeps failing)
one small probe demotion is let through; the first demotion that succeeds ends the episode.

Time comes from an injectable clock so tests can step through cool-downs without sleeping.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


class DiskHealth:
    def __init__(
        self,
        *,
        fail_threshold: int = 3,
        retry_after_s: float = 5.0,
        max_retry_after_s: float = 120.0,
        probe_blocks: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fail_threshold < 1 or probe_blocks < 1:
            raise ValueError("fail_threshold and probe_blocks must be at least 1")
        if not 0 < retry_after_s <= max_retry_after_s:
            raise ValueError("need 0 < retry_after_s <= max_retry_after_s")
        self.fail_threshold = fail_threshold
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.probe_blocks = probe_blocks
        self.clock = clock
        self.degraded = False
        self.degradations = 0  # episodes so far
        self.consecutive_failures = 0
        self._backoff = retry_after_s
        self._next_probe = 0.0
        self._probing = False

    def admit(self, n: int) -> int:
        """How many of ``n`` wanted demotions may start now (all, none, or a probe's worth)."""
        if not self.degraded:
            return n
        if self._probing or self.clock() < self._next_probe:
            return 0
        return min(n, self.probe_blocks)

    def on_demotion_started(self) -> bool:
        """A demotion was queued; while degraded it is the probe (no other until it ends).
        Returns whether it is the probe (the caller passes that back to ``on_demotion``)."""
        if self.degraded:
            self._probing = True
            return True
        return False

    def on_demotion(self, ok: bool, probe: bool = True) -> None:
        """A demotion to disk finished (``ok``) or failed. ``probe``: it was the probe; a
        failure of a demotion queued before the tier degraded ends no probe (one is still
        in flight: a second one must not start beside it)."""
        if ok:
            self.consecutive_failures = 0
            if self.degraded:
                log.warning("kvtier: disk tier writes work again; admitting blocks to disk")
            self.degraded = self._probing = False
            self._backoff = self.retry_after_s
            return
        self.consecutive_failures += 1
        if self.degraded:
            if not probe:
                return
            self._probing = False
            self._backoff = min(self._backoff * 2, self.max_retry_after_s)
            self._next_probe = self.clock() + self._backoff
        elif self.consecutive_failures >= self.fail_threshold:
            self.degraded = True
            self.degradations += 1
            self._next_probe = self.clock() + self._backoff
            log.error(
                "kvtier: %d demotions to disk failed in a row (disk full or failing); the disk "
                "tier stops admitting blocks and retries in %.0fs. The CPU tier keeps working.",
                self.consecutive_failures, self._backoff,
            )
