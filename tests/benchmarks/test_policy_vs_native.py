"""benchmarks/policy_vs_native.py: the replay that compares vLLM 0.34's native CPU offloading
manager with kvtier's on one request stream must count hits right, or its "same policy" verdict
means nothing.

Checked on a tiny stream (4 conversations, 64-token first prompts): with room for every block,
each request hits exactly the leading run of its prompt blocks that earlier requests stored
(computed here from the stream alone); with one block of room, hardly anything; prompt-only
stores no answer block; and the finish rank is what keeps a chain's head when a full tier
evicts. This file is kvtier's half and runs everywhere; native's half needs vLLM 0.34 in the
process and lives in ``vllm034_policy_vs_native.py``, which ``scripts/test_vllm_release.sh
0.34.0`` runs (the main suite's environment has vLLM 0.32).
"""

from __future__ import annotations

import json
import sys
import types

import pytest

import policy_vs_native as pvn
from serving_workload import Shape

BT = 16
BLOCK_BYTES = pvn.block_bytes_of("1b", BT)
SHAPE = Shape(first=64, user=32, answer=40, turns=3)  # 4 prompt blocks, then +4.5 per turn
POOL, REQUESTS = 4, 24


def tiny_stream() -> list[pvn.Turn]:
    return pvn.build_stream(SHAPE, POOL, REQUESTS, seed=0, vocab=1000, block_tokens=BT)


def expected_hits(stream, prompt_only: bool) -> list[int]:
    """Per request: the leading run of its prompt blocks that an earlier request stored, the
    rule written out again here rather than taken from the module under test."""
    stored: set[bytes] = set()
    out = []
    for t in stream:
        prompt = t.keys[:t.prompt_tokens // BT]
        hit = next((i for i, k in enumerate(prompt) if k not in stored), len(prompt))
        out.append(hit)
        stored.update(prompt if prompt_only else t.keys)
    return out


def distinct(stream) -> int:
    return len({k for t in stream for k in t.keys})


def run_config(stream, config: str, capacity: int):
    tally, hits, _ = pvn.replay(stream, config, capacity, BLOCK_BYTES, BT)
    return tally, hits


def chain_turn(ids: list[int], serial: int = 0) -> pvn.Turn:
    """A one-off request of ``ids`` (whole blocks), answered by one token: only its prompt is
    stored."""
    n = len(ids) // BT
    return pvn.Turn(serial, 0, len(ids), n, pvn.chain_keys(ids, BT, n), True)


# ------------------------------------------------------------------ the stream
def test_stream_is_the_pool_warm_then_poisson_turns_of_growing_chains():
    stream = tiny_stream()
    assert [t.measured for t in stream] == [False] * POOL + [True] * REQUESTS
    last: dict[int, pvn.Turn] = {}
    for t in stream:
        assert t.prompt_tokens == SHAPE.prompt_len(t.turn)
        assert t.prompt_blocks == t.prompt_tokens // BT
        # the prompt's blocks, then the answer's computed ones (its last token is never fed)
        assert len(t.keys) == (t.prompt_tokens + SHAPE.answer - 1) // BT
        prev = last.get(t.serial)
        if prev is not None:  # the next turn repeats the whole previous sequence
            assert t.turn == prev.turn + 1
            assert t.keys[:len(prev.keys)] == prev.keys
        last[t.serial] = t
    assert len({t.serial for t in stream}) > POOL  # conversations retired and were replaced
    assert stream == tiny_stream()  # seeded: every configuration gets the same requests


def test_conversations_stay_busy_for_busy_s():
    stream = pvn.build_stream(SHAPE, POOL, REQUESTS, seed=0, vocab=1000, block_tokens=BT,
                              rate=1.0, busy_s=1e9, warm=False)
    # each turn holds its conversation past every later arrival: the first 4 arrivals take the
    # 4 conversations, and each later one waits for the earliest to end
    assert len({t.serial for t in stream[:POOL]}) == POOL
    assert all(t.measured for t in stream) and len(stream) == REQUESTS


# ------------------------------------------------------------------ kvtier's half
@pytest.mark.parametrize("config", ["kvtier", "kvtier-prompt", "kvtier-norank",
                                    "kvtier-prompt-norank"])
def test_kvtier_hits_every_repeated_block_when_everything_fits(config):
    stream = tiny_stream()
    prompt_only = pvn.CONFIGS[config][1]
    tally, hits = run_config(stream, config, distinct(stream))
    want = expected_hits(stream, prompt_only)
    assert hits == want and sum(want) > 0
    assert tally.evicted_blocks == 0 and tally.unstored_blocks == 0
    measured = [h for h, t in zip(hits, stream) if t.measured]
    assert tally.hit_blocks == sum(measured) and tally.requests == REQUESTS
    # the answer's blocks are what the next turn hits beyond the previous prompt
    if not prompt_only:
        assert sum(want) > sum(expected_hits(stream, True))


def test_kvtier_prompt_only_stores_every_prompt_block_and_no_answer_block():
    stream = tiny_stream()
    prompt_keys = {k for t in stream for k in t.keys[:t.prompt_blocks]}
    only, _ = run_config(stream, "kvtier-prompt", distinct(stream))
    assert only.stored_answer_blocks == 0 and only.stored_blocks == len(prompt_keys)
    every, _ = run_config(stream, "kvtier", distinct(stream))
    assert every.stored_blocks == distinct(stream) and every.stored_answer_blocks > 0


@pytest.mark.parametrize("config", ["kvtier", "kvtier-prompt"])
def test_kvtier_with_one_block_of_room_hits_at_most_a_block(config):
    stream = tiny_stream()
    tally, hits = run_config(stream, config, 1)
    assert max(hits) <= 1 and tally.unstored_blocks > 0


def test_kvtier_finish_rank_keeps_a_finished_chains_head():
    # chain A (4 blocks) fills the tier, B (1 new block) evicts one, A asks again
    a, b = list(range(100, 164)), list(range(500, 516))
    stream = [chain_turn(a), chain_turn(b, 1), chain_turn(a)]
    _, ranked = run_config(stream, "kvtier-prompt", 4)
    _, unranked = run_config(stream, "kvtier-prompt-norank", 4)
    assert ranked == [0, 0, 3]  # the tail went: the first 3 blocks still hit
    assert unranked == [0, 0, 0]  # stored head first, the head was the oldest: no hit


def test_command_line_kvtier_rows_only(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = pvn.main(["--first-tokens", "64", "--user-tokens", "32", "--answer-tokens", "40",
                   "--turns", "3", "--pool", "4", "--requests", "24", "--capacity-blocks", "8",
                   "--configs", "kvtier,kvtier-prompt", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vLLM: not used" in printed
    assert "| kvtier (defaults: prompt-only, finish rank) |" in printed
    result = json.loads(out.read_text())
    assert result["vllm"] is None and "per_request_hit_blocks" not in result
    assert [r["config"] for r in result["configs"]] == ["kvtier", "kvtier-prompt"]
    assert all(r["vs_native"] is None for r in result["configs"])
    assert result["requests"] == {"warm": 4, "measured": 24,
                                  "distinct_blocks": result["requests"]["distinct_blocks"]}


def test_native_rows_refuse_another_vllm(monkeypatch, capsys):
    fake = types.SimpleNamespace(__version__="0.32.0", __file__="/x/vllm/__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert pvn.main(["--requests", "1", "--pool", "2", "--configs", "native"]) == 2
    err = capsys.readouterr().err
    assert "vLLM 0.32.0" in err and "need 0.34.0" in err and "vllm-0.34.0" in err
