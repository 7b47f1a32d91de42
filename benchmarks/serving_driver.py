"""Drives a ``serving_workload.Pool`` against a server: one thread per request, sent at its
Poisson arrival, streamed to the end.

Why threads and the standard library: each request is one streamed HTTP connection, as a chat
front end holds one per user; what is measured is the server, so the client stays simple and
its own lateness is recorded (``Record.sent_ms - scheduled_ms``) rather than assumed away.

A window sends for ``duration_s`` seconds, then waits up to ``drain_s`` for the requests still
streaming and closes the connections of those that are not done (vLLM aborts them), so a
saturated server's backlog does not spill into the next rate. A failed request is recorded
with its error, never dropped.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from serve_client import Cancel, Cancelled, complete
from serving_stats import Record
from serving_workload import Pool, arrivals


class Window:
    """One rate's requests: ``records`` and the pool's working set (tokens) at each send."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.live_tokens: list[int] = []
        self.unsent = 0  # arrivals that found no idle conversation before the window ended
        self.lock = threading.Lock()


def run_window(url: str, model: str, pool: Pool, rate: float, duration_s: float,
               drain_s: float, seed: int) -> Window:
    rng = random.Random(seed)
    schedule = arrivals(rate, duration_s, seed)
    win, cancel, threads = Window(), Cancel(), []
    t0 = time.perf_counter()
    for at in schedule:
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        left = t0 + duration_s - time.perf_counter()
        taken = pool.take(rng, timeout=max(left, 0.0))
        if taken is None:  # every conversation busy until the window ended
            win.unsent += 1
            continue
        conv, prompt = taken
        rec = Record(conv.serial, conv.turn, len(prompt), at * 1e3, 0.0)
        with win.lock:
            win.records.append(rec)
            win.live_tokens.append(pool.live_tokens())
        th = threading.Thread(target=_one, args=(url, model, pool, conv, prompt, rec, cancel, t0),
                              daemon=True)
        rec.sent_ms = (time.perf_counter() - t0) * 1e3
        th.start()
        threads.append(th)
    deadline = t0 + duration_s + drain_s
    for th in threads:
        th.join(max(deadline - time.perf_counter(), 0.0))
    cancel.cancel()
    for th in threads:
        th.join(60.0)
        if th.is_alive():
            raise RuntimeError(f"{url}: a request thread did not end 60 s after its connection "
                               "was closed")
    return win


def _one(url: str, model: str, pool: Pool, conv, prompt: list[int], rec: Record,
         cancel: Cancel, t0: float) -> None:
    try:
        done = complete(url, model, prompt, max_tokens=pool.answer_len(conv), logprobs=False,
                        cancel=cancel)
    except Cancelled as exc:
        rec.cut, rec.ttft_ms, rec.token_ms = True, exc.partial.ttft_ms, exc.partial.token_ms
        pool.fail(conv)
    except Exception as exc:  # noqa: BLE001 - recorded with the request and reported
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
        pool.fail(conv)
    else:
        rec.ttft_ms, rec.token_ms = done.ttft_ms, done.token_ms
        rec.cached_tokens = done.cached_tokens
        pool.finish(conv, prompt, done.token_ids)
    finally:
        rec.end_ms = (time.perf_counter() - t0) * 1e3


def warm(url: str, model: str, pool: Pool, concurrency: int) -> float:
    """Every conversation's current turn once, ``concurrency`` at a time, unmeasured: the
    caches hold the pool's histories before the first window. Raises on the first failure."""
    t0 = time.perf_counter()

    def one(index: int) -> None:
        conv, prompt = pool.claim(index)
        try:
            done = complete(url, model, prompt, max_tokens=pool.answer_len(conv), logprobs=False)
        except BaseException:
            pool.fail(conv)
            raise
        pool.finish(conv, prompt, done.token_ids)

    with ThreadPoolExecutor(max(1, min(concurrency, len(pool.convs)))) as ex:
        for fut in [ex.submit(one, i) for i in range(len(pool.convs))]:
            fut.result()
    return time.perf_counter() - t0
