"""``benchmarks/serving.py --workload``: the published multi-turn workloads as the pool sends
them (lengths in the published ranges, a shared prefix that is the same token ids in every
conversation, the same requests for the same seed), their sizing against the GPU and CPU
bytes, the plan ``--dry-run`` prints, and what a result records (workload, vLLM, GPU)."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys

import pytest

import serving
import serving_report
from serve_client import server_version
from serving_presets import PRESETS, preset
from serving_workload import Pool, Shape
from vllm_e2e_engine import tokens

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "serving.py")
VOCAB = 128256
VLLM = PRESETS["vllm-multiturn"]


def _conversation(pool: Pool, index: int) -> list[tuple[list[int], int]]:
    """Every turn conversation ``index`` sends until it retires: (prompt, max_tokens), the
    server's answer made up as max_tokens ids."""
    out, serial = [], pool.convs[index].serial
    while pool.convs[index].serial == serial:
        conv, prompt = pool.claim(index)
        n = pool.answer_len(conv)
        out.append((prompt, n))
        pool.finish(conv, prompt, [7] * n)
    return out


def _fresh_pool(workload, size: int, seed: int) -> Pool:
    """A pool whose conversations start at turn 0 (the first pool starts them part-way)."""
    pool = Pool(size, workload, vocab=VOCAB, seed=seed)
    for conv in pool.convs:
        conv.turn, conv.history = 0, []
    return pool


# ---------------------------------------------------------------- vLLM's multi-turn

def test_vllm_multiturn_draws_stay_in_the_published_ranges():
    plans = [VLLM.plan(serial, seed=3) for serial in range(3000)]
    # 12-18 turns as vLLM counts them (a prompt and its answer are two, rounded up to even):
    # 6-9 requests, every count drawn
    assert {p.turns for p in plans} == {6, 7, 8, 9}
    assert all(len(p.user) == len(p.answer) == p.turns for p in plans)
    users = [u for p in plans for u in p.user]
    answers = [a for p in plans for a in p.answer]
    assert min(users) == 120 and max(users) == 160
    assert min(answers) == 80 and max(answers) == 120
    prefixes = [p.prefix for p in plans]
    assert 1 <= min(prefixes) and max(prefixes) <= 5000
    # vLLM's lognormal: average 1,000, median 0.85x the average
    assert abs(statistics.fmean(prefixes) - 1000) < 30
    assert abs(statistics.median(prefixes) - 850) < 30
    assert VLLM.conversations == 24 and VLLM.shared == 500


def test_vllm_multiturn_conversations_share_the_common_prefix_and_nothing_else():
    pool = _fresh_pool(VLLM, 24, seed=5)
    firsts = [pool.prompt(c) for c in pool.convs]
    common = VLLM.shared_prefix(5, VOCAB)
    assert len(common) == 500
    assert all(f[:500] == common for f in firsts)  # the same ids: a real shared prefix
    # past it, each conversation is its own: no two agree on their first token after it
    assert len({f[500] for f in firsts}) == 24
    for conv, first in zip(pool.convs, firsts):
        plan = VLLM.plan(conv.serial, 5)
        assert len(first) == 500 + plan.prefix + plan.user[0]
    # another seed: another common prefix
    assert VLLM.shared_prefix(6, VOCAB) != common


def test_vllm_multiturn_turns_grow_by_the_drawn_answer_and_user_lengths():
    pool = _fresh_pool(VLLM, 4, seed=1)
    for index in range(4):
        plan = VLLM.plan(pool.convs[index].serial, 1)
        turns = _conversation(pool, index)
        assert len(turns) == plan.turns  # retired after its own count
        assert [n for _, n in turns] == list(plan.answer)
        for k in range(1, plan.turns):
            prev, n = turns[k - 1]
            prompt = turns[k][0]
            assert prompt[:len(prev) + n] == prev + [7] * n  # its history, answer included
            assert len(prompt) == len(prev) + n + plan.user[k]
        assert len(turns[-1][0]) + turns[-1][1] <= VLLM.max_len()


def test_the_same_seed_sends_the_same_requests_and_another_seed_others():
    def everything(seed: int) -> list:
        pool = _fresh_pool(VLLM, 3, seed)
        return [_conversation(pool, i) for i in range(3)]

    assert everything(11) == everything(11)
    assert everything(11) != everything(12)
    # the first pool (conversations started part-way) too
    a, b = (Pool(24, VLLM, VOCAB, seed=4) for _ in range(2))
    assert [a.prompt(c) for c in a.convs] == [b.prompt(c) for c in b.convs]


