"""``vllm_serve.py --vllm-marks`` without vLLM: the import-time patching its servers load from
``benchmarks/diagnostics/serve_marks/sitecustomize.py``, and ``serve_phases.py``'s milestones of
a request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import serve_phases
import vllm_marks
from kvtier.observe import timeline as timeline_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE = textwrap.dedent('''
    class Thing:
        def run(self, x):
            return x + 1

        @staticmethod
        def send(a, b):
            return a * b

        @classmethod
        def make(cls, v):
            return (cls.__name__, v)
''')


@pytest.fixture
def marks(tmp_path, monkeypatch):
    path = tmp_path / "tl.jsonl"
    monkeypatch.setattr(timeline_mod, "_timeline", timeline_mod.Timeline(str(path)))

    def read():
        timeline_mod._timeline.flush()
        return [json.loads(line) for line in path.read_text().splitlines()]
    return read


def test_phases_are_wrapped_when_their_module_is_first_imported(tmp_path, monkeypatch, marks):
    (tmp_path / "kvtier_fake_phases.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    phases = [("kvtier_fake_phases", "Thing", n) for n in ("run", "send", "make")]
    finder = vllm_marks._PatchOnImport(phases)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    sys.modules.pop("kvtier_fake_phases", None)
    import kvtier_fake_phases as fake

    try:
        # a static method stays static and a class method gets its class: vLLM's engine core
        # calls _send_msg_tracking_payload on the class, and a plain wrapper broke it
        assert fake.Thing().run(1) == 2
        assert fake.Thing.send(3, 4) == 12 and fake.Thing().send(2, 5) == 10
        assert fake.Thing.make(7) == ("Thing", 7)
        assert not finder.pending  # each module is patched once
        evs = [(m["ev"], "tid" in m) for m in marks()]
        for name in ("Thing.run", "Thing.send", "Thing.make"):
            assert (name + ">", True) in evs and (name + "<", True) in evs
        # patching again (vllm_e2e_child's install after an import hook) does not nest marks
        assert vllm_marks._patch(fake, phases) == []
    finally:
        sys.modules.pop("kvtier_fake_phases", None)


@pytest.mark.parametrize("timeline_on", [True, False])
def test_sitecustomize_installs_the_hook_only_with_a_timeline(tmp_path, timeline_on):
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_TIMELINE"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "benchmarks", "diagnostics", "serve_marks"), ROOT])
    if timeline_on:
        env["KVTIER_TIMELINE"] = str(tmp_path / "tl.jsonl")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print([type(f).__name__ for f in sys.meta_path])"],
        env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert ("_PatchOnImport" in out) == timeline_on


def _mark(t, pid, ev, who="vllm", **kw):
    return json.dumps({"t": t, "pid": pid, "who": who, "ev": ev, **kw})


def test_serve_phases_finds_each_milestone_of_a_request(tmp_path):
    engine, api, client = 20, 10, 1
    ms = 1e-3
    lines = [
        _mark(100.0, client, "client_submit", who="client", config="kvtier", length=64,
              kind="hit", rep=0),
        _mark(100 + 2 * ms, engine, "MsgpackDecoder.decode<", tid=21),
        _mark(100 + 3 * ms, engine, "EngineCoreProc._handle_client_request>", tid=20),
        _mark(100 + 3.5 * ms, engine, "Scheduler.schedule>", tid=20),
        _mark(100 + 4 * ms, engine, "Scheduler.schedule<", tid=20),
        _mark(100 + 4.2 * ms, engine, "GPUModelRunner.execute_model>", tid=20, cpu=7.0),
        _mark(100 + 4.8 * ms, engine, "GPUModelRunner.execute_model<", tid=20, cpu=7.0005),
        _mark(100 + 5 * ms, engine, "Scheduler.schedule>", tid=20),
        _mark(100 + 9 * ms, engine, "Scheduler.update_from_output<", tid=20),
        _mark(100 + 10 * ms, engine, "MsgpackEncoder.encode_into>", tid=22),
        _mark(100 + 11 * ms, engine, "EngineCoreProc._send_msg_tracking_payload<", tid=22),
        _mark(100 + 12 * ms, api, "OutputProcessor.process_outputs>"),
        _mark(100 + 13 * ms, api, "OutputProcessor.process_outputs<"),
        _mark(100 + 14 * ms, client, "client_token", who="client", config="kvtier", length=64,
              kind="hit", rep=0),
        # the next server's processes, later: not this request's
        _mark(200.0, 30, "Scheduler.schedule>"),
        _mark(200.1, 40, "OutputProcessor.process_outputs>"),
    ]
    path = tmp_path / "tl.jsonl"
    path.write_text("\n".join(lines) + "\n")
    [(key, got)] = serve_phases.requests(str(path))
    assert key == ("kvtier", 64, "hit")
    want = {"decoded": 2, "taken": 3, "scheduled": 3.5, "updated": 9, "encode": 10, "sent": 11,
            "api_out": 13, "token": 14, "steps": 2, "exec_cpu": 0.5}
    assert {k: round(v, 6) for k, v in got.items()} == want
    table = serve_phases.table(str(path))
    assert table[2] == ("| kvtier | 64 | hit | 1 | 2.00 | 3.00 | 3.50 | 9.00 | 10.00 | 11.00 | "
                        "13.00 | 14.00 | 2.00 | 0.50 |")
