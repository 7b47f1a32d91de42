"""kvtier.config: sizes, YAML/dict/env loading, error positions, block-size checks."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import (
    COMPRESSIONS,
    EVICTION_POLICIES,
    ConfigError,
    KvtierConfig,
    format_size,
    load_config,
    parse_size,
)

GiB, TiB = 1 << 30, 1 << 40

EXAMPLE = """\
block_tokens: 16          # tokens per kvtier block
tiers:
  cpu:   {capacity: 32GiB, eviction: arc}
  disk:  {path: {disk}, capacity: 2TiB, eviction: lru,
          compression: zstd, zstd_level: 1, fsync: true}
admission:
  store_threshold: 1
  offload_ratio: 1.0
  max_offload_tokens: null
stats:
  snapshot_path: null
  interval_s: 1.0
"""


@pytest.fixture(autouse=True)
def server_memory(monkeypatch):
    """The examples configure a server (32GiB CPU tier); pretend this machine is one. Tests of
    the memory check set their own figure."""
    monkeypatch.setattr("kvtier.config.loader.physical_memory", lambda: TiB, raising=False)
    monkeypatch.setattr("kvtier.config.machine.physical_memory", lambda: TiB, raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text.replace("{disk}", str(tmp_path / "cache")))
    return path


def error_of(tmp_path: Path, text: str, env: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=env or {})
    return info.value


# -- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("32GiB", 32 * GiB),
        ("2TiB", 2 * TiB),
        ("2TB", 2 * 10**12),
        ("1.5GiB", 3 * GiB // 2),
        ("4 KiB", 4096),
        ("4k", 4096),
        ("3M", 3 << 20),
        ("1kb", 1000),
        (" 7 B ", 7),
        ("1.1KiB", 1126),  # 1126.4 bytes, truncated
        ("1e3", 1000),
        (2.0 * GiB, 2 * GiB),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", [-1, "-1GiB", "abc", "", "GiB", "1.5.5GiB", "12 parsecs", True, False, None, [1],
            float("inf"), float("nan"), "1e999", "--1"],
)
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value) or type(bad).__name__ in str(info.value)


@pytest.mark.parametrize(
    "n, text", [(0, "0 B"), (1000, "1000 B"), (1536, "1.5 KiB"), (3 * GiB // 2, "1.5 GiB"),
                (32 * GiB, "32 GiB"), (2 * TiB, "2 TiB"), (-2048, "-2 KiB")],
)
def test_format_size(n, text):
    assert format_size(n) == text


@given(k=st.integers(1, 1023), shift=st.sampled_from([0, 10, 20, 30, 40, 50]))
def test_format_parse_round_trip_exact_for_unit_multiples(k, shift):
    n = k << shift
    assert parse_size(format_size(n)) == n


@given(st.integers(0, 1 << 62))
def test_format_parse_round_trip_within_half_percent(n):
    back = parse_size(format_size(n))
    assert abs(back - n) <= n * 0.005 + 1


@given(st.text(max_size=30))
def test_parse_size_only_raises_value_error(text):
    try:
        assert parse_size(text) >= 0
    except ValueError:
        pass


# -- loading -----------------------------------------------------------------------------------


def test_example_parses_to_exact_numbers(tmp_path):
    cfg = load_config(write(tmp_path, EXAMPLE), env={})
    assert cfg.block_tokens == 16
    assert (cfg.cpu.capacity, cfg.cpu.eviction, cfg.cpu.pin) == (32 * GiB, "arc", None)
    disk = cfg.disk
    assert disk is not None and disk.path == tmp_path / "cache" and disk.path.is_dir()
    assert (disk.capacity, disk.eviction, disk.compression) == (2 * TiB, "lru", "zstd")
    assert (disk.zstd_level, disk.fsync, disk.store_threshold) == (1, True, 1)
    assert disk.segment_bytes == 256 << 20
    assert (cfg.admission.store_threshold, cfg.admission.offload_ratio) == (1, 1.0)
    assert cfg.admission.max_offload_tokens is None
    assert cfg.stats.interval_s == 1.0
    assert cfg.snapshot_path() == tmp_path / "cache" / "kvtier-stats.json"
    assert cfg.source.endswith("kvtier.yaml")
    block = 2 << 20
    assert cfg.cpu_slots(block) == 32 * GiB // block and cfg.disk_blocks(block) == 2 * TiB // block
    as_json = json.loads(json.dumps(cfg.to_dict()))
    assert as_json["disk"]["path"] == str(tmp_path / "cache")
    assert as_json["cpu"]["capacity"] == 32 * GiB
    assert "origins" not in as_json
    # inline text and a parsed dict give the same values; only the source name differs
    inline = load_config(text=write(tmp_path, EXAMPLE).read_text(), env={})
    parsed = load_config(data=yaml.safe_load(write(tmp_path, EXAMPLE).read_text()), env={})
    assert (inline.source, parsed.source) == ("<inline>", "<extra_config>")
    assert replace(inline, source=cfg.source) == replace(parsed, source=cfg.source) == cfg


@pytest.mark.parametrize("text", ["", "# nothing set\n", "---\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    cfg = load_config(write(tmp_path, text), env={})
    assert replace(cfg, source="<defaults>") == KvtierConfig()
    assert (cfg.cpu.capacity, cfg.disk, cfg.snapshot_path()) == (4 * GiB, None, None)
    assert cfg.disk_blocks(4096) == 0
    assert load_config(env={}).source == "<defaults>"


def test_explicit_snapshot_path_and_relative_disk_path(tmp_path):
    text = "tiers: {disk: {path: rel}}\nstats: {snapshot_path: s.json}\n"
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.disk.path == tmp_path / "rel" and cfg.disk.capacity == 64 * GiB
    assert cfg.snapshot_path() == tmp_path / "s.json"


def test_disk_dir_created_private(tmp_path):
    cfg = load_config(write(tmp_path, "tiers: {disk: {path: a/b}}\n"), env={})
    assert stat.S_IMODE(os.stat(cfg.disk.path).st_mode) & 0o077 == 0


DISK = "tiers:\n  disk:\n    path: {disk}\n"  # a valid disk section; tests add line 4
BAD = [
    # (yaml, line, key, text in message)
    ("tiers:\n  cpu:\n    capacity: -1GiB\n", 3, "tiers.cpu.capacity", "must be positive, got '-1GiB'"),
    ("tiers:\n  cpu:\n    capacity: 0\n", 3, "tiers.cpu.capacity", "must be positive"),
    ("tiers:\n  cpu: {capacity: 12 parsecs}\n", 2, "tiers.cpu.capacity", "not a valid size"),
    ("tiers:\n  cpu: {capacity: -lots}\n", 2, "tiers.cpu.capacity", "not a valid size"),
    ("tiers:\n  cpu: {capacity: -0.5}\n", 2, "tiers.cpu.capacity", "must be positive"),
    ("tiers:\n  cpu: {capacity: yes}\n", 2, "tiers.cpu.capacity", "not a valid size"),
    ("block_tokens: '16'\n", 1, "block_tokens", "must be an integer"),
    ("\nblock_tokens: 0\n", 2, "block_tokens", "out of range"),
    ("block_tokens: -16\n", 1, "block_tokens", "out of range"),
    ("block_tokens: 1.5\n", 1, "block_tokens", "must be an integer"),
    ("tiers: [cpu, disk]\n", 1, "tiers", "must be a mapping"),
    ("tiers:\n  cpu: 5\n", 2, "tiers.cpu", "must be a mapping"),
    ("tiers:\n  cpu: {eviction: lfu}\n", 2, "tiers.cpu.eviction", "unknown eviction policy, got 'lfu'"),
    ("tiers:\n  cpu: {pin: maybe}\n", 2, "tiers.cpu.pin", "must be true or false"),
    ("tiers:\n  cpu: {pin_wait_s: -1}\n", 2, "tiers.cpu.pin_wait_s", "out of range"),
    ("tiers:\n  cpu: {pin_wait_s: .inf}\n", 2, "tiers.cpu.pin_wait_s", "out of range"),
    ("tiers:\n  cpu: {store_copy: cuda}\n", 2, "tiers.cpu.store_copy",
     "unknown store copy path, got 'cuda'"),
    ("tiers:\n  cpu: {store_copy: true}\n", 2, "tiers.cpu.store_copy", "unknown store copy path"),
    (DISK + "    compression: lz4\n", 4, "tiers.disk.compression", "unknown compression"),
    (DISK + "    zstd_level: 0\n", 4, "tiers.disk.zstd_level", "out of range"),
    (DISK + "    zstd_level: 23\n", 4, "tiers.disk.zstd_level", "out of range"),
    (DISK + "    fsync: sometimes\n", 4, "tiers.disk.fsync", "true or false"),
    (DISK + "    store_threshold: 0\n", 4, "tiers.disk.store_threshold", "out of range"),
    (DISK + "    segment_bytes: -5\n", 4, "tiers.disk.segment_bytes", "positive"),
    ("tiers:\n  disk:\n    capacity: 1GiB\n", 2, "tiers.disk.path", "needs a directory"),
    ("tiers:\n  disk: {path: [a]}\n", 2, "tiers.disk.path", "must be a path"),
    ("admission:\n  offload_ratio: 0\n", 2, "admission.offload_ratio", "out of range"),
    ("admission:\n  offload_ratio: 1.01\n", 2, "admission.offload_ratio", "out of range"),
    ("admission:\n  offload_ratio: .nan\n", 2, "admission.offload_ratio", "out of range"),
    ("admission:\n  offload_ratio: half\n", 2, "admission.offload_ratio", "must be a number"),
    ("admission:\n  store_threshold: 0\n", 2, "admission.store_threshold", "out of range"),
    ("admission:\n  max_offload_tokens: 0\n", 2, "admission.max_offload_tokens", "out of range"),
    ("stats:\n  interval_s: 0\n", 2, "stats.interval_s", "out of range"),
    ("block_tokens: 16\nblock_tokens: 32\n", 2, "block_tokens", "duplicate key"),
    ("block_tokens: 2001-13-01\n", 1, "block_tokens", "cannot read value"),
    ("tiers:\n  cpu:\n    capacty: 1GiB\n", 3, "tiers.cpu.capacty", "did you mean 'capacity'"),
    ("tier:\n  cpu: {}\n", 1, "tier", "did you mean 'tiers'"),
    ("admission:\n  offload_ration: 1\n", 2, "admission.offload_ration", "did you mean 'offload_ratio'"),
    ("tiers:\n  cpu: {evicton: lru}\n", 2, "tiers.cpu.evicton", "did you mean 'eviction'"),
    ("tiers:\n  cpu: {eviction: lur}\n", 2, "tiers.cpu.eviction", "did you mean 'lru'"),
    ("capacity: 1GiB\n", 1, "capacity", "belongs under 'tiers.cpu.capacity'"),
]


@pytest.mark.parametrize("text, line, key, fragment", BAD)
def test_bad_values_cite_file_line_and_key(tmp_path, text, line, key, fragment):
    err = error_of(tmp_path, text)
    assert (err.line, err.key) == (line, key)
    message = str(err)
    assert message.startswith(f"{tmp_path / 'kvtier.yaml'}:{line}: {key}: ")
    assert fragment in message and err.allowed and f"(allowed: {err.allowed})" in message


def test_unknown_key_lists_allowed_keys(tmp_path):
    err = error_of(tmp_path, "tiers:\n  cpu:\n    capacty: 1GiB\n")
    assert err.allowed == "capacity, eviction, pin, admission, pin_wait_s, store_copy"


@pytest.mark.parametrize("value", ["kernel", "dma"])
def test_store_copy_takes_kernel_or_dma(tmp_path, value):
    cfg = load_config(write(tmp_path, f"tiers:\n  cpu: {{store_copy: {value}}}\n"), env={})
    assert cfg.cpu.store_copy == value
    assert load_config(data={"tiers": {"cpu": {"store_copy": value}}}, env={}).cpu.store_copy == value
    assert load_config(env={}).cpu.store_copy == "kernel"


def test_a_bad_store_copy_names_the_key_and_the_valid_values(tmp_path):
    err = error_of(tmp_path, "tiers:\n  cpu:\n    store_copy: DMA\n")
    assert (err.key, err.line, err.allowed) == ("tiers.cpu.store_copy", 3, "kernel, dma")
    assert "tiers.cpu.store_copy" in str(err) and "(allowed: kernel, dma)" in str(err)


@pytest.mark.parametrize(
    "text, line",
    [("block_tokens: 16\ntiers: {cpu: [\n", 3), ("a: 1\nb: c: d\n", 2), ("x: 'open\n", 2)],
)
def test_yaml_syntax_error_reports_line_and_column(tmp_path, text, line):
    err = error_of(tmp_path, text)
    assert err.line == line and "invalid YAML at column" in str(err)
    assert str(err).startswith(f"{tmp_path / 'kvtier.yaml'}:{line}:")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just words\n", "42\n"])
def test_top_level_must_be_mapping(tmp_path, text):
    err = error_of(tmp_path, text)
    assert err.line == 1 and "top level must be a mapping" in str(err)


def test_unsafe_tags_are_never_constructed(tmp_path):
    marker = tmp_path / "pwned"
    err = error_of(tmp_path, f"block_tokens: !!python/object/apply:os.system ['touch {marker}']\n")
    assert "must be an integer, got a list" in str(err)
    err = error_of(tmp_path, "block_tokens: !!python/name:os.system\n")
    assert "cannot read value" in str(err) and err.line == 1
    assert not marker.exists()


def test_alias_bomb_is_not_expanded(tmp_path):
    # 9**10 leaves if anything walked or printed it; the loader only sees "a list"
    nested = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    nested += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    err = error_of(tmp_path, f"block_tokens: [{', '.join(nested)}]\n")
    assert (err.line, err.key) == (1, "block_tokens") and "got a list" in str(err)


def test_disk_path_must_be_a_creatable_directory(tmp_path):
    (tmp_path / "afile").write_text("")
    err = error_of(tmp_path, f"tiers:\n  disk:\n    path: {tmp_path / 'afile'}\n")
    assert (err.line, err.key) == (3, "tiers.disk.path") and "not a directory" in str(err)
    text = f"tiers:\n  disk:\n    capacity: 1GiB\n    path: {tmp_path / 'afile' / 'sub'}\n"
    err = error_of(tmp_path, text)
    assert (err.line, err.key) == (4, "tiers.disk.path") and "cannot create directory" in str(err)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml", env={})
    assert "nope.yaml" in str(info.value) and "cannot read" in str(info.value)


def test_one_source_at_most():
    with pytest.raises(TypeError):
        load_config(text="", data={})


def test_dict_source_errors_name_extra_config(tmp_path):
    cfg = load_config(data={"tiers": {"disk": {"path": tmp_path / "d"}}}, env={})
    assert cfg.disk.path == tmp_path / "d" and cfg.source == "<extra_config>"
    with pytest.raises(ConfigError) as info:
        load_config(data={"tiers": {"cpu": {"capacity": "lots"}}}, env={})
    assert str(info.value).startswith("<extra_config>: tiers.cpu.capacity: not a valid size")
    with pytest.raises(ConfigError, match="keys must be strings"):
        load_config(data={1: 2}, env={})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(data=[1], env={})


def test_config_error_is_value_error_and_pickles():
    err = ConfigError("bad", file="f.yaml", line=3, key="k", allowed="x")
    assert isinstance(err, ValueError) and str(err) == "f.yaml:3: k: bad (allowed: x)"
    back = pickle.loads(pickle.dumps(err))
    assert (back.file, back.line, back.key, back.problem, back.allowed, str(back)) == (
        "f.yaml", 3, "k", "bad", "x", str(err))
    assert str(ConfigError("only a problem")) == "only a problem"


def test_constants():
    assert set(EVICTION_POLICIES) >= {"lru", "arc"} and COMPRESSIONS == ("none", "zstd")


# -- environment -------------------------------------------------------------------------------


def test_env_overrides_win_over_file(tmp_path):
    env = {
        "KVTIER_BLOCK_TOKENS": "32", "KVTIER_CPU_CAPACITY": "1GiB", "KVTIER_CPU_EVICTION": "lru",
        "KVTIER_DISK_PATH": str(tmp_path / "envdisk"), "KVTIER_DISK_CAPACITY": "10GB",
        "KVTIER_DISK_EVICTION": "arc", "KVTIER_DISK_COMPRESSION": "none",
        "KVTIER_DISK_FSYNC": "off",
        "KVTIER_STORE_THRESHOLD": "2", "KVTIER_OFFLOAD_RATIO": "0.5",
    }
    cfg = load_config(write(tmp_path, EXAMPLE), env=env)
    assert (cfg.block_tokens, cfg.cpu.capacity, cfg.cpu.eviction) == (32, GiB, "lru")
    assert (cfg.disk.path, cfg.disk.capacity) == (tmp_path / "envdisk", 10**10)
    assert cfg.disk.eviction == "arc"
    assert (cfg.disk.compression, cfg.disk.fsync, cfg.disk.zstd_level) == ("none", False, 1)
    assert (cfg.admission.store_threshold, cfg.admission.offload_ratio) == (2, 0.5)
    assert cfg.origins["tiers.cpu.capacity"] == ("<env>", None, "KVTIER_CPU_CAPACITY")


def test_env_disk_path_alone_enables_disk_and_empty_values_are_unset(tmp_path):
    cfg = load_config(env={"KVTIER_DISK_PATH": str(tmp_path / "d"), "KVTIER_CPU_CAPACITY": ""})
    assert cfg.disk.path == tmp_path / "d" and cfg.disk.capacity == 64 * GiB
    assert cfg.cpu.capacity == 4 * GiB


@pytest.mark.parametrize(
    "var, value, fragment",
    [
        ("KVTIER_BLOCK_TOKENS", "sixteen", "must be an integer"),
        ("KVTIER_BLOCK_TOKENS", "0", "out of range"),
        ("KVTIER_CPU_CAPACITY", "-1GiB", "must be positive"),
        ("KVTIER_CPU_CAPACITY", "lots", "not a valid size"),
        ("KVTIER_CPU_EVICTION", "mru", "unknown eviction policy"),
        ("KVTIER_DISK_CAPACITY", "0", "must be positive"),
        ("KVTIER_DISK_EVICTION", "fifo", "unknown eviction policy"),
        ("KVTIER_DISK_COMPRESSION", "gzip", "unknown compression"),
        ("KVTIER_DISK_FSYNC", "perhaps", "true or false"),
        ("KVTIER_STORE_THRESHOLD", "0", "out of range"),
        ("KVTIER_OFFLOAD_RATIO", "2", "out of range"),
        ("KVTIER_OFFLOAD_RATIO", "x", "must be a number"),
    ],
)
def test_bad_env_values_name_the_variable(tmp_path, var, value, fragment):
    env = {"KVTIER_DISK_PATH": str(tmp_path / "d"), var: value}
    err = error_of(tmp_path, EXAMPLE, env=env)
    assert err.key == var and str(err).startswith(f"<env>: {var}: ") and fragment in str(err)


def test_env_disk_setting_without_path_names_variable():
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_DISK_CAPACITY": "1TiB"})
    assert info.value.key == "KVTIER_DISK_CAPACITY" and "needs a directory" in str(info.value)


# -- block size checks -------------------------------------------------------------------------


def test_check_block_bytes_cites_capacity_line(tmp_path):
    text = "block_tokens: 16\ntiers:\n  cpu: {capacity: 64MiB}\n  disk:\n    path: {disk}\n"
    text += "    capacity: 1MiB\n"
    cfg = load_config(write(tmp_path, text), env={})
    cfg.check_block_bytes(1 << 20)  # exactly one block fits everywhere
    with pytest.raises(ConfigError) as info:
        cfg.check_block_bytes((1 << 20) + 1)  # one byte too big for the disk tier
    err = info.value
    assert (err.line, err.key) == (6, "tiers.disk.capacity")
    prefix = f"{tmp_path / 'kvtier.yaml'}:6: tiers.disk.capacity: 1 MiB is smaller"
    assert str(err).startswith(prefix)
    with pytest.raises(ConfigError) as info:
        cfg.check_block_bytes(128 << 20)
    assert (info.value.line, info.value.key) == (3, "tiers.cpu.capacity")
    assert cfg.cpu_slots(1 << 20) == 64 and cfg.disk_blocks(1 << 20) == 1


def test_check_block_bytes_names_env_variable_and_defaults():
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_CPU_CAPACITY": "1MiB"}).check_block_bytes(2 << 20)
    assert info.value.key == "KVTIER_CPU_CAPACITY"
    with pytest.raises(ConfigError) as info:
        KvtierConfig().check_block_bytes(8 * GiB)
    assert str(info.value).startswith("<defaults>: tiers.cpu.capacity: 4 GiB is smaller")
    with pytest.raises(ValueError):
        KvtierConfig().check_block_bytes(0)


# -- fuzzing -----------------------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(text=st.text(max_size=200))
def test_arbitrary_text_gives_config_or_config_error(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)  # any relative disk path lands in tmp_path
    try:
        assert isinstance(load_config(text=text, env={}), KvtierConfig)
    except ConfigError as err:
        assert err.problem and str(err).startswith("<inline>")


_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
            | st.sampled_from(["lru", "arc", "zstd", "none", "1GiB", "-1KiB", "cache", "0.5"])
            | st.text(alphabet="0123456789.-+ eKMGTiBlruaczstdnoe", max_size=8))
_VALUES = _SCALARS | st.lists(_SCALARS, max_size=2)


def _section(*keys: str):
    """Mostly-valid key names (plus one typo) with arbitrary values: reaches every validator."""
    mapping = st.dictionaries(st.sampled_from([*keys, "capacty"]), _VALUES, max_size=len(keys))
    return st.tuples(st.integers(0, 9), mapping, _VALUES).map(lambda t: t[1] if t[0] else t[2])


_DISK_KEYS = ("path", "capacity", "eviction", "compression", "zstd_level", "fsync", "segment_bytes",
              "store_threshold")
_TREES = st.fixed_dictionaries({}, optional={
    "block_tokens": _VALUES,
    "tiers": st.fixed_dictionaries({}, optional={"cpu": _section("capacity", "eviction", "pin"),
                                                 "disk": _section(*_DISK_KEYS)}),
    "admission": _section("store_threshold", "offload_ratio", "max_offload_tokens"),
    "stats": _section("snapshot_path", "interval_s"),
})


@FUZZ
@given(tree=_TREES)
def test_schema_shaped_input_gives_config_or_config_error(tmp_path, monkeypatch, tree):
    monkeypatch.chdir(tmp_path)
    for kwargs in ({"data": tree}, {"text": yaml.safe_dump(tree)}):
        try:
            assert isinstance(load_config(**kwargs, env={}), KvtierConfig)
        except ConfigError as err:
            assert err.key or err.line


def test_relative_config_path_resolves_against_its_directory(tmp_path, monkeypatch):
    write(tmp_path, "tiers: {disk: {path: store}}\n")
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(Path(tmp_path.name) / "kvtier.yaml", env={})
    assert cfg.disk.path.is_absolute() and cfg.disk.path == tmp_path / "store"


# -- issue 14, items 12 and 13: sizes the machine cannot hold, huge numbers, side effects ------

from kvtier.config import machine as _machine  # noqa: E402

REAL_MEMORY = _machine.physical_memory  # before the autouse fixture patches it


def test_physical_memory_is_known_here():
    assert REAL_MEMORY() > 0


@pytest.mark.parametrize("capacity", ["100TiB", "9GiB", "8589934593"])
def test_cpu_tier_larger_than_memory_is_refused_at_load(monkeypatch, capacity):
    monkeypatch.setattr("kvtier.config.loader.physical_memory", lambda: 8 * GiB)
    with pytest.raises(ConfigError) as info:
        load_config(text=f"tiers:\n  cpu: {{capacity: {capacity}}}\n", env={})
    assert info.value.line == 2 and info.value.key == "tiers.cpu.capacity"
    assert "more than this machine's memory (8 GiB)" in str(info.value)
    assert load_config(data={"tiers": {"cpu": {"capacity": "8GiB"}}}, env={}).cpu.capacity == 8 * GiB


def test_disk_tier_too_large_to_index_is_refused_naming_its_key(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.config.machine.physical_memory", lambda: 16 * GiB)
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "1GiB"},
                                      "disk": {"path": str(tmp_path / "d"), "capacity": "1PiB"}}},
                      env={})
    with pytest.raises(ConfigError) as info:
        cfg.check_block_bytes(64 << 10)
    assert info.value.key == "tiers.disk.capacity" and "indexing them" in str(info.value)
    cfg.check_block_bytes(64 << 20)  # the same PiB in 64 MiB blocks is 16M entries: fine


@pytest.mark.parametrize("tree, key", [
    ({"tiers": {"cpu": {"capacity": "1.5e99GiB"}}}, "tiers.cpu.capacity"),
    ({"tiers": {"cpu": {"capacity": 1e300}}}, "tiers.cpu.capacity"),
    ({"tiers": {"cpu": {"capacity": 10**5000}}}, "tiers.cpu.capacity"),
    ({"tiers": {"disk": {"path": "d", "capacity": "1.5e99GiB"}}}, "tiers.disk.capacity"),
    ({"tiers": {"disk": {"path": "d", "segment_bytes": "9e40TB"}}}, "tiers.disk.segment_bytes"),
    ({"block_tokens": 10**5000}, "block_tokens"),
    ({"metrics": {"port": 10**5000}}, "metrics.port"),
    ({"admission": {"offload_ratio": 10**400}}, "admission.offload_ratio"),
    ({"admission": {"max_offload_tokens": 10**400}}, "admission.max_offload_tokens"),
    ({"stats": {"interval_s": 10**400}}, "stats.interval_s"),
    ({"cost": {"recompute_tokens_per_s": 10**400}}, "cost.recompute_tokens_per_s"),
])
def test_huge_numbers_are_config_errors(tmp_path, monkeypatch, tree, key):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(data=tree, env={})
    assert info.value.key == key and len(str(info.value)) < 300


def test_huge_numbers_in_yaml_and_env_are_config_errors(tmp_path):
    err = error_of(tmp_path, "block_tokens: " + "1" * 5000 + "\n")
    assert err.line == 1 and err.key == "block_tokens" and len(str(err)) < 400
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_BLOCK_TOKENS": "1" * 5000})
    assert info.value.key == "KVTIER_BLOCK_TOKENS" and len(str(info.value)) < 400


@pytest.mark.parametrize("bad", ["metrics: {port: 99999}", "tiers: {cpu: {capacity: 0}}",
                                 "events: {endpoint: 'tcp://10.0.0.1:1'}", "cost: {}"])
def test_refused_config_creates_no_disk_directory(tmp_path, bad):
    disk = tmp_path / "a" / "disk"
    text = f"tiers:\n  disk: {{path: {disk}}}\n{bad}\n"
    if bad.startswith("tiers"):
        text = f"tiers:\n  cpu: {{capacity: 0}}\n  disk: {{path: {disk}}}\n"
    with pytest.raises(ConfigError):
        load_config(text=text, env={})
    assert not (tmp_path / "a").exists()
    load_config(text=f"tiers:\n  disk: {{path: {disk}}}\n", env={})
    assert disk.is_dir()


def test_missing_parents_are_created_0700_under_umask_000(tmp_path):
    disk = tmp_path / "p1" / "p2" / "disk"
    old = os.umask(0)
    try:
        load_config(data={"tiers": {"disk": {"path": str(disk)}}}, env={})
    finally:
        os.umask(old)
    for d in (tmp_path / "p1", tmp_path / "p1" / "p2", disk):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.mark.parametrize("tiers", ["cpu: {capacity: 100TiB}", "cpu: {capacity: 1.5e99GiB}",
                                   "cpu: {capacity: 16MiB}\n  disk: {path: DISK, capacity: 1PiB}"])
def test_cli_refuses_impossible_capacities_in_one_line(tmp_path, tiers):
    cfg = tmp_path / "k.yaml"
    cfg.write_text("tiers:\n  " + tiers.replace("DISK", str(tmp_path / "disk")) + "\n")
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--config", str(cfg),
                           "--limit", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "capacity" in proc.stderr and str(cfg) in proc.stderr
