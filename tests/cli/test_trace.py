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


def test_continues_flag_is_read_and_checked(tmp_path):
    base = '"input_length": 512, "output_length": 1, "hash_ids": [1]'
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f"{{{base}{extra}}}\n" for extra in
                            ('', ', "continues": true', ', "continues": false')))
    assert [r.continues for r in load_trace(path)] == [None, True, False]
    with pytest.raises(TraceError, match="t.jsonl:1: field 'continues' must be true or false"):
        path.write_text(f'{{{base}, "continues": 1}}\n')
        load_trace(path)


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


# -- issue 14, items 8 and 13: one line must not exhaust memory or end in a traceback

def _line(n_blocks, **extra):
    obj = {"input_length": n_blocks * 512, "output_length": 1, "hash_ids": list(range(n_blocks))}
    obj.update(extra)
    return json.dumps(obj)


def test_request_longer_than_the_bound_is_refused_naming_the_line(tmp_path):
    from kvtier.bench.trace import MAX_REQUEST_BLOCKS

    p = write(tmp_path, [_line(3), _line(MAX_REQUEST_BLOCKS + 1)])
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert f"{p}:2" in str(err.value) and "input_length" in str(err.value)
    # the longest request allowed still loads
    assert len(load_trace(write(tmp_path, [_line(MAX_REQUEST_BLOCKS)]))[0].hash_ids) == MAX_REQUEST_BLOCKS


def test_over_long_line_is_refused_without_reading_it_whole(tmp_path):
    from kvtier.bench.trace import MAX_LINE_CHARS

    p = tmp_path / "t.jsonl"
    p.write_text(_line(2) + "\n" + '{"hash_ids": [' + "1, " * MAX_LINE_CHARS)  # no newline
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert f"{p}:2" in str(err.value) and "line longer" in str(err.value)


@pytest.mark.parametrize("line, needle", [
    (_line(1, hash_ids=[2**64]), "2**64-1"),
    ('{"input_length": 1' + "0" * 5000 + ', "output_length": 1, "hash_ids": [1]}', "not a valid"),
    (_line(1, hash_ids=[10**5000 // 10**4000]), "hash_ids"),
    (_line(1, timestamp=10**400), "timestamp"),
    (_line(1, output_length=10**300), "output_length"),
])
def test_huge_numbers_are_trace_errors(tmp_path, line, needle):
    p = write(tmp_path, [line])
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert f"{p}:1" in str(err.value) and needle in str(err.value)
    assert len(str(err.value)) < 300  # the number is not pasted into the message


@pytest.mark.parametrize("line", [
    _line(5000),
    _line(1, hash_ids=[2**64]),
    '{"input_length": 1' + "0" * 5000 + ', "output_length": 1, "hash_ids": [1]}',
])
def test_cli_reports_a_bad_line_in_one_line_with_status_2(tmp_path, line):
    import subprocess
    import sys

    p = write(tmp_path, [_line(2), line])
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--trace", str(p),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and f"{p}:2" in proc.stderr
    assert "Traceback" not in proc.stderr
