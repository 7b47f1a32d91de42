"""README.md stays a short user's guide and every link in it and in docs/ lands somewhere: the
file exists and, for a link with a #fragment, the page has that heading. Repository paths the
pages name in backticks exist too, so a moved file cannot leave a stale pointer behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 150

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
REPO_PATH = re.compile(r"`((?:benchmarks|docs|examples|kvtier|scripts|tests)/[^`\s*<>]+)`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return LINK.findall(CODE_SPAN.sub("", text))


def _broken(page: Path) -> list[str]:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    return broken


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_into_docs_resolve():
    links = [t for t in _links(README) if t.startswith("docs/")]
    assert len(links) >= 8  # the documentation index is there
    assert _broken(README) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_links_resolve(page):
    assert _broken(page) == []


def test_the_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` (optional)\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-code-optional) [gone](missing.md) [bad](a.md#nope)\n")
    assert _broken(page) == ["missing.md (no such file)", "a.md#nope (no heading #nope in a.md)"]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_named_repository_paths_exist(page):
    missing = [p for p in REPO_PATH.findall(page.read_text())
               if not (ROOT / p.rstrip(".,:;")).exists()]
    assert missing == []


def test_readme_keeps_ci_test_command():
    """.ci/run runs 'the README's test command': keep that sentence true."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
    assert "./scripts/test.sh" in README.read_text()


def test_readme_is_not_a_development_log():
    text = README.read_text()
    for pattern in (r"\b[Ss]ession \d+", r"\blent\b", r"\.\./shared/"):
        assert not re.search(pattern, text), pattern
