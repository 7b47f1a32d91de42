"""One request stream through vLLM 0.34's native CPU offloading manager and through kvtier's
manager, same capacity in blocks: how many CPU hit blocks each supplies.

Why: past saturation on a GPU, native's ``OffloadingConnector`` supplied more CPU hit tokens
than kvtier's CPU tier with the same bytes
(``results/serving_saturation_cadence_vllm034_NVIDIA-H100-80GB-HBM3.md``). Two policy
differences were found and changed since (an ``offload_prompt_only`` key, a finished chain ranked
head-most-recent). This replay tells policy from timing: both managers see the same
requests in the same order, with no concurrency and no clock, so any gap left here is
policy, and a gap seen only on the GPU is timing.

What is replayed, per request in arrival order (each request's calls end before the next
request's begin):

* **native**: the real manager that ``OffloadingConnectorScheduler`` gets from
  ``CPUOffloadingSpec.get_manager()`` (``CPUOffloadingManager`` with its LRU policy), built
  from the same ``kv_connector_extra_config`` that ``serving.py`` gives native
  (``cpu_bytes_to_use`` only, so 0.34's defaults: ``offload_prompt_only`` True, ``lru``), and
  called as the scheduler calls it: ``on_new_request``; ``lookup`` key by key from the first
  block until a miss (``_maximal_prefix_lookup``); ``prepare_load`` of the hit
  (``update_state_after_alloc``) and ``complete_load`` when the load settles; the prefill
  step's ``prepare_store`` of the prompt's full blocks after the hit, then one per decoded
  block as it completes unless prompt-only (``_build_store_jobs``), each ``complete_store``;
  ``on_request_finished`` after the finished request's last ``prepare_store``
  (``_build_connector_meta``). Keys carry their end-token positions, as
  ``update_offload_keys`` sets them.
* **kvtier**: ``TieredOffloadingManager`` from ``build_manager`` with a CPU tier of the same
  bytes, called as ``scheduler/side.py`` and ``store_plan.py`` call it: ``lookup`` of the
  prompt's full blocks; ``prepare_load`` / ``complete_load`` of the hit; ``prepare_store``
  of the prompt's blocks past the hit, then of each decoded block (unless
  ``offload_prompt_only``), each ``complete_store``; then ``_rank_chain``'s ``touch`` of the
  chain head-most-recent (left out in the "no finish rank" rows, a parameter of this replay).

Not replayed: vLLM's GPU prefix cache (every lookup starts at block 0), concurrency (stores
in flight, pinned blocks, interleaved requests' ranks), timing (queueing, which requests are
admitted when), and kvtier's cost model (off without measured recompute times: every hit is
loaded). The stream is ``serving.py``'s: its pool (``serving_workload.Pool``), warmed with
every conversation's turn once, then Poisson arrivals at ``--rate``, each the next turn of an
idle conversation; the answers are seeded token ids of the configured length. A turn keeps its
conversation busy for ``--busy-s`` seconds of arrival time (its manager calls still run at
once), so conversations interleave as they did on the GPU, where a request took about 2 s
(TTFT p50 1.1-2.3 s, then 127 decode steps at 3.5-4.3 ms); ``--busy-s 0`` picks any
conversation at every arrival. The hit counts depend on it strongly: see
``results/policy_vs_native_cpu.md``.

Needs vLLM 0.34 first on the path for the native rows (the main environment has 0.32):

    PYTHONPATH=.venv/vllm-0.34.0 .venv/bin/python benchmarks/policy_vs_native.py \\
        --json benchmarks/results/policy_vs_native_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import random
import sys
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from serving_presets import PRESETS, preset  # noqa: E402
from serving_workload import ANSWERS, Pool, Shape, arrivals, seed_of  # noqa: E402
from vllm_e2e_engine import SHAPES, VOCAB, tokens  # noqa: E402

from kvtier.config import load_config  # noqa: E402
from kvtier.manager.factory import build_manager  # noqa: E402
from kvtier.manager.specs import Medium, RequestContext  # noqa: E402

NATIVE_VERSION = "0.34.0"
VLLM_034 = os.path.join(ROOT, ".venv", "vllm-0.34.0")
SYNTHETIC = "synthetic"
# config id -> (connector, offload_prompt_only (None: the connector's default), kvtier's
# finish rank (None: native, whose LRU ranks a finished request on its own))
CONFIGS = {
    "native": ("native", None, None),
    "native-all": ("native", False, None),
    "kvtier": ("kvtier", False, True),
    "kvtier-prompt": ("kvtier", True, True),
    "kvtier-norank": ("kvtier", False, False),
    "kvtier-prompt-norank": ("kvtier", True, False),
}
LABELS = {
    "native": "native (0.34 defaults: prompt-only)",
    "native-all": "native, offload_prompt_only=false",
    "kvtier": "kvtier, offload_prompt_only=false (answers stored)",
    "kvtier-prompt": "kvtier (defaults: prompt-only, finish rank)",
    "kvtier-norank": "kvtier, offload_prompt_only=false, no finish rank",
    "kvtier-prompt-norank": "kvtier, prompt-only, no finish rank",
}


class NativeUnavailable(RuntimeError):
    """vLLM 0.34 is not the vLLM on the path."""


# ------------------------------------------------------------------ the request stream
@dataclass(frozen=True)
class Turn:
    """One request: its prompt's length and the chained key of every block whose tokens are
    computed by its end (the prompt's, then the answer's but its last token, which is sampled
    and never fed back)."""

    serial: int
    turn: int
    prompt_tokens: int
    prompt_blocks: int  # full blocks of the prompt: what a lookup asks for
    keys: tuple[bytes, ...]
    measured: bool  # False: the warm-up turn serving.py sends before measuring


def chain_keys(ids: Sequence[int], block_tokens: int, n: int) -> tuple[bytes, ...]:
    """Keys of the first ``n`` blocks of ``ids``: sha256 of the parent's key and the block's
    token ids, so a key names its whole prefix (as vLLM's block hashes do)."""
    out, parent = [], b""
    for i in range(n):
        block = array("I", ids[i * block_tokens:(i + 1) * block_tokens]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return tuple(out)


def answer_ids(pool: Pool, conv: Any) -> list[int]:
    """The server's answer to ``conv``'s next turn: seeded token ids, the same ones the pool
    makes up for a conversation it starts part-way (``ANSWERS + turn``)."""
    return tokens(pool.answer_len(conv),
                  seed=seed_of(pool.seed, conv.serial, ANSWERS + conv.turn + 1), vocab=pool.vocab)


def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """The first ``n`` Poisson arrivals of ``serving_workload.arrivals`` (a longer window of
    the same seed has the same first arrivals)."""
    span = n / rate * 1.5 + 10.0
    while True:
        times = arrivals(rate, span, seed)
        if len(times) >= n:
            return times[:n]
        span *= 2


def build_stream(workload: Any, pool_size: int, requests: int, seed: int, vocab: int,
                 block_tokens: int, rate: float = 30.0, busy_s: float = 0.0,
                 warm: bool = True) -> list[Turn]:
    """``serving.py``'s requests: the warm-up (every conversation's turn once, in order,
    unmeasured) when ``warm``, then ``requests`` Poisson arrivals at ``rate`` per second, each
    the next turn of an idle conversation picked as ``serving_driver.run_window`` picks it.
    A turn keeps its conversation busy ``busy_s`` seconds of arrival time (0: it is finished
    before the next arrival)."""
    pool = Pool(pool_size, workload, vocab, seed)
    out: list[Turn] = []

    def serve(conv: Any, prompt: list[int], measured: bool) -> list[int]:
        answer = answer_ids(pool, conv)
        computed = len(prompt) + len(answer) - 1
        out.append(Turn(conv.serial, conv.turn, len(prompt), len(prompt) // block_tokens,
                        chain_keys(prompt + answer, block_tokens, computed // block_tokens),
                        measured))
        return answer

    if warm:
        for i in range(pool_size):
            conv, prompt = pool.claim(i)
            pool.finish(conv, prompt, serve(conv, prompt, False))
    window_seed = seed * 7919  # serving.py's first window
    rng = random.Random(window_seed)
    busy: list[tuple[float, int, Any, list[int], list[int]]] = []  # (ends at, order, ...)
    for order, at in enumerate(arrival_times(rate, requests, window_seed)):
        while busy and busy[0][0] <= at:
            _, _, conv, prompt, answer = heapq.heappop(busy)
            pool.finish(conv, prompt, answer)
        taken = pool.take(rng, timeout=0)
        while taken is None:  # every conversation busy: the arrival waits for the first end
            _, _, conv, prompt, answer = heapq.heappop(busy)
            pool.finish(conv, prompt, answer)
            taken = pool.take(rng, timeout=0)
        conv, prompt = taken
        answer = serve(conv, prompt, True)
        if busy_s > 0:
            heapq.heappush(busy, (at + busy_s, order, conv, prompt, answer))
        else:
            pool.finish(conv, prompt, answer)
    return out


def unbounded_hits(stream: Sequence[Turn], prompt_only: bool) -> list[int]:
    """Each request's hit blocks with a tier that never evicts: the leading run of its prompt
    blocks that earlier requests stored (their prompts' full blocks, and with ``prompt_only``
    False their answers' too)."""
    held: set[bytes] = set()
    out = []
    for t in stream:
        n = 0
        for key in t.keys[:t.prompt_blocks]:
            if key not in held:
                break
            n += 1
        out.append(n)
        held.update(t.keys[:t.prompt_blocks] if prompt_only else t.keys)
    return out


# ------------------------------------------------------------------ the two managers
@dataclass
class Tally:
    """What one configuration's replay counted. Hits of measured requests only (those after
    the warm-up), the rest over every request."""

    hit_blocks: int = 0
    hit_tokens: int = 0
    requests: int = 0
    lookup_blocks: int = 0  # prompt blocks the measured requests looked up
    all_hit_blocks: int = 0  # the warm-up's too
    stored_blocks: int = 0
    stored_answer_blocks: int = 0  # of stored_blocks: past the prompt's full blocks
    evicted_blocks: int = 0
    unstored_blocks: int = 0  # new blocks a store left out for lack of room
    seconds: float = 0.0


def hit_tokens(t: Turn, blocks: int, block_tokens: int) -> int:
    """Tokens vLLM counts for a hit of ``blocks``: it computes the prompt's last token."""
    return min(blocks * block_tokens, t.prompt_tokens - 1)


class NativeReplay:
    """vLLM 0.34's ``CPUOffloadingManager``, called in ``OffloadingConnectorScheduler``'s
    order (see the module docstring)."""

    def __init__(self, capacity: int, block_bytes: int, block_tokens: int,
                 prompt_only: bool | None) -> None:
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                               OffloadingGroupConfig, OffloadingModelConfig,
                                               OffloadingParallelConfig)
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        extra: dict[str, Any] = {"cpu_bytes_to_use": capacity * block_bytes}
        if prompt_only is not None:
            extra["offload_prompt_only"] = prompt_only
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(block_tokens, ("model.layers.0",), 0),),
            worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
            extra_config=extra, engine_id="policy-vs-native",
            model=OffloadingModelConfig("policy-vs-native", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=block_tokens, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True))
        spec = OffloadingSpecFactory.create_spec(config)
        if spec.num_chunks != capacity:
            raise RuntimeError(f"native sized {spec.num_chunks} chunks for {capacity} blocks")
        self.prompt_only = spec.offload_prompt_only  # what the connector would read
        self.manager = spec.get_manager()
        self.base = base
        self.block_tokens = block_tokens

    def run(self, t: Turn, req_id: str, tally: Tally) -> int:
        """One request's calls; returns its hit blocks."""
        b, m, bt = self.base, self.manager, self.block_tokens
        ctx = b.ReqContext(req_id=req_id)
        m.on_new_request(ctx)
        keys = [b.make_offload_key(k, 0) for k in t.keys]
        for i in range(t.prompt_blocks):  # update_offload_keys: the prompt's hashes
            ctx.set_offload_key_position(keys[i], (i + 1) * bt)
        hits = 0
        for key in keys[:t.prompt_blocks]:  # _maximal_prefix_lookup
            result = m.lookup(key, ctx)
            if result is b.LookupResult.MISS:
                break
            if result is not b.LookupResult.HIT:  # nothing is in flight between requests
                raise RuntimeError(f"native lookup answered {result} in a sequential replay")
            hits += 1
        if hits:  # update_state_after_alloc, then the load job's completion
            m.prepare_load(keys[:hits], ctx)
            m.complete_load(keys[:hits], ctx)
        self._store(keys[hits:t.prompt_blocks], ctx, tally, answer=False)  # the prefill step
        if not self.prompt_only:  # a decode step completes one block at a time
            for i in range(t.prompt_blocks, len(keys)):
                ctx.set_offload_key_position(keys[i], (i + 1) * bt)
                self._store([keys[i]], ctx, tally, answer=True)
        m.on_request_finished(ctx)  # after the finished request's last prepare_store
        return hits

    def _store(self, keys: list, ctx: Any, tally: Tally, answer: bool) -> None:
        if not keys:
            return
        out = self.manager.prepare_store(keys, ctx)
        if out is None:  # eviction cannot free enough: the whole store is dropped
            miss = self.base.LookupResult.MISS
            tally.unstored_blocks += sum(self.manager.lookup(k, ctx) is miss for k in keys)
            return
        tally.evicted_blocks += len(out.evicted_keys)
        if out.keys_to_store:
            self.manager.complete_store(out.keys_to_store, ctx)
            tally.stored_blocks += len(out.keys_to_store)
            tally.stored_answer_blocks += len(out.keys_to_store) if answer else 0


