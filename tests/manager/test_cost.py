"""Cost-aware loading: hits are reported only while loading them beats recomputing them.

Numbers from ../shared/reference/hardware.md: Llama-3.1-8B keeps 128 KiB of KV per token (1 GiB
per 8k tokens) and recomputes 8,192 tokens in 265 ms; the lent machine's disk reads ~1.5 GB/s,
pinned CPU memory ~50 GB/s."""

from __future__ import annotations

import math

import pytest

from kvtier.manager.cost import LoadBandwidth, LoadCostModel
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager
from support.promotions import settle_promotions

GB = 1e9
BLOCK_TOKENS = 16
BLOCK_BYTES = BLOCK_TOKENS * 128 * 1024  # 2 MiB
RECOMPUTE_S_PER_TOKEN = 0.265 / 8192
CPU, DISK = Medium.CPU, Medium.DISK


def model(cpu_gbps=None, disk_gbps=None, **kw) -> LoadCostModel:
    m = LoadCostModel(block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS,
                      recompute_s_per_token=RECOMPUTE_S_PER_TOKEN, **kw)
    for medium, gbps in ((CPU, cpu_gbps), (DISK, disk_gbps)):
        if gbps is not None:  # one 1 GiB load at that speed
            assert m.record_load(medium, 1 << 30, (1 << 30) / (gbps * GB))
    return m


def test_slow_disk_loses_to_recompute_cpu_wins():
    m = model(cpu_gbps=50, disk_gbps=1.5, probe_every=0)
    assert m.load_block_s(CPU) < m.recompute_block_s < m.load_block_s(DISK)
    assert m.worth_loading([CPU] * 4) == 4
    assert m.worth_loading([CPU, CPU, DISK, DISK]) == 2
    assert m.worth_loading([DISK, DISK]) == 0
    assert m.snapshot()["break_even_gbps"] == pytest.approx(4.05, abs=0.01)


def test_fast_disk_is_loaded():
    m = model(cpu_gbps=50, disk_gbps=10, probe_every=0)
    assert m.worth_loading([CPU, DISK, DISK, DISK]) == 4


def test_a_slow_block_is_loaded_when_enough_fast_ones_follow_it():
    m = model(cpu_gbps=50, disk_gbps=1.5, probe_every=0)
    # a disk block loses ~0.92 ms, a CPU block saves ~0.48 ms: one CPU block does not repay it
    assert m.worth_loading([DISK, CPU]) == 0
    assert m.worth_loading([DISK, CPU, CPU]) == 3
    assert m.worth_loading([CPU, DISK, CPU, DISK]) == 1


def test_unmeasured_tier_gets_the_optimistic_prior_then_its_measurement():
    m = model(cpu_gbps=50, probe_every=0)
    assert m.worth_loading([DISK] * 3) == 3  # never measured: tried
    m.record_load(DISK, 64 << 20, (64 << 20) / (1.5 * GB))
    assert m.worth_loading([DISK] * 3) == 0
    pessimist = model(cpu_gbps=50, prior_bytes_per_s=1 * GB, probe_every=0)
    assert pessimist.worth_loading([DISK]) == 0


def test_a_shunned_tier_is_probed_now_and_then():
    m = model(cpu_gbps=50, disk_gbps=1.5, probe_every=3)
    assert [m.worth_loading([DISK, DISK]) for _ in range(6)] == [0, 0, 2, 0, 0, 2]
    assert m.cuts == 6 and m.probes == 2


def test_a_load_too_small_to_measure_bandwidth_teaches_nothing():
    """A one-block hit's time is the job's fixed cost: in real vLLM on an H100 a 2 MiB first
    hit taught the model a CPU tier slower than recompute, and every later 8k and 32k CPU hit
    of the run was recomputed."""
    m = model(probe_every=0)
    assert not m.record_load(CPU, BLOCK_BYTES, 2e-3)  # 2 MiB in 2 ms: ~1 GB/s
    assert m.worth_loading([CPU] * 512) == 512
    assert m.record_load(CPU, 1 << 30, (1 << 30) / (50 * GB))  # a real 1 GiB load is learnt
    assert m.bandwidth[CPU].samples == 1
    assert m.worth_loading([CPU] * 512) == 512
    slow = model(probe_every=0)
    assert slow.record_load(DISK, 64 << 20, (64 << 20) / (1.5 * GB))  # 64 MiB: measured
    assert slow.worth_loading([DISK]) == 0


