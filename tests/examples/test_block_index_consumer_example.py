"""examples/block_index_consumer.py, run as a user runs it, against a running kvtier instance
(a trace replay with its event stream on, in another process): the index it prints holds
exactly the blocks the instance holds, per tier, and the hits it served."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

from example_run import EXAMPLES, ROOT

INSTANCE = textwrap.dedent("""
    import json, sys
    from kvtier.bench.replay import Replay
    from kvtier.bench.trace import load_trace
    from kvtier.config import load_config
    from kvtier.observe.events import resident_blocks

    replay = Replay(load_config(sys.argv[1]), 16 * 1024, 256)
    replay.run(load_trace(None, 60))
    replay.events.pump()
    assert replay.events.publisher.flush()
    pub = replay.events.publisher
    names = {"CPU": "CPU", "DISK": "STORAGE"}
    resident = {names[m.value]: len(keys) for m, keys in resident_blocks(replay.manager).items()
                if keys}
    hits = {names[t]: n for t, n in replay.report()["manager"]["hit_blocks"].items() if n}
    print(json.dumps({"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                      "resident": resident, "hits": hits}), flush=True)
    sys.stdin.read()  # serve until the test closes stdin
    replay.close()
""")


def ctrl_c_as_in_a_terminal() -> None:
    """The consumer's Ctrl-C as a user's terminal delivers it. A test run started in the
    background of a shell without job control inherits SIGINT ignored, and so did the
    consumer: it never saw the test's SIGINT and the wait below timed out."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_consumer_rebuilds_what_the_instance_holds(tmp_path):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(textwrap.dedent(f"""
        tiers:
          cpu: {{capacity: 1MiB}}
          disk: {{path: {tmp_path / 'disk'}, capacity: 8MiB}}
        events: {{endpoint: "tcp://127.0.0.1:0", replay_endpoint: "tcp://127.0.0.1:0"}}
    """))
    script = tmp_path / "instance.py"
    script.write_text(INSTANCE)
    instance = subprocess.Popen([sys.executable, str(script), str(cfg)], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    consumer = None
    try:
        ready = json.loads(instance.stdout.readline())
        assert ready["resident"].get("CPU") and ready["resident"].get("STORAGE"), ready
        consumer = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "block_index_consumer.py"), "--endpoint",
             ready["endpoint"], "--replay-endpoint", ready["replay_endpoint"], "--every", "0.5"],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=ctrl_c_as_in_a_terminal)
        want_blocks = ", ".join(f"{t} {n}" for t, n in sorted(ready["resident"].items()))
        want_hits = ", ".join(f"{t} {n}" for t, n in sorted(ready["hits"].items()))
        deadline, seen = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            line = consumer.stdout.readline()
            assert line, consumer.stderr.read()
            seen.append(line.strip())
            if f"blocks {want_blocks}; hits {want_hits}" in line:
                break
        else:
            raise AssertionError(f"wanted blocks {want_blocks}; hits {want_hits}; saw {seen}")
        assert re.match(r"seq \d+: ", seen[-1]) and "stale" not in seen[-1], seen
    finally:
        if consumer is not None:
            consumer.send_signal(signal.SIGINT)  # its documented way out (Ctrl-C)
            assert consumer.wait(timeout=30) == 0, consumer.stderr.read()
        instance.stdin.close()
        instance.wait(timeout=60)