class KvtierReplay:
    """kvtier's manager, called as its connector's scheduler side calls it (see the module
    docstring); ``rank``: ``_rank_chain``'s touch when the request finishes."""

    def __init__(self, capacity: int, block_bytes: int, block_tokens: int,
                 prompt_only: bool, rank: bool) -> None:
        # kv_connector_extra_config["kvtier"] as serving.py writes it; no KVTIER_* overrides
        config = load_config(data={"block_tokens": block_tokens,
                                   "tiers": {"cpu": {"capacity": capacity * block_bytes}}},
                             env={})
        if config.cpu_slots(block_bytes) != capacity:
            raise RuntimeError(f"kvtier sized {config.cpu_slots(block_bytes)} CPU blocks")
        self.manager = build_manager(config, block_bytes)
        self.block_tokens = block_tokens
        self.prompt_only = prompt_only
        self.rank = rank

    def run(self, t: Turn, req_id: str, tally: Tally) -> int:
        m, bt = self.manager, self.block_tokens
        keys = t.keys
        stop = t.prompt_blocks
        found = m.lookup(keys[:stop], sighting=True,
                         ends_prompt=stop * bt >= t.prompt_tokens - 1)
        if found.pending:
            raise RuntimeError("kvtier lookup answered pending without a lower tier")
        loaded = 0
        if found.num_hits:  # plan_load, then the job's settling
            plan = m.prepare_load(keys[:found.num_hits])
            m.complete_load(plan.keys)
            loaded = len(plan.keys)
        next_store = self._store(t, req_id, loaded, t.prompt_blocks, tally)  # the prompt
        if not self.prompt_only:  # the decode trickle: each block as it completes
            for i in range(t.prompt_blocks, len(keys)):
                next_store = self._store(t, req_id, next_store, i + 1, tally)
        if self.rank and next_store > 0:  # SchedulerSide._rank_chain
            m.touch(keys[:next_store][::-1])
        return loaded

    def _store(self, t: Turn, req_id: str, first: int, stop: int, tally: Tally) -> int:
        """StorePlanner.plan of blocks ``first .. stop - 1``; returns the new ``next_store``."""
        if stop <= first:
            return first
        keys = t.keys
        ctx = RequestContext(request_id=req_id, first_block_index=first,
                             num_prompt_blocks=t.prompt_blocks, block_tokens=self.block_tokens,
                             parent_key=keys[first - 1] if first else None)
        cut_before = self.manager.stats.store_skipped_no_space
        plan = self.manager.prepare_store(keys[first:stop], ctx)
        tally.unstored_blocks += self.manager.stats.store_skipped_no_space - cut_before
        tally.evicted_blocks += len(plan.evicted.get(Medium.CPU, ()))
        if plan.keys:
            self.manager.complete_store(plan.keys)
            tally.stored_blocks += len(plan.keys)
            tally.stored_answer_blocks += sum(1 for i in range(first, stop)
                                              if i >= t.prompt_blocks and keys[i] in plan.keys)
        return stop