def test_small_loads_teach_a_fixed_cost_charged_once_per_load():
    """A one-block disk hit in real vLLM read 2 MiB in 8 ms (the reader's fixed cost) and was
    slower than recomputing its 16 tokens; the fixed cost is learnt from such small loads and
    charged once per tier a lookup loads from, so one block is recomputed while a long hit
    (where the cost is spread over many blocks) still loads."""
    m = model(cpu_gbps=50, disk_gbps=10, probe_every=0)  # a disk fast enough per byte
    assert m.worth_loading([DISK]) == 1
    assert not m.record_load(DISK, BLOCK_BYTES, 8e-3)  # no bandwidth from it ...
    assert m.bandwidth[DISK].fixed_s == pytest.approx(8e-3 - BLOCK_BYTES / (10 * GB))
    assert m.worth_loading([DISK]) == 0  # ... but one block no longer pays
    assert m.worth_loading([DISK] * 512) == 512
    assert m.worth_loading([CPU, CPU] + [DISK]) == 2  # the CPU blocks still load
    assert m.snapshot()["fixed_ms"]["DISK"] == pytest.approx(7.79, abs=0.01)
    # a CPU tier whose small loads cost a little per job still loads one block
    assert not m.record_load(CPU, BLOCK_BYTES, 1e-4)
    assert m.worth_loading([CPU]) == 1


def test_a_hit_ending_the_prompt_is_loaded_despite_the_cpu_tiers_fixed_cost():
    """Real vLLM, H100, 1B shape: a one-block CPU hit taught a fixed cost (0.86 ms) above the
    block's recompute estimate (0.09 ms from large forwards), so the 16-token prompt was
    recomputed: 11.7 ms, against 6.7 ms loaded (the step then computes one token, a full CUDA
    graph). A hit that ends the prompt saves the prefill step itself: the CPU fixed cost is not
    charged against loading all of it. Elsewhere, and for the disk's fixed cost, it still is."""
    m = LoadCostModel(block_bytes=512 << 10, block_tokens=BLOCK_TOKENS,
                      recompute_s_per_token=0.0892e-3 / BLOCK_TOKENS, probe_every=0)
    assert m.record_load(CPU, 1 << 30, (1 << 30) / (37 * GB))
    assert not m.record_load(CPU, 512 << 10, 0.866e-3)  # a one-block hop: fixed cost only
    assert m.bandwidth[CPU].fixed_s > m.recompute_block_s
    assert m.worth_loading([CPU]) == 0  # a block in the middle of a prompt: recomputed
    assert m.worth_loading([CPU], ends_prompt=True) == 1  # the whole prompt: loaded
    assert m.worth_loading([CPU] * 3, ends_prompt=True) == 3
    cuts = m.cuts
    assert m.worth_loading([CPU] * 3) == 0 and m.cuts == cuts + 1
    # a disk promotion's fixed cost is not waived: it can exceed the prefill step
    assert not m.record_load(DISK, 512 << 10, 8e-3)
    assert m.worth_loading([DISK], ends_prompt=True) == 0
    assert m.worth_loading([CPU, DISK], ends_prompt=True) == 0


def test_the_manager_passes_ends_prompt_only_for_a_hit_on_every_key():
    cost = LoadCostModel(block_bytes=512 << 10, block_tokens=BLOCK_TOKENS,
                         recompute_s_per_token=0.0892e-3 / BLOCK_TOKENS, probe_every=0)
    cost.record_load(CPU, 512 << 10, 0.866e-3)
    m = TieredOffloadingManager(cpu_blocks=8, cost=cost)
    m.complete_store(m.prepare_store([b"a"]).keys)
    assert m.lookup([b"a"], ends_prompt=True).num_hits == 1
    assert m.lookup([b"a"]).num_hits == 0
    # a hit on the first key only does not end the prompt: its step still computes a block
    assert m.lookup([b"a", b"b"], ends_prompt=True).num_hits == 0


