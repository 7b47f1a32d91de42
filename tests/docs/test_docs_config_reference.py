"""docs/configuration.md is what scripts/gen_config_doc.py writes from the config loader, so
the reference cannot drift from the code: every key the loader accepts appears exactly once,
with the loader's own default and allowed values, and a key without a written meaning stops
the generator instead of going undocumented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvtier.config import EVICTION_POLICIES
from kvtier.config.env import ENV_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def _script():
    spec = importlib.util.spec_from_file_location("gen_config_doc",
                                                  ROOT / "scripts" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _script()


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_committed_page_is_what_the_script_generates(gen, page):
    assert page == gen.render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_doc.py")


def test_check_mode_fails_on_a_stale_page(gen, tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(PAGE.read_text().replace("`tiers.cpu.eviction`", "`tiers.cpu.evict`"))
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    fresh = tmp_path / "fresh.md"
    assert gen.main(["--out", str(fresh)]) == 0
    assert gen.main(["--check", "--out", str(fresh)]) == 0


def _rows(page: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)


def test_every_config_key_documented_exactly_once(gen, page):
    keys = gen.config_keys()
    rows = _rows(page)
    assert len(keys) > 40  # the walk found the loader's table, not an empty one
    for key in keys:
        assert rows.count(key) == 1, f"{key} documented {rows.count(key)} times"


def test_every_environment_variable_documented_exactly_once(page):
    for var, (key, _) in ENV_OVERRIDES.items():
        assert page.count(f"`{var}`") == 1, var
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert f"`{var}`" in row, f"{var} is not in {key}'s row"


def test_defaults_and_allowed_values_come_from_the_loader(gen, page):
    row = next(line for line in page.splitlines() if line.startswith("| `tiers.cpu.eviction` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "`lru`"
    assert cells[3] == ", ".join(EVICTION_POLICIES)
    row = next(line for line in page.splitlines() if line.startswith("| `tiers.cpu.capacity` |"))
    assert "`4GiB`" in row


def test_a_key_without_a_meaning_stops_the_generator(gen, monkeypatch):
    layout = dict(gen._LAYOUT)
    layout["tiers.cpu"] = (*layout["tiers.cpu"], "brand_new_key")
    monkeypatch.setattr(gen, "_LAYOUT", layout)
    with pytest.raises(SystemExit, match="tiers.cpu.brand_new_key"):
        gen.render()


def test_a_meaning_for_a_removed_key_stops_the_generator(gen, monkeypatch):
    monkeypatch.setitem(gen.MEANINGS, "tiers.cpu.gone", "a key the loader no longer accepts")
    with pytest.raises(SystemExit, match="tiers.cpu.gone"):
        gen.render()