def load_native() -> dict[str, str]:
    """vLLM's version and path, or NativeUnavailable unless it is 0.34 (0.32's kv_offload,
    the main environment's, is another manager)."""
    try:
        import vllm
    except ImportError as exc:
        raise NativeUnavailable(f"vLLM is not importable ({exc}); put {VLLM_034} first on "
                                "PYTHONPATH") from None
    version = getattr(vllm, "__version__", "unknown")
    if version != NATIVE_VERSION:
        raise NativeUnavailable(
            f"vLLM {version} ({os.path.dirname(vllm.__file__)}) is on the path; the native "
            f"rows need {NATIVE_VERSION}: run with PYTHONPATH={VLLM_034} (as "
            "scripts/test_vllm_release.sh does), or leave native out of --configs")
    # imported here, so that no configuration's time includes importing them (torch too)
    import vllm.v1.kv_offload.cpu.spec  # noqa: F401  (OffloadingSpecFactory's lazy import)
    import vllm.v1.kv_offload.factory  # noqa: F401
    return {"version": version, "path": os.path.dirname(vllm.__file__)}


def replay(stream: Sequence[Turn], config_id: str, capacity: int, block_bytes: int,
           block_tokens: int) -> tuple[Tally, list[int], bool]:
    """Run ``stream`` through one configuration; returns its tally, each request's hit
    blocks, and the prompt-only setting it ran with."""
    connector, prompt_only, rank = CONFIGS[config_id]
    began = time.perf_counter()
    r: NativeReplay | KvtierReplay
    if connector == "native":
        r = NativeReplay(capacity, block_bytes, block_tokens, prompt_only)
    else:
        r = KvtierReplay(capacity, block_bytes, block_tokens, bool(prompt_only), bool(rank))
    tally, per_request = Tally(), []
    for i, t in enumerate(stream):
        hits = r.run(t, f"req-{i}", tally)
        per_request.append(hits)
        tally.all_hit_blocks += hits
        if t.measured:
            tally.requests += 1
            tally.lookup_blocks += t.prompt_blocks
            tally.hit_blocks += hits
            tally.hit_tokens += hit_tokens(t, hits, block_tokens)
    tally.seconds = round(time.perf_counter() - began, 2)
    return tally, per_request, r.prompt_only


