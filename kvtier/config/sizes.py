"""Byte sizes as people write them ("32GiB", "2TB", "1.5 GiB") and as we print them.

SI suffixes (KB, MB, GB, TB, PB) are powers of 1000 and IEC suffixes (KiB .. PiB) powers of
1024, because disks are sold in the first and memory in the second and users copy both. A bare
K/M/G/T/P is read as IEC: that is what ``free -g`` and most cache settings mean by it. Fractions
are computed exactly (no float rounding) and truncated to whole bytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_IEC = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _letter, _iec in _IEC.items():
    _UNITS[_letter] = _iec
    _UNITS[_letter + "ib"] = _iec
    _UNITS[_letter + "b"] = 1000 ** (list(_IEC).index(_letter) + 1)

# The exponent is capped at two digits so "1e999999999" cannot make Fraction build a huge int.
_SIZE_RE = re.compile(
    r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]{1,2}))?\s*([A-Za-z]*)\s*"
)

_FORMAT_UNITS = (
    ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)
)


def parse_size(value: object) -> int:
    """Bytes denoted by ``value``: a non-negative int, or a string such as "512MiB", "2TB",
    "1.5GiB", "4 KiB" or "4096". Raises ``ValueError`` naming the value for anything else."""
    if isinstance(value, bool):  # bool is an int subclass; `capacity: yes` is a mistake
        raise ValueError(f"expected a size, got the boolean {value!r}")
    if isinstance(value, int):
        amount = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"expected a size, got {value!r}")
        amount = Fraction(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1 if text.startswith("-") else 1
        match = _SIZE_RE.fullmatch(text[1:] if text[:1] in "+-" else text)
        unit = _UNITS.get(match.group(3).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(
                f"expected a size such as 512MiB, 32GiB, 2TB or plain bytes, got {value!r}"
            )
        exponent = int(match.group(2) or 0)
        amount = sign * Fraction(match.group(1)) * Fraction(10) ** exponent * unit
    else:
        raise ValueError(f"expected a size, got {type(value).__name__} {value!r}")
    if amount < 0:
        raise ValueError(f"a size must not be negative, got {value!r}")
    return math.floor(amount)


def format_size(n: int) -> str:
    """``n`` bytes in the largest IEC unit it reaches, with at most two decimals ("1.5 GiB").

    Exact for whole multiples of a unit below 1024 of it; otherwise within 0.5%. For stable,
    exact output (JSON, logs that are parsed back) print the integer instead."""
    if n < 0:
        return "-" + format_size(-n)
    for name, unit in _FORMAT_UNITS:
        if n >= unit:
            text = f"{n / unit:.2f}".rstrip("0").rstrip(".")
            return f"{text} {name}"
    return f"{int(n)} B"
