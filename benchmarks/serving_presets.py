"""The published multi-turn workloads KV-cache tiers are compared on, as ``serving.py``
workloads (``--workload NAME``).

Why: LMCache, SGLang HiCache and vLLM's own blog report their gains on these shapes, so a
kvtier result on the same shapes can be read beside theirs. Each preset keeps the published
lengths; what differs from the original scripts is said here and in docs/benchmarks.md:

* ``vllm-multiturn``: vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` with
  its ``generate_multi_turn.json``: 24 conversations; 12-18 turns (uniform), where vLLM counts
  a user prompt and its answer as two turns (rounded up to even), so 6-9 requests; a 500-token
  prefix common to ALL conversations; a per-conversation prefix from vLLM's lognormal of
  average 1,000 (median 0.85x the average, so sigma = sqrt(2 ln(1/0.85)) = 0.57), clipped to
  5,000 (vLLM also rescales each batch of draws to the average; here every conversation draws
  alone, so the mean is 1,000 in expectation); user turns of 120-160 tokens and answers of
  80-120 (uniform, per turn). Both prefixes go before the first user turn. vLLM counts the
  first turn's 120-160 tokens with its prefixes in them; here the first turn adds a whole
  user turn after them (up to 160 tokens more, once per conversation).
* ``lmcache-mrqa``: LMCache's ``benchmarks/multi-round-qa/multi-round-qa.py`` as its README
  runs it: 10 users (``--pool``), a 1,000-token system prompt shared by every user, 2,000
  tokens of history per user, then a question per round and 100-token answers; 5 rounds
  (``--rounds``). Its question is one fixed sentence ("Here's question #N: can you tell me a
  new long story with a happy ending?"), about 20 tokens, so 20 here.
* ``lmcache-mrqa-long``: the same with 20,000 tokens of history per user, at 0.1 QPS
  (production-stack's long-input runs sweep 0.1-4.1 QPS from 0.1).

Both LMCache presets space a user's rounds evenly (num_users / qps seconds); here arrivals
stay Poisson at the rate, each the next turn of an idle conversation, so the mean gap per user
is the same. Token ids are random, seeded by ``--seed`` and the conversation's serial number;
a shared prefix is one seeded draw, the same ids in every conversation (a real shared prefix).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from functools import lru_cache

from serving_workload import ANSWERS, seed_of
from vllm_e2e_engine import tokens

PLAN = 2 * ANSWERS  # seed stream of a conversation's lengths
SHARED = 3 * ANSWERS  # seed stream (of conversation 0) of the prefix every conversation shares
PREFIX = 4 * ANSWERS  # seed stream of a conversation's own prefix
MEDIAN_RATIO = 0.85  # vLLM's lognormal: median / average when only the average is given
MEAN_SAMPLES = 4000  # conversations drawn to average a preset's working set


@dataclass(frozen=True)
class Plan:
    """One conversation's lengths: its turns, its own prefix, each turn's user tokens and
    answer tokens."""
    turns: int
    prefix: int
    user: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # the script it reproduces
    conversations: int  # the pool: vLLM's num_conversations, LMCache's --num-users
    turns: tuple[int, int]  # drawn uniformly per conversation (inclusive)
    turns_are_messages: bool  # vLLM: a prompt and its answer are two turns, rounded up to even
    shared: int  # tokens every conversation's first prompt starts with
    prefix: int  # a conversation's own prefix: the lognormal's average, or the constant
    prefix_max: int  # 0: the prefix is the constant ``prefix``
    user: tuple[int, int]  # user tokens per turn, uniform (inclusive)
    answer: tuple[int, int]  # answer tokens per turn, uniform (inclusive)
    rates: str  # default --rates (requests/s): the published rate first when there is one
    min_requests: int  # default --min-requests: each rate lasts long enough for these

    # ------------------------------------------------------------ lengths
    def plan(self, serial: int, seed: int) -> Plan:
        return _plan(self, serial, seed)

    def draw_plan(self, serial: int, seed: int) -> Plan:
        rng = random.Random(seed_of(seed, serial, PLAN))
        n = rng.randint(*self.turns)
        if self.turns_are_messages:
            n = (n + n % 2) // 2
        prefix = self.prefix
        if self.prefix_max:
            sigma = math.sqrt(2 * math.log(1 / MEDIAN_RATIO))
            x = rng.lognormvariate(math.log(MEDIAN_RATIO * self.prefix), sigma)
            prefix = min(max(round(x), 1), self.prefix_max)
        return Plan(n, prefix, tuple(rng.randint(*self.user) for _ in range(n)),
                    tuple(rng.randint(*self.answer) for _ in range(n)))

    def turn_range(self) -> tuple[int, int]:
        low, high = self.turns
        if self.turns_are_messages:
            return (low + low % 2) // 2, (high + high % 2) // 2
        return low, high

    def max_len(self) -> int:
        """The longest sequence a conversation can reach (its last prompt and answer)."""
        prefix = self.prefix_max or self.prefix
        return self.shared + prefix + self.turn_range()[1] * (self.user[1] + self.answer[1])

    def held(self, plan: Plan) -> list[int]:
        """Tokens the conversation holds after each turn but its last (prompt and answer),
        its shared prefix left out."""
        out, n = [], plan.prefix
        for k in range(plan.turns - 1):
            n += plan.user[k] + plan.answer[k]
            out.append(n)
        return out

    def mean_held(self) -> float:
        """Tokens a conversation holds for its next turn beyond the shared prefix, averaged
        over the pool's steady state: a conversation of T turns fills its slot for T turns,
        so it is the held tokens summed over conversations over their turns summed."""
        return _mean_held(self)

    def working_set_tokens(self, pool: int) -> float:
        """The pool's steady-state working set: the shared prefix once, then each
        conversation's own."""
        return self.shared + pool * self.mean_held()

    # ------------------------------------------------------------ what the pool sends
    def turns_of(self, serial: int, seed: int) -> int:
        return self.plan(serial, seed).turns

    def shared_prefix(self, seed: int, vocab: int) -> list[int]:
        return tokens(self.shared, seed=seed_of(seed, 0, SHARED), vocab=vocab)

    def first_prompt(self, serial: int, seed: int, vocab: int) -> list[int]:
        own = tokens(self.plan(serial, seed).prefix, seed=seed_of(seed, serial, PREFIX),
                     vocab=vocab)
        return self.shared_prefix(seed, vocab) + own + self.user_tokens(serial, 0, seed, vocab)

    def user_tokens(self, serial: int, turn: int, seed: int, vocab: int) -> list[int]:
        return tokens(self.plan(serial, seed).user[turn], seed=seed_of(seed, serial, turn),
                      vocab=vocab)

    def answer_len(self, serial: int, turn: int, seed: int) -> int:
        return self.plan(serial, seed).answer[turn]

    def describe(self) -> dict:
        """The parameters a result records; ``summary`` is the report's sentence."""
        low, high = self.turn_range()
        turns = f"{low}-{high}" if low != high else f"{low}"
        if self.turns_are_messages:
            turns += f" requests ({self.turns[0]}-{self.turns[1]} turns, vLLM's count)"
        else:
            turns += " rounds"
        prefix = (f"own prefix lognormal, average {self.prefix}, max {self.prefix_max}"
                  if self.prefix_max else f"own history {self.prefix}")
        summary = (f"`{self.name}` ({self.source}): {self.conversations} conversations x "
                   f"{turns}; shared prefix {self.shared}, {prefix}, user turns "
                   f"{_span(self.user)}, answers {_span(self.answer)} tokens")
        return {"name": self.name, "source": self.source, "conversations": self.conversations,
                "turns": list(self.turn_range()), "shared": self.shared, "prefix": self.prefix,
                "prefix_max": self.prefix_max, "user": list(self.user),
                "answer": list(self.answer), "summary": summary}