# ------------------------------------------------------------------ the command line
def block_bytes_of(shape: str, block_tokens: int) -> int:
    """KV bytes of one block of ``shape`` (bf16 K and V of every layer)."""
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 2 * block_tokens


def parser() -> argparse.ArgumentParser:
    d = " (default: %(default)s)"
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=SYNTHETIC, choices=(SYNTHETIC, *PRESETS),
                   help="serving.py's workloads" + d)
    p.add_argument("--first-tokens", type=int, default=2048, help="synthetic" + d)
    p.add_argument("--user-tokens", type=int, default=192, help="synthetic" + d)
    p.add_argument("--answer-tokens", type=int, default=128, help="synthetic" + d)
    p.add_argument("--turns", type=int, default=6, help="synthetic" + d)
    p.add_argument("--shape", default="1b", choices=["1b", "8b"],
                   help="model shape: the block's bytes, with which both tiers are sized" + d)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block" + d)
    p.add_argument("--capacity-blocks", type=int, default=None,
                   help="blocks both CPU tiers hold (default: synthetic 16384, the 8 GiB of the "
                        "1b shape's GPU run; a preset: its working set / --working-set)")
    p.add_argument("--working-set", type=float, default=2.0,
                   help="the pool's working set as a multiple of the capacity: sizes the "
                        "synthetic pool as serving.py does" + d)
    p.add_argument("--pool", type=int, default=0,
                   help="conversations (default: from --working-set; a preset: its own number)")
    p.add_argument("--requests", type=int, default=2240,
                   help="measured arrivals after the warm-up (10 per conversation of the "
                        "default pool)" + d)
    p.add_argument("--no-warm", action="store_true",
                   help="skip the warm-up turn of every conversation")
    p.add_argument("--rate", type=float, default=30.0,
                   help="Poisson arrivals per second, the GPU run's (matters with --busy-s)" + d)
    p.add_argument("--busy-s", type=float, default=2.0,
                   help="arrival-time seconds a turn keeps its conversation busy: the GPU "
                        "run's time per request (0: each turn ends before the next arrival)" + d)
    p.add_argument("--seed", type=int, default=0, help="tokens, arrivals and picks" + d)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma list of: " + ", ".join(CONFIGS) + d)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--per-request", action="store_true",
                   help="the JSON keeps every request's hit blocks per config")
    return p


