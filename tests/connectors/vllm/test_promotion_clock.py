"""The scheduler times its own promotions (kvtier/connectors/vllm/scheduler/promotion_clock.py)."""

from __future__ import annotations

from kvtier.connectors.vllm.scheduler.promotion_clock import PromotionClock
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


def model(per_block_s: float, block: int) -> LoadCostModel:
    m = LoadCostModel(block_bytes=block, block_tokens=16, recompute_s_per_token=per_block_s / 16)
    m.record_load(Medium.CPU, 256 << 20, (256 << 20) / 44e9)  # hops as the worker reports them
    m.record_load(Medium.DISK, 32 << 20, 3.4e-3)  # 9.9 GB/s from the page cache
    return m


def test_a_promotions_wait_becomes_the_tiers_fixed_cost_not_its_bandwidth():
    """Lent H100 figures. 1B shape (512 KiB blocks, 0.076 ms to recompute one): the hop says
    a 1k disk hit pays; the request waited 17 ms for its promotion, and the hit lost to
    recompute. 8B shape (2 MiB blocks, 0.40 ms): with the same wait, an 8k hit still pays
    (the bandwidth was not folded into a slower one)."""
    small, big = model(0.076e-3, 512 << 10), model(0.40e-3, 2 << 20)
    assert small.worth_loading([Medium.DISK] * 64) == 64  # the hop alone: load
    clock = Clock()
    pc = PromotionClock(block_bytes=512 << 10, clock=clock)
    pc.started(7, [True] * 64, [False] * 64)
    clock.now += 17e-3
    medium, nbytes, seconds = pc.settled(7, ok=True)
    small.record_promotion(medium, nbytes, seconds)
    big.record_promotion(medium, nbytes, seconds)
    bw = small.bandwidth[Medium.DISK]
    assert abs(bw.bytes_per_s - (32 << 20) / 3.4e-3) < 1  # bandwidth: still the hop's
    assert 12e-3 < bw.fixed_s < 13.5e-3 and bw.waits == 1
    assert small.worth_loading([Medium.DISK] * 64) == 0
    # 8x the only hop measured, and within 1.5x of recompute even as estimated: loaded once
    # to measure a larger hop (cost.py, explorations), then declined as estimated
    assert small.worth_loading([Medium.DISK] * 512) == 512 and small.explorations == 1
    assert small.worth_loading([Medium.DISK] * 512) == 0
    assert big.worth_loading([Medium.DISK] * 512) == 512
    small.record_load(Medium.DISK, 1 << 20, 1e-3)  # a small hop no longer teaches fixed_s
    assert 12e-3 < bw.fixed_s < 13.5e-3