def test_a_preset_pool_holds_its_working_set_with_the_shared_prefix_once():
    small = preset("vllm-multiturn", conversations=60)
    pool = Pool(60, small, vocab=1000, seed=2)
    rng, samples = random.Random(1), []
    for i in range(5000):
        conv, prompt = pool.take(rng)
        pool.finish(conv, prompt, [7] * pool.answer_len(conv))
        if i > 1500:
            samples.append(pool.live_tokens())
    want = small.working_set_tokens(60)
    assert abs(statistics.fmean(samples) - want) / want < 0.05
    # the prefix all share counts once: summing the histories would count it 60 times
    held = sum(len(c.history) for c in pool.convs if c.history)
    busy = sum(1 for c in pool.convs if c.history)
    assert pool.live_tokens() == held - 500 * (busy - 1)


# ---------------------------------------------------------------- LMCache's multi-round QA

@pytest.mark.parametrize("name,history", [("lmcache-mrqa", 2000), ("lmcache-mrqa-long", 20000)])
def test_lmcache_mrqa_rounds_share_the_system_prompt(name, history):
    w = PRESETS[name]
    assert (w.conversations, w.turn_range(), w.shared) == (10, (5, 5), 1000)
    pool = _fresh_pool(w, 3, seed=0)
    system = w.shared_prefix(0, VOCAB)
    rounds = [_conversation(pool, i) for i in range(3)]
    for turns in rounds:
        assert len(turns) == 5 and all(n == 100 for _, n in turns)
        assert turns[0][0][:1000] == system
        assert len(turns[0][0]) == 1000 + history + 20  # system, history, a question
        assert [len(p) for p, _ in turns] == [1000 + history + 20 + k * 120 for k in range(5)]
    assert len({tuple(t[0][0][1000:1100]) for t in rounds}) == 3  # histories are each user's


