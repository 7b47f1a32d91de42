"""What one offline replay of a trace measured (:mod:`belady`, :mod:`compare`).

Its own module so that the optimal bound (belady.py) and the comparison that runs it beside the
real manager (compare.py) can both build one without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SimResult:
    policy: str
    capacity: int
    blocks: int = 0  # blocks looked up
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    written: int = 0  # blocks stored into the cache
    wasted: int = 0  # written blocks evicted before their first hit
    evicted: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, token_hit_rate=self.token_hit_rate)
        return d