def test_bandwidth_estimate_follows_change_and_ignores_nonsense():
    bw = LoadBandwidth(prior_bytes_per_s=7 * GB)
    assert bw.bytes_per_s == 7 * GB
    for bad in ((0, 1.0), (1 << 20, 0.0), (-5, 1.0), (1 << 20, math.nan), (math.inf, 1.0)):
        assert not bw.record(*bad)
    assert bw.samples == 0 and bw.bytes_per_s == 7 * GB
    for _ in range(10):
        bw.record(1.5 * GB, 1.0)
    assert bw.bytes_per_s == pytest.approx(1.5 * GB)
    for _ in range(15):
        bw.record(10 * GB, 1.0)
    assert 9 * GB < bw.bytes_per_s < 10 * GB
    with pytest.raises(ValueError):
        LoadBandwidth(0)
    with pytest.raises(ValueError):
        LoadCostModel(block_bytes=0, block_tokens=16, recompute_s_per_token=1e-5)
    with pytest.raises(ValueError):
        LoadCostModel(block_bytes=1, block_tokens=16, recompute_s_per_token=0)


def manager(disk_gbps: float | None) -> TieredOffloadingManager:
    cost = model(cpu_gbps=50, probe_every=0)
    m = TieredOffloadingManager(cpu_blocks=8, disk_blocks=8, initial_disk_keys=[b"d1", b"d2"],
                                cost=cost)
    m.complete_store(m.prepare_store([b"c1", b"c2"]).keys)
    if disk_gbps is not None:
        m.record_load(DISK, 1 << 30, (1 << 30) / (disk_gbps * GB))
    return m


def test_manager_lookup_skips_hits_slower_than_recompute():
    m = manager(disk_gbps=1.5)
    res = m.lookup([b"c1", b"c2", b"d1", b"d2", b"x"])
    assert res.tiers == (CPU, CPU)
    assert m.stats.skipped_slower_than_recompute == {"CPU": 0, "DISK": 2}
    assert m.lookup([b"d1", b"d2"]).num_hits == 0
    assert m.stats.skipped_slower_than_recompute["DISK"] == 4


def promoted(m, keys) -> tuple:
    """The keys of the promotions ``m`` queued (settled as read), in order."""
    return tuple(key for t in settle_promotions(m) for key in t.keys)


def test_manager_lookup_loads_from_a_fast_disk_and_without_a_model():
    m = manager(disk_gbps=10)
    res = m.lookup([b"c1", b"c2", b"d1", b"d2"])  # worth loading: the disk hits are promoted
    assert res.tiers == (CPU, CPU) and res.pending
    assert m.stats.skipped_slower_than_recompute == {"CPU": 0, "DISK": 0}
    assert promoted(m, [b"d1", b"d2"]) == (b"d1", b"d2")
    assert m.lookup([b"c1", b"c2", b"d1", b"d2"], sighting=False).tiers == (CPU,) * 4
    plain = TieredOffloadingManager(cpu_blocks=4, disk_blocks=4, initial_disk_keys=[b"d1"])
    plain.record_load(DISK, 1, 1.0)  # no model: ignored
    res = plain.lookup([b"d1"])
    assert res.tiers == () and res.pending
    assert promoted(plain, [b"d1"]) == (b"d1",)
    assert plain.lookup([b"d1"], sighting=False).tiers == (CPU,)


