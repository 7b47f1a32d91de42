"""A stand-in for ``vllm serve``'s streaming completions, for testing the load client's
arithmetic only (TTFT, ITL, goodput, hits, errors): it streams SSE chunks in vLLM's format
(``choices[].token_ids`` with ``return_token_ids``, ``logprobs.tokens`` as ``token_id:N`` with
``return_tokens_as_token_ids``, a final chunk with ``usage``, ``data: [DONE]``) on a schedule
the test chose, so the client's figures can be checked against it. Real-vLLM behaviour is
tested by the CPU smoke (``test_serving_smoke.py``).

Its prefix cache is whole ``--block`` -token blocks of every finished sequence (prompt and
answer): a prompt's cached tokens are its longest stored block prefix, and its first token
comes ``--ttft-ms`` plus ``--ms-per-new-token`` per uncached token after the request, then a
chunk of ``--chunk`` tokens every ``--itl-ms``. ``--fail-every N``: every Nth request's
stream carries an error event instead of tokens. Prints its port on the first line of stdout.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def token_id(prompt_len: int, i: int) -> int:
    return 10 + (prompt_len * 31 + i * 7) % 900


class State:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.lock = threading.Lock()
        self.blocks: set[tuple[int, ...]] = set()
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prompts: list[list[int]] = []

    def cached(self, seq: list[int]) -> int:
        b, n = self.a.block, 0
        with self.lock:
            while n + b <= len(seq) and tuple(seq[:n + b]) in self.blocks:
                n += b
        return n

    def store(self, seq: list[int]) -> None:
        b = self.a.block
        with self.lock:
            for n in range(b, len(seq) + 1, b):
                self.blocks.add(tuple(seq[:n]))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        s = self.state
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/metrics":
            labels = 'engine="0",model_name="m"'
            text = (
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
                "# TYPE vllm:prompt_tokens_total counter\n"
                f"vllm:prompt_tokens_total{{{labels}}} {float(s.prompt_tokens)}\n"
                f"vllm:prompt_tokens_created{{{labels}}} 1.7e9\n"
                f"vllm:prefix_cache_hits_total{{{labels}}} {float(s.cached_tokens)}\n"
                f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="device"}} '
                f"{float(s.cached_tokens)}\n"
                f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="disk"}} 0.0\n')
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/version":  # vLLM's: the release it runs
            self._send(200, json.dumps({"version": "0.0.fake"}).encode(), "application/json")
        elif self.path == "/prompts":
            with s.lock:
                body = json.dumps(s.prompts).encode()
            self._send(200, body, "application/json")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        s, a = self.state, self.state.a
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        t0 = time.perf_counter()
        prompt = body["prompt"]
        with s.lock:
            s.requests += 1
            n = s.requests
            s.prompts.append(prompt)
        if not prompt:
            self._send(400, json.dumps({"error": {"message": "empty prompt"}}).encode(),
                       "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        cached = s.cached(prompt)
        with s.lock:
            s.prompt_tokens += len(prompt)
            s.cached_tokens += cached
        try:
            if a.fail_every and n % a.fail_every == 0:
                self._event({"error": {"message": f"boom {n}", "type": "InternalServerError",
                                       "code": 500}})
                self._done()
                return
            first = t0 + (a.ttft_ms + a.ms_per_new_token * (len(prompt) - cached)) / 1e3
            ids = [token_id(len(prompt), i) for i in range(body["max_tokens"])]
            for k, at in enumerate(range(0, len(ids), a.chunk)):
                time.sleep(max(0.0, first + k * a.itl_ms / 1e3 - time.perf_counter()))
                part = ids[at:at + a.chunk]
                choice = {"index": 0, "text": "", "finish_reason": None}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [f"token_id:{i}" for i in part],
                                          "token_logprobs": [-0.5] * len(part)}
                if body.get("return_token_ids"):
                    choice["token_ids"] = part
                self._event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
            s.store(prompt + ids)
            self._event({"id": "cmpl-1", "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": len(ids),
                "prompt_tokens_details": {"cached_tokens": cached}}})
            self._done()
        except (BrokenPipeError, ConnectionResetError):  # the client went away (cancelled)
            pass

    def _event(self, obj: dict) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _done(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--ms-per-new-token", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--fail-every", type=int, default=0)
    a = p.parse_args()
    Handler.state = State(a)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
