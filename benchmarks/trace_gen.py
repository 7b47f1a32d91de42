"""Synthetic request traces of known shapes, deterministic by seed (Mooncake jsonl format).

A policy tuned to one trace proves little; these shapes stress different things:

- ``zipf``: popular system prompts (Zipf-distributed) followed by a short unique user part.
  Frequency matters; tails are never reused.
- ``chat``: multi-turn conversations, many open at once; each turn resends the whole history
  plus a new message, so the previous turn's full blocks are reused and the prefix grows.
  Recency matters; the partial last block of a turn is never reused.
- ``docs``: one-off long documents (a scan that should not flush the cache) mixed with a few
  documents that are questioned repeatedly.
- ``mixed``: the three interleaved.
- ``multiturn``: conversations that arrive one after another; about half send another turn,
  after a think time spread over several orders of magnitude (seconds to an hour), so the
  reuse distance is long and most blocks are written once and never read. The shape of real
  chat-serving traces where the cache is "nearly big enough" at tens of thousands of blocks;
  requests carry ``session`` and ``continues`` (what a router knows).

Ids are prefix hashes like Mooncake's: a block id is allocated when new content extends a
prefix, and the same prefix always yields the same ids.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: kvtier too

from kvtier.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest  # noqa: E402

SHAPES = ("zipf", "chat", "docs", "mixed", "multiturn")


class _Ids:
    """Allocates fresh block ids (a new prefix always gets new ids)."""

    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(ts: float, blocks: list[int], last_tokens: int, output: int = 64) -> TraceRequest:
    """``last_tokens`` in 1..512: how full the last block is."""
    n_in = TRACE_BLOCK_TOKENS * (len(blocks) - 1) + last_tokens
    return TraceRequest(float(ts), n_in, output, tuple(blocks))


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)

    def sample() -> int:
        x = rng.random() * acc
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cum[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo

    return sample


def gen_zipf(
    n_requests: int, seed: int, ids: _Ids | None = None, prompts: int = 400, s: float = 1.0
):
    """Shared system prompts of 4..48 blocks picked by Zipf(s), then 1..6 unique blocks."""
    rng = random.Random(seed)
    ids = ids or _Ids()
    system = [ids.fresh(rng.randint(4, 48)) for _ in range(prompts)]
    pick = _zipf_sampler(rng, prompts, s)
    ts = 0.0
    for _ in range(n_requests):
        ts += rng.expovariate(1 / 50)
        own = ids.fresh(rng.randint(1, 6))
        yield _request(ts, system[pick()] + own, rng.randint(1, TRACE_BLOCK_TOKENS))


def gen_chat(n_requests: int, seed: int, ids: _Ids | None = None, open_sessions: int = 120):
    """Conversations of 2..30 turns; a turn adds 1..6 blocks of answer + question. The next turn
    reuses every full block of the previous one (its partial last block is rewritten)."""
    rng = random.Random(seed)
    ids = ids or _Ids()
    sessions: list[list] = []  # [full blocks so far, turns left]
    ts = 0.0
    for _ in range(n_requests):
        ts += rng.expovariate(1 / 50)
        if len(sessions) < open_sessions and (not sessions or rng.random() < 0.3):
            sessions.append([ids.fresh(rng.randint(2, 12)), rng.randint(2, 30)])
        # Recently active conversations are more likely to speak next (think times vary).
        back = int(rng.expovariate(3 / len(sessions)))
        i = len(sessions) - 1 - min(back, len(sessions) - 1)
        full, left = sessions[i]
        partial = ids.fresh(1)
        yield _request(ts, full + partial, rng.randint(1, TRACE_BLOCK_TOKENS - 1))
        full = full + ids.fresh(rng.randint(1, 6))  # answer + next question, full blocks
        if left <= 1:
            sessions.pop(i)
        else:
            sessions[i] = [full, left - 1]
            sessions.append(sessions.pop(i))  # most recently active last


def gen_docs(n_requests: int, seed: int, ids: _Ids | None = None, hot_docs: int = 30):
    """70 % one-off documents of 20..200 blocks; 30 % questions on a few hot documents."""
    rng = random.Random(seed)
    ids = ids or _Ids()
    hot = [ids.fresh(rng.randint(10, 80)) for _ in range(hot_docs)]
    pick = _zipf_sampler(rng, hot_docs, 0.8)
    ts = 0.0
    for _ in range(n_requests):
        ts += rng.expovariate(1 / 50)
        if rng.random() < 0.7:
            blocks = ids.fresh(rng.randint(20, 200))
        else:
            blocks = hot[pick()] + ids.fresh(rng.randint(1, 3))
        yield _request(ts, blocks, rng.randint(1, TRACE_BLOCK_TOKENS))


def gen_mixed(n_requests: int, seed: int):
    """The three shapes interleaved (own id spaces, one clock)."""
    ids = _Ids()
    rng = random.Random(seed)
    gens = [gen_zipf(n_requests, seed + 1, ids), gen_chat(n_requests, seed + 2, ids),
            gen_docs(n_requests, seed + 3, ids)]
    ts = 0.0
    for _ in range(n_requests):
        ts += rng.expovariate(1 / 50)
        r = next(gens[rng.choices((0, 1, 2), weights=(4, 4, 2))[0]])
        yield TraceRequest(ts, r.input_length, r.output_length, r.hash_ids)


def gen_multiturn(n_requests: int, seed: int, ids: _Ids | None = None, continue_p: float = 0.5,
                  think_median: float = 400.0, think_sigma: float = 1.6, system_prompts: int = 24,
                  burn_in: int = 4000):
    """New conversations arrive at one per time unit; a conversation opens with a short shared
    system prompt (Zipf over ``system_prompts``) and 4..40 blocks of its own, and after each turn
    continues with probability ``continue_p`` after a log-normal think time (median
    ``think_median`` units, so a continuation returns hundreds to tens of thousands of requests
    later). A turn resends the history and adds 1..8 blocks; its partial last block is fresh.
    The first ``burn_in`` requests are not emitted: a real trace is a window of a service in
    steady state, not its first minutes (when no conversation has come back yet)."""
    import heapq
    import math

    rng = random.Random(seed)
    ids = ids or _Ids()
    system = [ids.fresh(rng.randint(2, 8)) for _ in range(system_prompts)]
    pick = _zipf_sampler(rng, system_prompts, 1.1)
    due: list = []  # (time, session, full blocks so far)
    t_new, session = 0.0, 0
    for n in range(burn_in + n_requests):
        if due and due[0][0] <= t_new:
            ts, sid, full = heapq.heappop(due)
        else:
            ts, sid = t_new, session
            session += 1
            t_new += rng.expovariate(1.0)
            full = system[pick()] + ids.fresh(rng.randint(4, 40))
        again = rng.random() < continue_p
        if n >= burn_in:
            yield TraceRequest(float(ts), TRACE_BLOCK_TOKENS * len(full) + rng.randint(1, 511), 64,
                               tuple(full + ids.fresh(1)), session=sid, continues=again)
        if again:
            think = think_median * math.exp(rng.gauss(0.0, think_sigma))
            heapq.heappush(due, (ts + think, sid, full + ids.fresh(rng.randint(1, 8))))


def generate(shape: str, n_requests: int = 4000, seed: int = 0) -> list[TraceRequest]:
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    makers = {"zipf": gen_zipf, "chat": gen_chat, "docs": gen_docs, "mixed": gen_mixed,
              "multiturn": gen_multiturn}
    try:
        maker = makers[shape]
    except KeyError:
        raise ValueError(f"unknown trace shape {shape!r}; allowed: {', '.join(SHAPES)}") from None
    return list(maker(n_requests, seed))


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            line = {"timestamp": round(r.timestamp, 3), "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            if r.continues is not None:  # what ``kvtier bench --compare``'s +hints reads
                line["continues"] = r.continues
            f.write(json.dumps(line))
            f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a synthetic Mooncake-format trace.")
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("out", help="output .jsonl path")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_trace(generate(args.shape, args.requests, args.seed), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