def test_measured_recompute_turns_cost_aware_loading_on():
    """Without a ``cost:`` section the connector's measurements of the engine's forwards
    switch cost-aware loading on: a disk measured slower than recomputing is skipped."""
    from kvtier.connectors.vllm.recompute import RecomputeEstimate

    m = TieredOffloadingManager(cpu_blocks=8, disk_blocks=8,
                                initial_disk_keys=[b"d1", b"d2", b"d3", b"d4"])
    assert m.cost is None and m.lookup([b"d1", b"d2"]).pending  # no model: promoted
    assert promoted(m, [b"d1", b"d2"]) == (b"d1", b"d2")
    assert m.lookup([b"d1", b"d2"], sighting=False).num_hits == 2
    est = RecomputeEstimate()
    assert est.add(512, 0.01) is None  # too small a step to say anything
    per_token = est.add(8192, 0.265)
    assert per_token == pytest.approx(RECOMPUTE_S_PER_TOKEN)
    m.measured_recompute(per_token, BLOCK_TOKENS, BLOCK_BYTES)
    assert m.cost is not None
    m.record_load(DISK, 1 << 30, (1 << 30) / (1.5 * GB))
    m.cost.probe_every = 0
    res = m.lookup([b"d3", b"d4"])  # slower than recompute: a miss, nothing promoted
    assert res.num_hits == 0 and not res.pending and promoted(m, [b"d3", b"d4"]) == ()
    assert m.stats.skipped_slower_than_recompute["DISK"] == 2
    # a faster engine (or a slower one) moves the break-even: here recompute costs 40x more
    m.measured_recompute(per_token * 40, BLOCK_TOKENS, BLOCK_BYTES)
    assert m.lookup([b"d3", b"d4"]).pending
    assert promoted(m, [b"d3", b"d4"]) == (b"d3", b"d4")
    assert m.lookup([b"d3", b"d4"], sighting=False).num_hits == 2
    assert m.pins() == 0


def test_a_configured_recompute_time_is_not_overridden_by_measurements():
    m = manager(disk_gbps=1.5)
    m.measured_recompute(RECOMPUTE_S_PER_TOKEN * 40, BLOCK_TOKENS, BLOCK_BYTES)
    assert m.lookup([b"d1", b"d2"]).num_hits == 0


def test_forward_timer_reports_large_cpu_forwards_only():
    from kvtier.connectors.vllm.worker.forward_timer import ForwardTimer

    t = ForwardTimer("cpu")
    t.begin(100)
    t.end()
    t.begin(4096)
    t.end()
    out = t.take()
    assert [tokens for tokens, _ in out] == [4096] and out[0][1] > 0
    assert t.take() == ()


def test_loads_timed_before_the_first_recompute_measurement_are_not_forgotten():
    """A fresh instance's first hits come before any large forward is timed: the loads they
    timed teach the model once it exists. In real vLLM the first REMOTE promotion was slow,
    was forgotten, and the next REMOTE hit loaded at the optimistic prior."""
    m = TieredOffloadingManager(cpu_blocks=8, disk_blocks=8,
                                initial_disk_keys=[b"d1", b"d2", b"d3", b"d4"])
    m.record_load(DISK, 1 << 30, (1 << 30) / (1.5 * GB))  # before the model: kept
    m.record_promotion(DISK, 1 << 30, 2.0)
    assert m.cost is None and m.lookup([b"d1", b"d2"]).pending  # no model: promoted
    assert promoted(m, [b"d1", b"d2"]) == (b"d1", b"d2")
    assert m.lookup([b"d1", b"d2"], sighting=False).num_hits == 2
    m.measured_recompute(RECOMPUTE_S_PER_TOKEN, BLOCK_TOKENS, BLOCK_BYTES)
    m.cost.probe_every = 0
    assert m.cost.bandwidth[DISK].bytes_per_s == pytest.approx(1.5 * GB)
    assert m.cost.bandwidth[DISK].fixed_samples == 1
    res = m.lookup([b"d3", b"d4"])  # slower than recompute, as measured
    assert res.num_hits == 0 and not res.pending and promoted(m, [b"d3", b"d4"]) == ()


REMOTE = Medium.REMOTE
MIB = 1 << 20