def configure(argv: Sequence[str] | None) -> argparse.Namespace:
    p = parser()
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown or not a.configs:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    a.block_bytes = block_bytes_of(a.shape, a.block_tokens)
    if a.workload == SYNTHETIC:
        a.work = Shape(a.first_tokens, a.user_tokens, a.answer_tokens, a.turns)
        a.capacity = a.capacity_blocks or 8 * (1 << 30) // block_bytes_of("1b", 16)
        ws_tokens = a.working_set * a.capacity * a.block_tokens  # serving_sizing's rule
        a.pool = a.pool or max(1, math.ceil(ws_tokens / a.work.mean_held()))
    else:
        a.work = preset(a.workload, a.pool)
        a.pool = a.work.conversations
        ws_blocks = a.work.working_set_tokens(a.pool) / a.block_tokens
        a.capacity = a.capacity_blocks or max(1, int(ws_blocks / a.working_set))
    if a.capacity < 1 or a.requests < 0 or a.busy_s < 0 or a.rate <= 0:
        p.error("--capacity-blocks >= 1, --requests >= 0, --busy-s >= 0, --rate > 0")
    return a


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Build the stream, replay every configuration, return the result (JSON-able)."""
    vllm_info = None
    if any(CONFIGS[c][0] == "native" for c in a.configs):
        vllm_info = load_native()
    began = time.perf_counter()
    stream = build_stream(a.work, a.pool, a.requests, a.seed, VOCAB[a.shape], a.block_tokens,
                          rate=a.rate, busy_s=a.busy_s, warm=not a.no_warm)
    stream_s = time.perf_counter() - began
    measured = [t for t in stream if t.measured]
    rows, per_request = [], {}
    for c in a.configs:
        tally, hits, prompt_only = replay(stream, c, a.capacity, a.block_bytes, a.block_tokens)
        per_request[c] = hits
        rows.append(dict(config=c, label=LABELS[c], connector=CONFIGS[c][0],
                         offload_prompt_only=prompt_only, finish_rank=CONFIGS[c][2],
                         **asdict(tally)))
    base = next((r for r in rows if r["config"] == "native"), None)
    native = {r["offload_prompt_only"]: r["config"] for r in rows if r["connector"] == "native"}
    for r in rows:
        r["vs_native"] = (round(r["hit_blocks"] / base["hit_blocks"], 4)
                          if base and base["hit_blocks"] else None)
        # requests whose hit differs from native's with the same prompt-only setting
        twin = native.get(r["offload_prompt_only"])
        r["native_twin"] = twin
        r["requests_unlike_twin"] = (None if twin is None else sum(
            x != y for x, y in zip(per_request[r["config"]], per_request[twin])))
    ceilings = {}
    for name, prompt_only in (("prompt blocks only", True), ("prompt and answer blocks", False)):
        hits = unbounded_hits(stream, prompt_only)
        ceilings[name] = {
            "hit_blocks": sum(h for h, t in zip(hits, stream) if t.measured),
            "hit_tokens": sum(hit_tokens(t, h, a.block_tokens)
                              for h, t in zip(hits, stream) if t.measured)}
    return {
        "command": "python benchmarks/policy_vs_native.py " + " ".join(a.argv),
        "vllm": vllm_info,
        "workload": a.work.describe(), "pool": a.pool, "shape": a.shape,
        "block_tokens": a.block_tokens, "block_bytes": a.block_bytes,
        "capacity_blocks": a.capacity, "seed": a.seed, "rate": a.rate, "busy_s": a.busy_s,
        "requests": {"warm": len(stream) - len(measured), "measured": len(measured),
                     "distinct_blocks": len({k for t in stream for k in t.keys})},
        "stream_s": round(stream_s, 2),
        "configs": rows, "unbounded": ceilings,
        "per_request_hit_blocks": per_request,
    }


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table; "unlike native" counts the requests whose hit differs
    from native's with the same prompt-only setting."""
    lines = ["| config | hit blocks | hit tokens | vs native | requests unlike native | stored "
             "blocks | answer blocks stored | evicted | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["configs"]:
        ratio = f"{r['vs_native']:.3f}x" if r["vs_native"] is not None else "n/a"
        unlike = ("n/a" if r["native_twin"] is None or r["native_twin"] == r["config"]
                  else f"{r['requests_unlike_twin']:,}")
        lines.append(f"| {r['label']} | {r['hit_blocks']:,} | {r['hit_tokens']:,} | {ratio} | "
                     f"{unlike} | {r['stored_blocks']:,} | {r['stored_answer_blocks']:,} | "
                     f"{r['evicted_blocks']:,} | {r['seconds']:.1f} |")
    for name, c in result["unbounded"].items():
        lines.append(f"| unbounded capacity, {name} | {c['hit_blocks']:,} | "
                     f"{c['hit_tokens']:,} | | | | | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = configure(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    began = time.perf_counter()
    try:
        result = run(a)
    except NativeUnavailable as exc:
        print(f"policy_vs_native: {exc}", file=sys.stderr)
        return 2
    result["runtime_s"] = round(time.perf_counter() - began, 1)
    v = result["vllm"]
    req = result["requests"]
    print(f"vLLM: {v['version']} ({v['path']})" if v else "vLLM: not used (kvtier rows only)")
    print(f"{a.workload}: {a.pool} conversations, {req['warm']} warm-up + {req['measured']} "
          f"measured requests, {req['distinct_blocks']:,} distinct blocks; capacity "
          f"{a.capacity:,} blocks of {a.block_tokens} tokens; {a.rate:g} arrivals/s, a turn "
          f"busy {a.busy_s:g} s; manager calls sequential (each request's stores complete "
          "before the next lookup); GPU prefix cache not modelled\n")
    print(table(result))
    print(f"\nstream {result['stream_s']:.1f} s, total {result['runtime_s']:.1f} s")
    if a.json:
        if not a.per_request:
            result.pop("per_request_hit_blocks")
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