def test_lmcache_users_and_rounds_change_with_the_flags(tmp_path):
    a = serving.configure(serving.parser(), ["--shape", "8b", "--workload", "lmcache-mrqa",
                                             "--pool", "30", "--rounds", "8", "--workdir",
                                             str(tmp_path)])
    assert a.pool == 30 and a.workload.turn_range() == (8, 8)
    pool = _fresh_pool(a.workload, 2, seed=0)
    assert len(_conversation(pool, 0)) == 8
    bad = subprocess.run([sys.executable, SCRIPT, "--workload", "vllm-multiturn", "--rounds",
                          "8", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --rounds") and bad.stderr.count("\n") == 1


# ---------------------------------------------------------------- sizing and the plan

def test_a_preset_sizes_the_gpu_and_cpu_bytes_from_its_working_set(tmp_path):
    a = serving.configure(serving.parser(), ["--shape", "8b", "--workload", "vllm-multiturn",
                                             "--workdir", str(tmp_path)])
    ws = VLLM.working_set_tokens(24) * a.token_bytes
    assert a.pool == 24 and a.ws_bytes == pytest.approx(ws)
    assert a.ws_bytes / a.gpu_kv_bytes == pytest.approx(4.0, rel=1e-6)  # 4-10x by default
    assert a.ws_bytes / a.cpu_bytes == pytest.approx(2.0, rel=1e-6)  # --working-set 2
    assert a.gpu_kv_bytes >= a.max_len * a.token_bytes >= VLLM.max_len() * a.token_bytes
    assert a.rates == [1, 2, 4, 8, 16] and a.min_requests == 40
    args = serving.serve_args(a, "/model", "kvtier_cpu", 8000)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(a.gpu_kv_bytes)
    more = serving.configure(serving.parser(), ["--shape", "8b", "--workload", "vllm-multiturn",
                                                "--pool", "48", "--gpu-working-set", "8",
                                                "--cpu-gib", "3", "--workdir", str(tmp_path)])
    assert more.ws_bytes / more.gpu_kv_bytes == pytest.approx(8.0, rel=1e-6)
    assert more.cpu_bytes == 3 * 2**30
    # the synthetic workload: --gpu-working-set sizes its GPU KV the same way
    syn = serving.configure(serving.parser(), ["--shape", "1b", "--gpu-working-set", "6",
                                               "--workdir", str(tmp_path)])
    assert syn.ws_bytes / syn.gpu_kv_bytes == pytest.approx(6.0, rel=1e-6)


def test_the_synthetic_default_sends_what_it_sent_before_the_presets(tmp_path):
    a = serving.configure(serving.parser(), ["--shape", "1b", "--workdir", str(tmp_path)])
    assert a.workload == Shape(2048, 192, 128, 6) and a.workload_name == "synthetic"
    assert a.gpu_kv_bytes == int(1.5 * 2**30) and a.cpu_bytes == 8 * 2**30 and a.pool == 224
    pool = Pool(3, a.workload, vocab=VOCAB, seed=0)
    conv = pool.convs[2]  # started at turn 2: its first prompt, made-up answers, user turns
    seed = lambda turn: (0 * 1_000_003 + 2) * 1009 + turn  # noqa: E731 - the old scheme
    want = tokens(2048, seed(0), VOCAB)
    for k in (1, 2):
        want += tokens(128, seed(1000 + k), VOCAB) + tokens(192, seed(k), VOCAB)
    assert pool.prompt(conv) == want and pool.answer_len(conv) == 128


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dry_run_prints_the_preset_plan(name):
    out = subprocess.run([sys.executable, SCRIPT, "--workload", name, "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # the plan goes to stderr, nothing starts
    w = PRESETS[name]
    assert f"workload `{name}`" in out.stderr
    assert f"{w.conversations} conversations" in out.stderr
    assert f"shared prefix {w.shared}" in out.stderr
    assert "GPU KV" in out.stderr and "(4.0x," in out.stderr and "CPU" in out.stderr
    assert f"rates {w.rates} req/s" in out.stderr


def test_dry_run_refuses_a_gpu_too_small_for_one_conversation():
    out = subprocess.run([sys.executable, SCRIPT, "--workload", "vllm-multiturn",
                          "--gpu-working-set", "10", "--dry-run"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: --gpu-working-set") and "raise --pool" in out.stderr
    both = subprocess.run([sys.executable, SCRIPT, "--gpu-working-set", "5", "--gpu-kv-gib", "2",
                           "--dry-run"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and both.stderr.startswith("error: --gpu-working-set and")


def test_min_requests_lengthens_the_slow_rates_only(tmp_path):
    a = serving.configure(serving.parser(), ["--shape", "8b", "--workload", "lmcache-mrqa-long",
                                             "--workdir", str(tmp_path)])
    assert a.rates[0] == 0.1 and a.min_requests == 30
    assert [serving.window_s(a, r) for r in a.rates] == [300.0, 60.0, 30.0, 15.0, 15.0]
    syn = serving.configure(serving.parser(), ["--workdir", str(tmp_path)])
    assert syn.min_requests == 0 and serving.window_s(syn, 0.1) == syn.duration_s


# ---------------------------------------------------------------- what a result records

def test_the_report_names_the_workload_the_vllm_release_and_the_gpu(tmp_path):
    a = serving.configure(serving.parser(), ["--shape", "8b", "--workload", "lmcache-mrqa-long",
                                             "--workdir", str(tmp_path)])
    a.device = "NVIDIA H100 80GB HBM3"
    setup = dict(serving.setup(a, "native"), vllm="0.34.0")
    rate = {"sent": 3, "rps": 0.1, "out_tps": 10.0, "ttft_p50_ms": 90.0, "ttft_p99_ms": 120.0,
            "itl_p50_ms": 5.0, "itl_p99_ms": 9.0, "goodput": {"500": {"rps": 0.1,
            "attained": 1.0}}, "working_set_tokens_mean": 1e5, "client_cached_tokens": 10,
            "prompt_tokens": 100, "errors": 0, "cut": 0, "hits": {}, "kvtier_hits": {}}
    data = {"device": a.device, "runs": {a.label: {"configs": {"native": {
        "setup": setup, "argv": ["--workload", "lmcache-mrqa-long"],
        "rates": {"0.1": rate}}}, "errors": {}}}}
    md = serving_report.report(data)
    assert "Workload `lmcache-mrqa-long` (LMCache" in md
    assert "shared prefix 1000, own history 20000, user turns 20, answers 100 tokens" in md
    assert "vLLM 0.34.0 on NVIDIA H100 80GB HBM3" in md
    assert "(the working set is 4.0x)" in md and "(the working set is 2.00x)" in md
    assert "at least 30 requests' arrivals" in md
    # a result written before the presets: the synthetic shape, the release not recorded
    old = dict(setup, workload={"first": 8, "user": 2, "answer": 2, "turns": 3})
    del old["vllm"], old["gpu"]
    data["runs"][a.label]["configs"]["native"]["setup"] = old
    md = serving_report.report(data)
    assert "Workload `synthetic`: first prompt 8 tokens" in md
    assert "vLLM ? (not recorded) on NVIDIA H100 80GB HBM3" in md


def test_server_version_asks_the_server(fake_server):
    assert server_version(fake_server) == "0.0.fake"


@pytest.fixture
def fake_server():
    import signal
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_vllm_sse.py")],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
