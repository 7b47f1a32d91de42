"""The multi-turn chat load ``serving.py`` offers a server: a pool of conversations and Poisson
request arrivals.

Why a fixed pool: a conversation's next turn is a hit only if its history is still cached
somewhere, and what has to stay cached is every conversation that will speak again. With a
pool of ``size`` conversations that is the pool's histories, whatever the arrival rate, so "a
working set twice the CPU tier" is a property of the configuration and holds at every rate of
a sweep (with new conversations arriving at R per second and living a fixed time, the live
set would grow with R instead).

* A **conversation**'s turn k sends its history (turn k-1's prompt plus the tokens the server
  answered) followed by new user tokens; turn 0 sends its first prompt (a system prompt and a
  document: ``first`` tokens). After ``turns`` turns it retires and a new conversation (new
  tokens) takes its place, so the pool's size and mean context stay fixed. The first pool
  starts its conversations at every turn alike (their earlier answers made up), at that mean
  from the start. Token ids are
  random, seeded by the conversation's serial number: every configuration gets the same
  conversations.
* **What a conversation sends** comes from its workload: ``Shape`` (fixed lengths, the
  default) or a published preset (``serving_presets.py``: lengths drawn per conversation and
  turn, a prefix every conversation shares). The ``Pool`` asks the workload, never assumes.
* **Arrivals** are a Poisson process of ``rate`` requests per second (seeded): each arrival is
  the next turn of an idle conversation (one whose previous turn has finished), picked at
  random, so the time a conversation waits between turns (its user's think time) is random
  too, about ``size / rate`` seconds on average.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from vllm_e2e_engine import tokens


ANSWERS = 1000  # seed offset of the made-up answers of a conversation started part-way


def seed_of(seed: int, serial: int, stream: int) -> int:
    """The seed of one draw of conversation ``serial``: ``stream`` is its turn (a user turn's
    tokens), ``ANSWERS + turn`` (a made-up answer) or a workload's own stream above those."""
    return (seed * 1_000_003 + serial) * 1009 + stream


@dataclass(frozen=True)
class Shape:
    """The default workload: every conversation alike, no prefix shared between them."""
    first: int  # turn 0's prompt tokens
    user: int  # new user tokens per later turn
    answer: int  # tokens the server generates per turn (max_tokens, ignore_eos)
    turns: int  # turns before a conversation retires

    name = "synthetic"
    shared = 0  # tokens every conversation's first prompt starts with

    def prompt_len(self, turn: int) -> int:
        return self.first + turn * (self.answer + self.user)

    def max_len(self) -> int:
        """The longest sequence a conversation reaches (its last prompt and answer)."""
        return self.prompt_len(self.turns - 1) + self.answer

    def mean_held(self) -> float:
        """Tokens a conversation holds for its next turn (its last prompt and answer; none
        before turn 0), averaged over the turns it can be at: the pool's working set per
        conversation in steady state, where every turn is equally likely."""
        return sum(self.prompt_len(k) + self.answer for k in range(self.turns - 1)) / self.turns

    def working_set_tokens(self, pool: int) -> float:
        return pool * self.mean_held()

    def turn_range(self) -> tuple[int, int]:
        return self.turns, self.turns

    def turns_of(self, serial: int, seed: int) -> int:
        return self.turns

    def first_prompt(self, serial: int, seed: int, vocab: int) -> list[int]:
        return tokens(self.first, seed=seed_of(seed, serial, 0), vocab=vocab)

    def user_tokens(self, serial: int, turn: int, seed: int, vocab: int) -> list[int]:
        return tokens(self.user, seed=seed_of(seed, serial, turn), vocab=vocab)

    def answer_len(self, serial: int, turn: int, seed: int) -> int:
        return self.answer

    def describe(self) -> dict:
        """The parameters a result records (the report reads these keys)."""
        return {"name": self.name, "first": self.first, "user": self.user,
                "answer": self.answer, "turns": self.turns}


def arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds) in [0, duration_s): exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


