"""The scheduler times its own promotions (kvtier/connectors/promotion_clock.py)."""

from __future__ import annotations

from kvtier.connectors.promotion_clock import PromotionClock
from kvtier.manager.cost import LoadCostModel
from kvtier.manager.specs import Medium


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_promotion_is_timed_from_plan_to_settle_per_tier():
    clock = Clock()
    pc = PromotionClock(block_bytes=1 << 20, clock=clock)
    pc.started(1, [True, True, False], [False, False, False])  # 2 disk blocks, 1 CPU block
    pc.started(2, [False], [True])  # a shared-tier promotion
    pc.started(3, [True], [True])  # both: cannot be split, not timed
    pc.started(4, [False, False], [False, False])  # a CPU hit: nothing promoted
    assert len(pc) == 2
    clock.now += 0.025
    medium, nbytes, seconds = pc.settled(1, ok=True)
    assert (medium, nbytes) == (Medium.DISK, 2 << 20) and abs(seconds - 0.025) < 1e-9
    assert pc.settled(2, ok=False) is None  # a failed promotion measured nothing
    assert pc.settled(3, ok=True) is None and pc.settled(4, ok=True) is None
    assert len(pc) == 0


def test_wall_time_samples_make_a_slow_promotion_path_lose_to_recompute():
    """The hop alone (32 MiB read in 3.4 ms) says a 1B-shape 1k disk hit pays; the request
    waited 17 ms for it (both figures from the lent H100); recomputing takes 14.5 ms."""
    block = 512 << 10
    model = LoadCostModel(block_bytes=block, block_tokens=16,
                          recompute_s_per_token=14.5e-3 / 1024)
    model.record_load(Medium.CPU, 256 << 20, 256 / 44e3)
    hop = LoadCostModel(block_bytes=block, block_tokens=16, recompute_s_per_token=14.5e-3 / 1024)
    hop.record_load(Medium.CPU, 256 << 20, 256 / 44e3)
    hop.record_load(Medium.DISK, 32 << 20, 3.4e-3)
    assert hop.worth_loading([Medium.DISK] * 64) == 64
    clock = Clock()
    pc = PromotionClock(block_bytes=block, clock=clock)
    pc.started(7, [True] * 64, [False] * 64)
    clock.now += 17e-3
    model.record_load(*pc.settled(7, ok=True))
    assert model.worth_loading([Medium.DISK] * 64) == 0
