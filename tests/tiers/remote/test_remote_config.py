"""``tiers.remote``: what a valid section gives, and a precise error for each bad input."""

from __future__ import annotations

import pytest

from kvtier.config import ConfigError, load_config
from kvtier.manager.factory import build_manager
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote import derive_namespace
from kvtier.tiers.remote.wire.connect import connect_remote


def remote(text: str):
    return load_config(text="tiers:\n  remote:\n" + text, env={})


def test_standalone_and_cluster_sections():
    cfg = remote("    url: redis://127.0.0.1:6379/0\n    timeout_s: 0.25\n"
                 "    compression: zstd\n    capacity: 8GiB\n    store_threshold: 2\n")
    r = cfg.remote
    assert (r.url, r.cluster, r.timeout_s, r.compression) == ("redis://127.0.0.1:6379/0", False,
                                                              0.25, "zstd")
    assert r.capacity == 8 << 30 and r.admission == "threshold" and r.store_threshold == 2
    assert cfg.to_dict()["remote"]["url"] == r.url
    c = remote("    nodes: [127.0.0.1:7000, '127.0.0.1:7001']\n").remote
    assert c.cluster and c.nodes == ("127.0.0.1:7000", "127.0.0.1:7001")
    assert load_config(env={}).remote is None


def test_environment_enables_and_overrides():
    cfg = load_config(env={"KVTIER_REMOTE_NODES": "10.0.0.1:7000, 10.0.0.2:7000",
                           "KVTIER_REMOTE_NAMESPACE": "team-a"})
    assert cfg.remote.nodes == ("10.0.0.1:7000", "10.0.0.2:7000")
    assert cfg.remote.namespace == "team-a"


@pytest.mark.parametrize("text, line, key, words", [
    ("    url: http://h:1\n", 3, "tiers.remote.url", "unsupported scheme"),
    ("    url: redis://h\n", 3, "tiers.remote.url", "no port"),
    ("    url: redis://h:1/x\n", 3, "tiers.remote.url", "database"),
    ("    url: 5\n", 3, "tiers.remote.url", "must be a string"),
    ("    nodes: []\n", 3, "tiers.remote.nodes", "non-empty list"),
    ("    nodes: [h]\n", 3, "tiers.remote.nodes", "not HOST:PORT"),
    ("    nodes: [[a]]\n", 3, "tiers.remote.nodes", "HOST:PORT string"),
    ("    url: redis://h:1\n    nodes: [h:1]\n", 4, "tiers.remote.nodes", "give the server once"),
    ("    timeout_s: 1\n", 2, "tiers.remote", "give the server once"),
    ("    url: redis://h:1\n    timeout_s: 0\n", 4, "tiers.remote.timeout_s", "out of range"),
    ("    url: redis://h:1\n    retries: 99\n", 4, "tiers.remote.retries", "out of range"),
    ("    url: redis://h:1\n    namespace: 'a b'\n", 4, "tiers.remote.namespace", "namespace"),
    ("    url: redis://h:1\n    backend: memcached\n", 4, "tiers.remote.backend", "unknown"),
    ("    url: redis://h:1\n    capacity: -1GiB\n", 4, "tiers.remote.capacity", "positive"),
    ("    url: redis://h:1\n    compression: lz4\n", 4, "tiers.remote.compression", "unknown"),
    ("    url: redis://h:1\n    admission: reuse_gate\n    store_threshold: 3\n", 4,
     "tiers.remote.admission", "contradicts"),
    ("    url: redis://h:1\n    ttl: 3\n", 4, "tiers.remote.ttl", "unknown key"),
    ("    url: redis://h:1\n    lookup_ttl_s: 0\n", 4, "tiers.remote.lookup_ttl_s", "range"),
])
def test_bad_input_names_the_line_and_key(text, line, key, words):
    with pytest.raises(ConfigError) as err:
        remote(text)
    assert err.value.line == line and err.value.key == key
    assert words in str(err.value)


GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                    dtype="bfloat16", model="m")


def test_default_namespace_separates_whatever_changes_the_bytes():
    base = derive_namespace(GEO.fingerprint())
    other = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                          dtype="float16", model="m")
    assert derive_namespace(other.fingerprint()) != base
    assert derive_namespace(GEO.fingerprint(), world_size=2) != base
    assert derive_namespace(GEO.fingerprint(), hash_algorithm="xxhash") != base
    cfg = remote("    url: redis://127.0.0.1:1\n").remote
    r0, r1 = (connect_remote(cfg, GEO, rank=r, world_size=2) for r in (0, 1))
    try:
        assert r0.keys.namespace == r1.keys.namespace  # one instance, one namespace ...
        assert r0.keys.server_key(b"k") != r1.keys.server_key(b"k")  # ... a key per shard
    finally:
        r0.close(), r1.close()


def test_manager_reports_the_advisory_capacity_in_blocks():
    cfg = remote("    url: redis://127.0.0.1:1\n    capacity: 1MiB\n")

    class NoServer:  # a directory that never finds anything (no server is contacted)
        degraded, degradations = False, 0

        def query(self, keys):
            return [False] * len(keys)

        def known_present(self, key):
            return False

        known_held = known_present

    m = build_manager(cfg, 4096, remote=NoServer())
    assert m.usage()["REMOTE"]["capacity_blocks"] == 256
    assert m.lookup([b"a", b"b"]).num_hits == 0
