"""What recomputing a token costs on this engine, from the forwards the workers timed.

Both halves agree on which forwards teach it: the workers time only forwards of at least
``MIN_TOKENS`` (:mod:`.worker.forward_timer`), where prefill is compute-bound and time grows
with tokens; the scheduler keeps the estimate cost-aware loading compares loads against.
"""

from __future__ import annotations

MIN_TOKENS = 1024  # below this a forward is mostly fixed cost (weights read once)


class RecomputeEstimate:
    """Seconds per token of prefill: decayed sums, so it follows the engine within a few
    large steps (batch shape, other tenants) without trusting one outlier."""

    def __init__(self, keep: float = 0.8) -> None:
        self.keep = keep
        self.tokens = 0.0
        self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> float | None:
        if not (tokens >= MIN_TOKENS and seconds > 0):
            return self.per_token
        self.tokens = self.keep * self.tokens + tokens
        self.seconds = self.keep * self.seconds + seconds
        return self.per_token

    @property
    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None
