"""``diagnostics/step_phases.py``: vLLM's step phases paired per thread from a timeline."""

from __future__ import annotations

import json

import step_phases


def _write(path, marks):
    with open(path, "w") as f:
        for m in marks:
            f.write(json.dumps(m) + "\n")
        f.write('{"t": 9.9, "who": "vl')  # a line cut by the server's kill


def _span(t, wall, cpu, name="Scheduler.schedule", tid=1):
    return [{"t": t, "pid": 7, "who": "vllm", "ev": name + ">", "cpu": 1.0, "tid": tid},
            {"t": t + wall, "pid": 7, "who": "vllm", "ev": name + "<", "cpu": 1.0 + cpu,
             "tid": tid}]


def test_spans_pair_per_thread_and_keep_only_the_window(tmp_path):
    path = tmp_path / "tl.jsonl"
    marks = (_span(0.0, 0.002, 0.001) + _span(1.0, 0.004, 0.004)
             # two threads' spans interleaved: paired by thread, not by order
             + [{"t": 2.0, "pid": 7, "who": "vllm", "ev": "EngineCore.step>", "cpu": 0, "tid": 1},
                {"t": 2.001, "pid": 7, "who": "vllm", "ev": "EngineCore.step>", "cpu": 0,
                 "tid": 2},
                {"t": 2.003, "pid": 7, "who": "vllm", "ev": "EngineCore.step<", "cpu": 0,
                 "tid": 2},
                {"t": 2.010, "pid": 7, "who": "vllm", "ev": "EngineCore.step<", "cpu": 0,
                 "tid": 1},
                {"t": 3.0, "pid": 7, "who": "sched", "ev": "build_meta", "ms": 1.0},
                {"t": 4.0, "pid": 7, "who": "vllm", "ev": "Scheduler.schedule>", "cpu": 0,
                 "tid": 1}])  # never closed: dropped
    _write(path, marks)
    spans, window = step_phases.read_spans(str(path), None, None)
    assert window == 4.0
    assert sorted(round(w, 6) for w, _ in spans["EngineCore.step"]) == [0.002, 0.01]
    assert [round(c, 6) for _, c in spans["Scheduler.schedule"]] == [0.001, 0.004]
    late, _ = step_phases.read_spans(str(path), 0.5, None)  # the first schedule left out
    assert len(late["Scheduler.schedule"]) == 1
    tail, window = step_phases.read_spans(str(path), None, None, last=2.5)
    assert window == 2.5 and "Scheduler.schedule" not in tail  # spans ended before 1.5 s
    assert len(tail["EngineCore.step"]) == 2
    rows = step_phases.table(str(path), None, None)
    step_row = next(r for r in rows if r.startswith("| EngineCore.step |"))
    assert step_row.split("|")[2].strip() == "0.5"  # 2 spans in 4 s


def test_the_command_writes_the_tables(tmp_path):
    path = tmp_path / "tl.jsonl"
    _write(path, _span(0.0, 0.002, 0.001) + _span(1.0, 0.002, 0.001))
    md = tmp_path / "out.md"
    assert step_phases.main([str(path), "--md", str(md)]) == 0
    assert "| Scheduler.schedule | 2.0 | 2.00 |" in md.read_text()
    assert step_phases.main([str(tmp_path / "missing.jsonl")]) == 1