def vllm_8b(**kw) -> LoadCostModel:
    """The Llama-3.1-8B shape as a fresh vLLM instance saw it on an H100 host: recompute
    ~220 ms per 8k tokens (0.43 ms per 2 MiB block), CPU -> GPU ~50 GB/s."""
    m = LoadCostModel(block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS,
                      recompute_s_per_token=0.43e-3 / BLOCK_TOKENS, probe_every=0, **kw)
    assert m.record_load(CPU, 1 << 30, (1 << 30) / (50 * GB))
    return m


def test_hops_of_two_sizes_split_into_latency_and_bandwidth():
    bw = LoadBandwidth(prior_bytes_per_s=100 * GB)
    for nbytes in (256 * MIB, 1 << 30, 256 * MIB, 4 << 30):
        assert bw.record(nbytes, 0.040 + nbytes / (16 * GB))
    assert bw.latency_s == pytest.approx(0.040, rel=1e-6)
    assert bw.bytes_per_s == pytest.approx(16 * GB, rel=1e-6)
    assert bw.hop_s(2 << 30) == pytest.approx(0.040 + (2 << 30) / (16 * GB))
    assert bw.largest == 4 << 30


def test_one_size_or_a_nonsense_line_reads_as_bytes_over_seconds():
    same = LoadBandwidth(prior_bytes_per_s=100 * GB)
    for _ in range(3):
        same.record(256 * MIB, 0.0588)
    assert same.latency_s == 0.0
    assert same.bytes_per_s == pytest.approx(256 * MIB / 0.0588)
    # a larger hop much slower per byte would need a negative latency: no line, the ratio
    odd = LoadBandwidth(prior_bytes_per_s=100 * GB, keep=0.5)
    odd.record(256 * MIB, 0.010)
    odd.record(1 << 30, 0.200)
    assert odd.latency_s == 0.0
    assert odd.bytes_per_s == pytest.approx((0.5 * 256 * MIB + (1 << 30)) / (0.5 * 0.010 + 0.200))


def test_a_small_first_remote_hit_does_not_condemn_larger_ones():
    """Real vLLM 0.33, H100 host, 8B shape: the first REMOTE promotion (2k tokens, 256 MiB)
    took 58.8 ms (4.6 GB/s, mostly per-job latency). Read as a bandwidth, every later 8k and
    32k REMOTE hit was declined; a 32k promotion later moved at 16 GB/s. The larger hit is
    explored once, and its measurement splits latency from bandwidth."""
    m = vllm_8b()
    assert m.record_load(REMOTE, 256 * MIB, 0.0588)
    assert m.bandwidth[REMOTE].bytes_per_s == pytest.approx(4.57 * GB, rel=0.01)
    assert m.worth_loading([REMOTE] * 128) == 0  # 2k: slower than recompute, not larger
    assert m.worth_loading([REMOTE] * 512) == 512  # 8k: 4x the largest hop: explored
    assert m.explorations == 1
    assert m.worth_loading([REMOTE] * 512) == 0  # not again before (or after) it is measured
    assert m.worth_loading([REMOTE] * 1024) == 1024  # a further doubling is explored again
    assert m.explorations == 2
    assert m.record_load(REMOTE, 1 << 30, 0.040 + (1 << 30) / (16 * GB))
    snap = m.snapshot()
    assert snap["load_gbps"]["REMOTE"] > 13 and snap["latency_ms"]["REMOTE"] > 30
    assert m.worth_loading([REMOTE] * 512) == 512  # 8k now pays as measured
    assert m.worth_loading([REMOTE] * 2048) == 2048
    assert m.worth_loading([REMOTE] * 128) == 0  # 2k still does not: the latency is charged
    assert m.explorations == 2 and snap["explorations"] == 2


def test_a_tier_far_slower_than_recompute_is_never_explored():
    m = vllm_8b()
    assert m.record_load(DISK, 64 * MIB, (64 * MIB) / (1.0 * GB))
    assert m.worth_loading([DISK] * 2048) == 0
    assert m.explorations == 0 and m.cuts == 1