def _span(r: tuple[int, int]) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"


@lru_cache(maxsize=8192)
def _plan(preset: Preset, serial: int, seed: int) -> Plan:
    return preset.draw_plan(serial, seed)


@lru_cache(maxsize=64)
def _mean_held(preset: Preset) -> float:
    held = turns = 0
    for serial in range(MEAN_SAMPLES):  # its own seed: the sizing does not move with --seed
        plan = preset.draw_plan(serial, seed=-1)
        held += sum(preset.held(plan))
        turns += plan.turns
    return held / turns


VLLM = "vLLM benchmarks/multi_turn/benchmark_serving_multi_turn.py"
LMCACHE = "LMCache benchmarks/multi-round-qa/multi-round-qa.py"
PRESETS = {
    "vllm-multiturn": Preset(
        "vllm-multiturn", VLLM, conversations=24, turns=(12, 18), turns_are_messages=True,
        shared=500, prefix=1000, prefix_max=5000, user=(120, 160), answer=(80, 120),
        rates="1,2,4,8,16", min_requests=40),
    "lmcache-mrqa": Preset(
        "lmcache-mrqa", LMCACHE, conversations=10, turns=(5, 5), turns_are_messages=False,
        shared=1000, prefix=2000, prefix_max=0, user=(20, 20), answer=(100, 100),
        rates="0.5,1,2,4,8", min_requests=40),
    "lmcache-mrqa-long": Preset(
        "lmcache-mrqa-long", LMCACHE + " (long input)", conversations=10, turns=(5, 5),
        turns_are_messages=False, shared=1000, prefix=20000, prefix_max=0, user=(20, 20),
        answer=(100, 100), rates="0.1,0.5,1,2,4", min_requests=30),
}
LMCACHE_PRESETS = ("lmcache-mrqa", "lmcache-mrqa-long")


def preset(name: str, conversations: int = 0, rounds: int = 0) -> Preset:
    """``name``'s preset, with LMCache's --num-users (``conversations``) and --num-rounds
    (``rounds``) changed where given."""
    p = PRESETS[name]
    if conversations:
        p = replace(p, conversations=conversations)
    if rounds:
        p = replace(p, turns=(rounds, rounds))
    return p
