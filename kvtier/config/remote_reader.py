"""Reading ``tiers.remote`` from the collected YAML items into a :class:`RemoteTierConfig`.

Apart from :mod:`kvtier.config.remote` (the section's schema), which the generic reader and
the schema import: reading needs the reader, so keeping both in one file made a circle.
"""

from __future__ import annotations

from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode, SequenceNode

from kvtier.config.reader import _Reader
from kvtier.config.remote import (
    NAMESPACE_ALLOWED,
    NAMESPACE_PATTERN,
    NODE_ALLOWED,
    REMOTE_BACKENDS,
    URL_ALLOWED,
    RemoteTierConfig,
    node_problem,
    url_problem,
)
from kvtier.config.redact_url import redact_address


def _nodes(reader: _Reader, key: str) -> tuple[str, ...]:
    item = reader.items[key]
    value = item.value
    if isinstance(value, SequenceNode):
        out = []
        for child in value.value:
            if not isinstance(child, ScalarNode):
                reader.fail(key, item, "every node must be a HOST:PORT string", NODE_ALLOWED)
            out.append(SafeConstructor().construct_object(child))
        value = out
    elif isinstance(value, str):  # from the environment: comma separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        reader.fail(key, item, "must be a non-empty list of HOST:PORT strings", NODE_ALLOWED)
    for node in value:
        problem = node_problem(node)
        if problem:
            reader.fail(key, item, problem, NODE_ALLOWED)
    return tuple(value)


def build_remote(reader: _Reader, admissions: tuple[str, ...],
                 compressions: tuple[str, ...]) -> RemoteTierConfig:
    """``tiers.remote`` from the collected items; every problem is a ``ConfigError``."""
    items = reader.items
    has_url, has_nodes = "tiers.remote.url" in items, "tiers.remote.nodes" in items
    if has_url == has_nodes:
        key = "tiers.remote.nodes" if has_nodes else "tiers.remote"
        reader.fail(key, items[key], "give the server once: url (one server) or nodes "
                    "(a Cluster)", f"url: {URL_ALLOWED}, or nodes: {NODE_ALLOWED}")
    url = nodes = None
    if has_url:
        url = reader.get_str("tiers.remote.url", None, URL_ALLOWED)
        problem = url_problem(url)
        if problem:
            reader.fail("tiers.remote.url", items["tiers.remote.url"],
                        f"{problem}: {redact_address(url)!r}", URL_ALLOWED)
    else:
        nodes = _nodes(reader, "tiers.remote.nodes")
    namespace = reader.get_str("tiers.remote.namespace", None, NAMESPACE_ALLOWED, nullable=True)
    if namespace is not None and not NAMESPACE_PATTERN.match(namespace):
        reader.fail("tiers.remote.namespace", items["tiers.remote.namespace"],
                    f"not a valid namespace: {namespace!r}", NAMESPACE_ALLOWED)
    seconds = "a positive number of seconds (at most 60)"
    threshold = reader.get_int("tiers.remote.store_threshold", 1, 1, 1000)
    admission = reader.get_choice("tiers.remote.admission",
                                  "threshold" if threshold > 1 else "all", admissions,
                                  "admission policy")
    if threshold > 1 and admission != "threshold":
        reader.fail("tiers.remote.admission", items["tiers.remote.admission"],
                    f"{admission!r} contradicts store_threshold: {threshold}",
                    "threshold (or drop store_threshold)")
    password_file = reader.get_str("tiers.remote.password_file", None, "a file path",
                                   nullable=True)
    password_env = reader.get_str("tiers.remote.password_env", None,
                                  "the name of an environment variable", nullable=True)
    if password_file is not None and password_env is not None:
        reader.fail("tiers.remote.password_env", items["tiers.remote.password_env"],
                    "give the password once: password_file or password_env",
                    "one of password_file, password_env")
    capacity = None
    if items.get("tiers.remote.capacity") is not None and \
            items["tiers.remote.capacity"].value is not None:
        capacity = reader.get_size("tiers.remote.capacity", 0)
    return RemoteTierConfig(
        url=url, nodes=nodes or (),
        backend=reader.get_choice("tiers.remote.backend", "redis", REMOTE_BACKENDS,
                                  "remote backend"),
        namespace=namespace,
        connect_timeout_s=reader.get_float("tiers.remote.connect_timeout_s", 0.5, seconds,
                                           lambda s: 0 < s <= 60),
        timeout_s=reader.get_float("tiers.remote.timeout_s", 0.5, seconds,
                                   lambda s: 0 < s <= 60),
        retries=reader.get_int("tiers.remote.retries", 1, 0, 10),
        probe_interval_s=reader.get_float("tiers.remote.probe_interval_s", 2.0,
                                          "a positive number of seconds (at most 3600)",
                                          lambda s: 0 < s <= 3600),
        compression=reader.get_choice("tiers.remote.compression", "none", compressions,
                                      "compression"),
        zstd_level=reader.get_int("tiers.remote.zstd_level", 1, 1, 22),
        admission=admission,
        store_threshold=threshold,
        capacity=capacity,
        max_writes_in_flight=reader.get_int("tiers.remote.max_writes_in_flight", 256, 1,
                                            1 << 20),
        # an answer must outlive the step between vLLM's lookup and its load planning
        lookup_ttl_s=reader.get_float("tiers.remote.lookup_ttl_s", 2.0,
                                      "a number of seconds from 0.1 to 3600",
                                      lambda s: 0.1 <= s <= 3600),
        io_processes=reader.get_int("tiers.remote.io_processes", 8, 1, 64),
        connections=reader.get_int("tiers.remote.connections", 4, 1, 64),
        username=reader.get_str("tiers.remote.username", None, "an ACL user name",
                                nullable=True),
        password_file=password_file,
        password_env=password_env,
        tls=reader.get_bool("tiers.remote.tls", False),
        tls_ca_file=reader.get_str("tiers.remote.tls_ca_file", None, "a file path",
                                   nullable=True),
        auth_key_file=reader.get_str("tiers.remote.auth_key_file", None, "a file path",
                                     nullable=True),
        allow_unlisted_nodes=reader.get_bool("tiers.remote.allow_unlisted_nodes", None,
                                             nullable=True),
        # a lookup pending longer holds its request back: a miss costs a recompute, not this
        lookup_deadline_s=reader.get_float("tiers.remote.lookup_deadline_s", 0.5,
                                           "a number of seconds from 0.01 to 1",
                                           lambda s: 0.01 <= s <= 1.0),
    )
