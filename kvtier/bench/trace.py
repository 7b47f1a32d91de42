"""Mooncake-format request traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [ints]}``;
each hash id names one 512-token block of the prompt, and equal prefixes of hash ids mean equal
prompt prefixes. Parsing is strict: a bad line is an error naming the file, the line and the
field (a trace is input from users; silently skipping lines would skew every hit rate).

Sizes are bounded before anything is built from them: the bench sizes its simulated GPU from
the longest request, so one line of 6M hash_ids once reached 20 GB RSS. A request is at most
``MAX_REQUEST_TOKENS`` tokens (the longest in the Mooncake trace is ~191k), a line at most
``MAX_LINE_CHARS`` characters (read with a limit, so a line without a newline cannot fill
memory either), and a hash id fits the 8-byte block key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

TRACE_BLOCK_TOKENS = 512
MAX_REQUEST_TOKENS = 1 << 21  # 2M tokens = 4096 trace blocks
MAX_REQUEST_BLOCKS = MAX_REQUEST_TOKENS // TRACE_BLOCK_TOKENS
MAX_LINE_CHARS = 1 << 20  # 4096 ids of 20 digits take ~90k characters
MAX_HASH_ID = (1 << 64) - 1  # block keys are 8 bytes


class TraceError(ValueError):
    """A trace line that is not a valid request; the message names file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    # What a router may know (never needed to replay): the conversation this request belongs
    # to, and whether it will send another turn (read from a line's optional "continues",
    # which ``--compare``'s ``+hints`` passes on as retention hints).
    session: int | None = None
    continues: bool | None = None

    def block_tokens(self, i: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
        """Tokens of the prompt covered by block ``i`` (the last one may be partial)."""
        return max(0, min(block_tokens, self.input_length - i * block_tokens))


def _show(value: object) -> str:
    """``repr`` that stays short: a 4000-digit int or a huge list must not become the message."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _int_field(obj: dict, name: str, where: str, minimum: int = 0,
               maximum: int | None = None) -> int:
    value = obj.get(name)
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        span = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise TraceError(f"{where}: field {name!r} must be an integer {span}, got {_show(value)}")
    return value


def parse_line(line: str, where: str) -> TraceRequest | None:
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise TraceError(f"{where}: not a valid trace line ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 2**63:
        raise TraceError(f"{where}: field 'timestamp' must be a number >= 0, got {_show(ts)}")
    input_length = _int_field(obj, "input_length", where, 1, MAX_REQUEST_TOKENS)
    output_length = _int_field(obj, "output_length", where, 0, MAX_REQUEST_TOKENS)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not hash_ids:
        raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list of integers")
    for h in hash_ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(f"{where}: 'hash_ids' holds {_show(h)}; only integers from 0 "
                             "to 2**64-1 are allowed")
    max_blocks = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(hash_ids) > max_blocks:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} "
            f"(at most {max_blocks} blocks of {TRACE_BLOCK_TOKENS} tokens)"
        )
    continues = obj.get("continues")
    if continues is not None and not isinstance(continues, bool):
        raise TraceError(f"{where}: field 'continues' must be true or false, got "
                         f"{_show(continues)}")
    return TraceRequest(float(ts), input_length, output_length, tuple(hash_ids),
                        continues=continues)


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    path = Path(path)
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace ({exc.strerror})") from None
    with fh:
        try:
            lineno = 0
            while line := fh.readline(MAX_LINE_CHARS + 1):
                lineno += 1
                if len(line) > MAX_LINE_CHARS:
                    raise TraceError(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS:,} "
                                     f"characters (a request holds at most {MAX_REQUEST_BLOCKS} "
                                     "hash_ids)")
                req = parse_line(line, f"{path}:{lineno}")
                if req is not None:
                    yield req
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not a UTF-8 text file") from None


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; ``None`` reads the small sample bundled with kvtier."""
    if path is None:
        ref = resources.files("kvtier.data").joinpath("sample_trace.jsonl")
        with resources.as_file(ref) as p:
            return load_trace(p, limit)
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{path}: trace holds no requests")
    return out