@dataclass
class Conversation:
    serial: int  # which conversation: its tokens' seed
    turns: int  # its turns before it retires (the workload draws them per conversation)
    turn: int = 0  # the turn it sends next
    history: list[int] = field(default_factory=list)  # last prompt + answer (empty at turn 0)
    busy: bool = False


class Pool:
    """``size`` conversations; ``take`` hands out an idle one with its next prompt, ``finish``
    takes back the server's answer (``fail``: a turn without one: the conversation retires).
    Thread-safe; ``take`` waits while every conversation is busy."""

    def __init__(self, size: int, workload, vocab: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"the pool needs at least one conversation, got {size}")
        self.workload, self.vocab, self.seed = workload, vocab, seed
        low, high = workload.turn_range()
        if not (2 <= low and high < ANSWERS):
            raise ValueError(f"2 to {ANSWERS - 1} turns (one turn reuses nothing), got "
                             f"{low}-{high}")
        # started at every turn alike, so the pool holds its steady-state mean context at once
        self.convs = []
        for i in range(size):
            turns = workload.turns_of(i, seed)
            self.convs.append(Conversation(i, turns, turn=i % turns))
        self._next_serial = size
        self._cond = threading.Condition()

    def prompt(self, conv: Conversation) -> list[int]:
        if conv.history:
            return conv.history + self._user(conv.serial, conv.turn)
        w = self.workload
        out = w.first_prompt(conv.serial, self.seed, self.vocab)
        for k in range(1, conv.turn + 1):  # a conversation the pool starts part-way: its past
            n = w.answer_len(conv.serial, k - 1, self.seed)  # answers are made up
            out += tokens(n, seed=seed_of(self.seed, conv.serial, ANSWERS + k), vocab=self.vocab)
            out += self._user(conv.serial, k)
        return out

    def answer_len(self, conv: Conversation) -> int:
        """max_tokens of ``conv``'s next turn (the server generates exactly that many)."""
        return self.workload.answer_len(conv.serial, conv.turn, self.seed)

    def _user(self, serial: int, turn: int) -> list[int]:
        return self.workload.user_tokens(serial, turn, self.seed, self.vocab)

    def take(self, rng: random.Random, timeout: float | None = None
             ) -> tuple[Conversation, list[int]] | None:
        """An idle conversation (a random start, then the next idle one) and its next prompt,
        marked busy; None if none became idle within ``timeout`` seconds."""
        with self._cond:
            start = rng.randrange(len(self.convs))
            if not self._cond.wait_for(lambda: any(not c.busy for c in self.convs), timeout):
                return None
            n = len(self.convs)
            conv = next(self.convs[(start + i) % n] for i in range(n)
                        if not self.convs[(start + i) % n].busy)
            conv.busy = True
        return conv, self.prompt(conv)

    def claim(self, index: int) -> tuple[Conversation, list[int]]:
        """Conversation ``index`` (idle) and its next prompt, marked busy."""
        with self._cond:
            conv = self.convs[index]
            if conv.busy:
                raise RuntimeError(f"conversation {index} is busy")
            conv.busy = True
        return conv, self.prompt(conv)

    def finish(self, conv: Conversation, prompt: list[int], answer: list[int]) -> None:
        with self._cond:
            conv.history, conv.turn = prompt + answer, conv.turn + 1
            if conv.turn >= conv.turns:
                self._retire(conv)
            conv.busy = False
            self._cond.notify()

    def fail(self, conv: Conversation) -> None:
        with self._cond:
            self._retire(conv)
            conv.busy = False
            self._cond.notify()

    def _retire(self, conv: Conversation) -> None:
        conv.serial, self._next_serial = self._next_serial, self._next_serial + 1
        conv.turn, conv.history = 0, []
        conv.turns = self.workload.turns_of(conv.serial, self.seed)

    def live_tokens(self) -> int:
        """Tokens the pool's conversations hold for their next turns (the working set): a
        prefix every conversation shares counts once, as the caches hold it once."""
        shared = self.workload.shared
        with self._cond:
            held = [len(c.history) for c in self.convs if c.history]
        return sum(held) - shared * max(len(held) - 1, 0)