def test_a_promotions_wait_is_charged_beyond_its_hops_latency():
    m = vllm_8b()
    for nbytes in (256 * MIB, 1 << 30):
        m.record_load(REMOTE, nbytes, 0.040 + nbytes / (16 * GB))
    bw = m.bandwidth[REMOTE]
    # the request waited the hops plus 6 ms of engine steps
    m.record_promotion(REMOTE, 1 << 30, bw.hop_s(1 << 30) + m.bandwidth[CPU].hop_s(1 << 30)
                       + 0.006)
    assert bw.fixed_s == pytest.approx(0.006, abs=1e-6)


def test_the_first_remote_hits_progress_splits_latency_from_bandwidth():
    """Real vLLM 0.33 on two H200s: B's first REMOTE promotion (256 MiB) took 72.5 ms; read as
    bytes over seconds (3.7 GB/s) it made every 8k REMOTE hit look slower than recompute, and
    they were declined. The read's own progress (its first bytes after ~40 ms, the rest at
    ~10 GB/s) shows the per-job latency apart from the bandwidth at once."""
    line = [(n * 32 * MIB, 0.040 + n * 32 * MIB / (10 * GB)) for n in range(2, 9)]
    alone, with_progress = vllm_8b(), vllm_8b()
    for m in (alone, with_progress):
        assert m.record_load(REMOTE, 256 * MIB, line[-1][1])
    for nbytes, seconds in line[:-1]:  # what measured_hops adds from the read's progress
        assert with_progress.record_load(REMOTE, nbytes, seconds)
    assert alone.bandwidth[REMOTE].latency_s == 0.0
    bw = with_progress.bandwidth[REMOTE]
    assert bw.latency_s == pytest.approx(0.040, rel=0.01)
    assert bw.bytes_per_s == pytest.approx(10 * GB, rel=0.01)
    assert alone.worth_loading([REMOTE] * 128) == 0  # 2k: slower than recompute either way
    assert with_progress.worth_loading([REMOTE] * 128) == 0
    assert with_progress.worth_loading([REMOTE] * 512) == 512  # 8k pays, as measured
    assert with_progress.explorations == 0  # no exploration needed to see it


def test_a_tier_measured_slow_long_ago_is_probed_at_its_next_cut():
    """In real vLLM two shared-tier reads that waited behind the instance's own stores read
    0.16 GB/s; a tier that slow is never explored, and a count-based probe needs 100 cut
    lookups. A promoted tier whose last sample is ``probe_after_s`` old is loaded at its next
    cut lookup, once per ``probe_after_s``, and the probe's sample then decides."""
    now = [1000.0]
    m = vllm_8b(probe_after_s=60.0, clock=lambda: now[0])
    assert m.record_load(REMOTE, 24 * MIB, 0.150)  # 0.16 GB/s
    assert m.worth_loading([REMOTE] * 512) == 0
    now[0] += 59.0
    assert m.worth_loading([REMOTE] * 512) == 0
    now[0] += 2.0
    assert m.worth_loading([REMOTE] * 512) == 512  # probed
    assert m.probes == 1 and m.explorations == 0
    assert m.worth_loading([REMOTE] * 512) == 0  # once per probe_after_s, result or not
    m.record_load(REMOTE, 1 << 30, 0.090)  # the probe's read: 12 GB/s
    m.record_load(REMOTE, 1 << 30, 0.088)
    assert m.worth_loading([REMOTE] * 512) == 512
    assert m.probes == 1


def test_probe_after_s_must_be_positive():
    with pytest.raises(ValueError, match="probe_after_s"):
        vllm_8b(probe_after_s=0)


def test_a_local_disk_measured_slow_is_not_probed_by_age():
    now = [1000.0]
    m = vllm_8b(probe_after_s=60.0, clock=lambda: now[0])
    assert m.record_load(DISK, 64 * MIB, (64 * MIB) / (0.5 * GB))
    now[0] += 600.0
    assert m.worth_loading([DISK] * 512) == 0
    assert m.probes == 0
