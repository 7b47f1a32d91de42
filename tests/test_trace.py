"""Trace parsing: strict, with errors that name file, line and field."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.bench.trace import TraceError, load_trace, parse_line


def write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bundled_sample_loads():
    trace = load_trace()
    assert len(trace) == 400
    assert all(r.hash_ids and r.input_length > 0 for r in trace)


def test_valid_lines_and_partial_last_block(tmp_path):
    p = write(tmp_path, [json.dumps({"timestamp": 1, "input_length": 1000, "output_length": 3, "hash_ids": [5, 6]}), ""])
    (req,) = load_trace(p)
    assert req.hash_ids == (5, 6) and req.block_tokens(0) == 512 and req.block_tokens(1) == 488


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": []}', "hash_ids"),
    ('{"input_length": -1, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "'a'"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "at most 1 blocks"),
    ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, needle):
    ok = json.dumps({"input_length": 10, "output_length": 1, "hash_ids": [1]})
    p = write(tmp_path, [ok, line])
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert f"{p}:2" in str(err.value) and needle in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, [""]))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError):
        load_trace(binary)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.dictionaries(
    st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"]),
    st.one_of(st.integers(-5, 5000), st.floats(allow_nan=True), st.text(max_size=5),
              st.lists(st.integers(-2, 10**20), max_size=12), st.none(), st.booleans()),
).map(json.dumps)))
def test_fuzzed_lines_parse_or_raise_trace_error(line):
    try:
        req = parse_line(line, "fuzz:1")
    except TraceError:
        return
    assert req is None or (req.input_length >= 1 and all(h >= 0 for h in req.hash_ids))
