"""benchmarks/policy_vs_native.py, native's half: vLLM 0.34's own CPU offloading manager on the
tiny stream of ``test_policy_vs_native.py``, and the same hits as kvtier's manager under the
same store policy.

Needs vLLM 0.34 imported in this process, so the main suite (vLLM 0.32) does not collect this
file (its name is not ``test_*``); ``scripts/test_vllm_release.sh 0.34.0`` runs it with 0.34
first on the path. Run elsewhere, it is skipped and says why.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

import policy_vs_native as pvn
from test_policy_vs_native import BLOCK_BYTES, BT, chain_turn, distinct, expected_hits, tiny_stream


@pytest.fixture(scope="module")
def native() -> dict:
    """Everything the tests below assert on, computed once with vLLM 0.34."""
    try:  # the replay's own check: vLLM 0.34 imported, else why not
        version = pvn.load_native()["version"]
    except pvn.NativeUnavailable as exc:
        pytest.skip(f"{exc} (scripts/test_vllm_release.sh {pvn.NATIVE_VERSION} runs this file)")
    stream = tiny_stream()
    out: dict = {"version": version}
    for config in ("native", "native-all", "kvtier", "kvtier-prompt"):
        tally, hits, prompt_only = pvn.replay(stream, config, distinct(stream), BLOCK_BYTES, BT)
        out[config] = {"hits": hits, "prompt_only": prompt_only, "tally": asdict(tally)}
        tally, hits, _ = pvn.replay(stream, config, 1, BLOCK_BYTES, BT)
        out[config + "@1"] = {"hits": hits, "tally": asdict(tally)}
    a, b = list(range(100, 164)), list(range(500, 516))
    _, hits, _ = pvn.replay([chain_turn(a), chain_turn(b, 1), chain_turn(a)], "native", 4,
                            BLOCK_BYTES, BT)
    out["rank"] = hits
    return out


def test_native_is_vllm_034_with_its_prompt_only_default(native):
    assert native["version"] == pvn.NATIVE_VERSION
    assert native["native"]["prompt_only"] is True  # 0.34's default, read by its spec
    assert native["native-all"]["prompt_only"] is False


@pytest.mark.parametrize("config", ["native", "native-all"])
def test_native_hits_every_repeated_block_when_everything_fits(native, config):
    stream = tiny_stream()
    want = expected_hits(stream, native[config]["prompt_only"])
    assert native[config]["hits"] == want and sum(want) > 0
    tally = native[config]["tally"]
    assert tally["evicted_blocks"] == 0 and tally["unstored_blocks"] == 0
    assert (tally["stored_answer_blocks"] == 0) == native[config]["prompt_only"]


@pytest.mark.parametrize("config", ["native", "native-all"])
def test_native_with_one_block_of_room_hits_at_most_a_block(native, config):
    assert max(native[config + "@1"]["hits"]) <= 1


@pytest.mark.parametrize("pair", [("native", "kvtier-prompt"), ("native-all", "kvtier")])
def test_same_policy_same_hits_when_everything_fits(native, pair):
    assert native[pair[0]]["hits"] == native[pair[1]]["hits"]


def test_native_ranks_a_finished_chain_head_most_recent(native):
    assert native["rank"] == [0, 0, 3]  # as kvtier's finish rank does
