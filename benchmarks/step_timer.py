"""How long the scheduler's calls into kvtier take, and whether the OS or kvtier is to blame.

A scheduler step must never wait on the shared tier, so the bench times every call the
scheduler thread makes into the manager (``lookup``, ``prepare_load``). On a machine whose
cores are shared with other processes the thread can also be preempted by the OS in the middle
of a call: the call then takes a timeslice (~3-6 ms) although it waited on nothing. Such calls
are told apart by the thread's involuntary context switches (``getrusage(RUSAGE_THREAD)``,
Linux): a call with none was never descheduled, so its whole duration is its own work or a
wait inside the process (a lock, the GIL held by one of kvtier's threads). Both figures are
reported: the max over all calls, and the max over the calls the OS did not preempt.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def _involuntary_switches() -> int | None:
    if _RUSAGE_THREAD is None:
        return None
    return resource.getrusage(_RUSAGE_THREAD).ru_nivcsw


class SchedulerCallTimer:
    """Durations of the timed calls, each flagged when the OS preempted the calling thread."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.preempted: list[bool] = []

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        before = _involuntary_switches()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        took = time.perf_counter() - t0
        after = _involuntary_switches()
        self.seconds.append(took)
        self.preempted.append(before is not None and after != before)
        return out

    @classmethod
    def merged(cls, *timers: "SchedulerCallTimer") -> "SchedulerCallTimer":
        """One timer holding the calls of several (two instances of one run)."""
        out = cls()
        for t in timers:
            out.seconds.extend(t.seconds)
            out.preempted.extend(t.preempted)
        return out

    def summary(self) -> dict[str, Any]:
        """p50 / p99 / max of every call, max of the calls the OS did not preempt, and how
        many it did (``preemption_known``: False where the OS does not say)."""
        s = sorted(self.seconds)
        if not s:
            return {"calls": 0}
        own = [t for t, p in zip(self.seconds, self.preempted) if not p]
        hit = [t for t, p in zip(self.seconds, self.preempted) if p]

        def ms(x: float) -> float:
            return round(x * 1e3, 3)

        return {"calls": len(s), "p50_ms": ms(s[len(s) // 2]),
                "p99_ms": ms(s[min(len(s) - 1, int(0.99 * len(s)))]), "max_ms": ms(s[-1]),
                "max_not_preempted_ms": ms(max(own)) if own else None,
                "preempted_calls": len(hit), "max_preempted_ms": ms(max(hit)) if hit else None,
                "preemption_known": _RUSAGE_THREAD is not None}
