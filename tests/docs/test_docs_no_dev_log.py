"""README and docs/ describe the product, not the history of its making: no numbered work
sessions or periods, no "dev machine" or lent machines (say "a 2-core development machine",
"an H100"), and no results file named after the period it came from (issue 49). The results
files themselves keep their dated sections: they are the record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEV_LOG = re.compile(
    r"\bsession[ _]?\d+\b"              # "session 23", "Session 24", "session_18"
    r"|\bs\d{1,2}(?: run\b|_)"          # "s24 run", "serving_alone_s24_..."
    r"|\bdev machine\b"
    r"|\blent (?:H[12]00|machine|host)\b"
    r"|\bthe next (?:session|period)\b"
    r"|\bwork period\b",
    re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_development_log_words(page):
    hits = [f"{page.name}:{n}: {m.group(0)!r}"
            for n, line in enumerate(page.read_text().splitlines(), 1)
            for m in DEV_LOG.finditer(line)]
    assert hits == [], "\n".join(hits)


def test_results_files_are_named_by_what_they_measured():
    named_by_when = [p.name for p in (ROOT / "benchmarks" / "results").iterdir()
                     if re.search(r"_s\d{1,2}_|session", p.name, re.IGNORECASE)]
    assert named_by_when == []
