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


@dataclass(frozen=True)
class Shape:
    first: int  # turn 0's prompt tokens
    user: int  # new user tokens per later turn
    answer: int  # tokens the server generates per turn (max_tokens, ignore_eos)
    turns: int  # turns before a conversation retires

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
    turn: int = 0  # the turn it sends next
    history: list[int] = field(default_factory=list)  # last prompt + answer (empty at turn 0)
    busy: bool = False


class Pool:
    """``size`` conversations; ``take`` hands out an idle one with its next prompt, ``finish``
    takes back the server's answer (``fail``: a turn without one: the conversation retires).
    Thread-safe; ``take`` waits while every conversation is busy."""

    def __init__(self, size: int, shape: Shape, vocab: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"the pool needs at least one conversation, got {size}")
        self.shape, self.vocab, self.seed = shape, vocab, seed
        if not 2 <= shape.turns < ANSWERS:
            raise ValueError(f"2 to {ANSWERS - 1} turns (one turn reuses nothing), got "
                             f"{shape.turns}")
        # started at every turn alike, so the pool holds its steady-state mean context at once
        self.convs = [Conversation(i, turn=i % shape.turns) for i in range(size)]
        self._next_serial = size
        self._cond = threading.Condition()

    def prompt(self, conv: Conversation) -> list[int]:
        if conv.history:
            return conv.history + self._user(conv.serial, conv.turn)
        out = tokens(self.shape.first, seed=self._seed(conv.serial, 0), vocab=self.vocab)
        for k in range(1, conv.turn + 1):  # a conversation the pool starts part-way: its past
            out += tokens(self.shape.answer, seed=self._seed(conv.serial, ANSWERS + k),
                          vocab=self.vocab)  # answers are made up
            out += self._user(conv.serial, k)
        return out

    def _user(self, serial: int, turn: int) -> list[int]:
        return tokens(self.shape.user, seed=self._seed(serial, turn), vocab=self.vocab)

    def _seed(self, serial: int, turn: int) -> int:
        return (self.seed * 1_000_003 + serial) * 1009 + turn

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
            if conv.turn >= self.shape.turns:
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

    def live_tokens(self) -> int:
        """Tokens the pool's conversations hold for their next turns (the working set)."""
        with self._cond:
            return sum(len(c.history) for c in self.convs)
