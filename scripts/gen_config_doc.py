"""Write docs/configuration.md from kvtier's config loader, so the reference cannot drift.

Everything a reader needs to trust comes from the code, not from this file:
- the keys: the loader's own table of accepted keys per section (``kvtier.config.reader``);
- the defaults: read back from a config loaded with every optional section present and empty;
- the allowed values: the loader's own ``ConfigError.allowed`` for a value no key accepts;
- the environment variables: ``kvtier.config.env.ENV_OVERRIDES``;
- the vLLM ``kv_connector_extra_config`` keys: ``kvtier.connectors.vllm.settings.EXTRA_KEYS``.
Only the one-line meanings are written here. A key without a meaning, or a meaning for a key the
loader does not accept, stops the script with an error naming it, so a new key cannot go
undocumented and a removed one cannot linger.

Run: ``python scripts/gen_config_doc.py`` (writes the page) or ``--check`` (exit 1 when the
committed page differs from what the code gives; tests/docs runs this).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from doc_page import parse_args, write_or_check  # noqa: E402
from kvtier.config import ConfigError, load_config  # noqa: E402
from kvtier.config.env import ENV_OVERRIDES  # noqa: E402
# The loader's key table is module-private; documenting it is exactly what it is for here.
from kvtier.config.reader import _LAYOUT, _OPTIONAL_SECTIONS, SIZE_ALLOWED  # noqa: E402
from kvtier.config.sizes import format_size  # noqa: E402
from kvtier.connectors.vllm.settings import (  # noqa: E402
    DEFAULT_SYNC_LOAD_BUDGET,
    DEFAULT_STORE_EVERY_STEPS,
    DEFAULT_WHOLE_TAIL_LAYER_BYTES,
    EXTRA_KEYS,
)

OUT = ROOT / "docs" / "configuration.md"

SECTIONS = {
    "": "Keys outside any section.",
    "tiers": "The tiers below the GPU. Only `cpu` is always on.",
    "tiers.cpu": "Pinned CPU memory: one pool of fixed-size slots, per GPU worker (rank).",
    "tiers.disk": "Local disk: segment files behind an LMDB index, per rank "
                  "(`<path>/rank<r>` with tensor parallelism). See [reliability](reliability.md).",
    "tiers.remote": "The tier shared by many instances on Redis or Valkey. "
                    "See [shared tier](shared-tier.md).",
    "tiers.host": "One CPU pool per host shared by every instance on it: each instance's "
                  "CPU tier is its region of the pool, and what one stored is a CPU hit for "
                  "the others. See [host tier](host-tier.md).",
    "admission": "Which of a request's blocks are offloaded at all.",
    "stats": "The live stats snapshot `kvtier stats` reads.",
    "events": "kvtier's KV-event stream (vLLM's wire format). "
              "See [events and metrics](events-and-metrics.md).",
    "metrics": "The Prometheus endpoint `http://host:port/metrics`.",
    "cost": "Cost-aware loading with a fixed recompute speed instead of the measured one. "
            "See [placement](placement.md#cost-aware-loading).",
}

MEANINGS = {
    "block_tokens": "Tokens per kvtier block. Left out, vLLM's connector takes vLLM's "
                    "block size (`--block-size`; 64 by default on vLLM 0.34, 16 before); set, "
                    "it must be a multiple of it (equal to it for hybrid models).",
    "gil_switch_interval_ms": "Python's GIL switch interval while kvtier runs in the process "
                              "(0 leaves Python's 5 ms); restored when kvtier closes. Short, so "
                              "kvtier's threads get the GIL soon beside vLLM's busy engine loop. "
                              "Without a disk or shared tier, Python's is put back while vLLM "
                              "leaves requests waiting (a saturated engine).",
    "tiers.cpu.capacity": "Pool size per rank. Refused above the machine's physical memory.",
    "tiers.cpu.eviction": "Eviction policy.",
    "tiers.cpu.pin": "Pin the pool (page-locked) for fast GPU copies; null pins when CUDA is "
                     "available.",
    "tiers.cpu.admission": "Which new blocks are written: every one, from the 2nd sighting, or "
                           "by the measured reuse gate ([placement](placement.md)).",
    "tiers.cpu.pin_wait_s": "How long vLLM's start-up (after its CUDA graph capture) waits for "
                            "the pool to finish pinning; what is left pins while the server "
                            "serves, which holds up the engine's CUDA calls (its first requests "
                            "wait). 0: pin entirely in the background.",
    "tiers.cpu.store_copy": "How a store copies GPU pages into the pool: `kernel` gathers "
                            "them with a copy kernel into a staging ring, then DMA; `dma` "
                            "hands the whole store to the GPU's copy engines as one batched "
                            "copy (`cuMemcpyBatchAsync`, CUDA 12.8+ driver, pinned pool; "
                            "else the kernel), taking no SMs from the forward. The default "
                            "follows a serving A/B on a GPU (`benchmarks/serving.py "
                            "--kvtier-json '{\"tiers\":{\"cpu\":{\"store_copy\":\"dma\"}}}'`).",
    "tiers.host.capacity": "The whole pool, the same on every instance of the host: at least "
                           "the sum of their `tiers.cpu.capacity` (each one's region). "
                           "Required.",
    "tiers.host.dir": "Directory of the host tier's socket: it must belong to the user and let "
                      "nobody else in (0700; 0770 with `group`). Default "
                      "`/dev/shm/kvtier-host-<uid>`.",
    "tiers.host.group": "A group whose members' instances may share the pool (the directory "
                        "becomes 0770 and the service admits the group); null: the user only.",
    "tiers.host.idle_exit_s": "The service (started by the first instance) exits this long "
                              "after the last instance left, and the pool's memory with it; "
                              "0: never.",
    "tiers.disk.path": "Directory of the store (required). Created 0700 with its parents; "
                       "relative paths are relative to the YAML file.",
    "tiers.disk.capacity": "Logical (uncompressed) bytes the tier holds, per rank.",
    "tiers.disk.eviction": "Eviction policy.",
    "tiers.disk.compression": "Per-block compression; a block that does not shrink is stored raw.",
    "tiers.disk.zstd_level": "zstd level when `compression: zstd`.",
    "tiers.disk.fsync": "fdatasync segment data before its index entry commits (acknowledged "
                        "blocks survive power loss).",
    "tiers.disk.segment_bytes": "Segment file size before the next one is started.",
    "tiers.disk.store_threshold": "Demote a block to disk only once it was seen this many times "
                                  "(above 1 implies `admission: threshold`).",
    "tiers.disk.admission": "Which blocks are written back to disk.",
    "tiers.disk.io_process": "Serve the store from a child process of each worker, so "
                             "write-back takes no GIL time from vLLM's engine loop.",
    "tiers.disk.request_timeout_s": "Deadline of a request to the disk I/O child (per "
                                    "started 256 MiB moved); a child past it is declared "
                                    "hung, killed and replaced, and its load is recomputed.",
    "tiers.remote.backend": "Client library; Redis and Valkey both speak it.",
    "tiers.remote.url": "One server. Exactly one of `url` and `nodes`.",
    "tiers.remote.nodes": "Start-up nodes of a Cluster. Exactly one of `url` and `nodes`.",
    "tiers.remote.namespace": "Key prefix; null derives it from model, dtype, block geometry, "
                              "TP layout and hash, so instances that could misread each other "
                              "never share keys.",
    "tiers.remote.connect_timeout_s": "Connection timeout.",
    "tiers.remote.timeout_s": "Socket timeout per command: a hung server costs at most this "
                              "per try.",
    "tiers.remote.retries": "Extra tries after a connection error or timeout.",
    "tiers.remote.probe_interval_s": "While degraded: one PING this often, nothing else.",
    "tiers.remote.compression": "Per-value compression; values are readable either way.",
    "tiers.remote.zstd_level": "zstd level when `compression: zstd`.",
    "tiers.remote.admission": "Which blocks are written to the shared tier.",
    "tiers.remote.store_threshold": "Write a block only once it was seen this many times.",
    "tiers.remote.capacity": "Advisory: reported, never enforced. The budget is the server's "
                             "`maxmemory`.",
    "tiers.remote.max_writes_in_flight": "Blocks being written to the server at once; more "
                                         "wait in a backlog (up to the CPU tier's size).",
    "tiers.remote.lookup_ttl_s": "How long a presence answer from the server is trusted.",
    "tiers.remote.io_processes": "Child processes per worker that move block bytes to and "
                                 "from the server; one hit's blocks are split across them "
                                 "(more: a single hit loads faster).",
    "tiers.remote.connections": "Connections of each I/O process to each server node; one "
                                "hit's blocks are spread over them.",
    "tiers.remote.username": "ACL user name.",
    "tiers.remote.password_file": "File whose first line is the password (never the YAML "
                                  "itself). At most one of `password_file` and `password_env`.",
    "tiers.remote.password_env": "Environment variable holding the password.",
    "tiers.remote.tls": "TLS to every node (`rediss://` in `url` says the same).",
    "tiers.remote.tls_ca_file": "CA bundle that signed the servers' certificates.",
    "tiers.remote.auth_key_file": "Key of the keyed MAC every stored value carries; values "
                                  "without a valid MAC read as misses.",
    "tiers.remote.allow_unlisted_nodes": "Whether a Cluster node the slot map names but "
                                         "`nodes` does not list gets credentials and values; "
                                         "null: only with TLS (host names checked). A refused "
                                         "node's keys read as misses.",
    "tiers.remote.lookup_deadline_s": "A presence lookup not answered within this is a miss "
                                      "(the request recomputes rather than wait).",
    "admission.store_threshold": "Store a block after it was seen this many times.",
    "admission.offload_ratio": "Fraction of each prompt's blocks offloaded, front first.",
    "admission.max_offload_tokens": "At most this many tokens of each prompt are offloaded; "
                                    "null: no limit.",
    "stats.snapshot_path": "Where the running instance writes its stats JSON; null: "
                           "`<tiers.disk.path>/kvtier-stats.json`, or none without a disk tier.",
    "stats.interval_s": "How often the snapshot is rewritten.",
    "events.endpoint": "ZMQ PUB socket the batches go out on.",
    "events.replay_endpoint": "ZMQ ROUTER for late consumers asking for missed batches; "
                              "null: none.",
    "events.topic": "First frame of every message.",
    "events.buffer_batches": "Batches kept for replay.",
    "events.allow_remote": "Allow a tcp host other than loopback (events name cached "
                           "blocks and tokens).",
    "events.max_subscribers": "Subscriber connections the publisher serves at once; more are "
                              "closed.",
    "events.subscriber_max_bytes": "Bytes queued for one subscriber that does not keep up.",
    "events.replay_max_bytes": "Bytes the replay buffer holds (with `buffer_batches`, whichever "
                               "is reached first).",
    "events.replay_max_clients": "Replay clients connected at once.",
    "events.replay_client_max_bytes": "Bytes queued for one replay client.",
    "events.stall_timeout_s": "A client that reads nothing for this long is dropped.",
    "metrics.port": "Port of `/metrics`; 0 takes any free port (the snapshot records it).",
    "metrics.host": "Address to bind; 0.0.0.0 exposes it to the network.",
    "cost.recompute_us_per_token": "The engine's prefill time per token. Exactly one of this "
                                   "and `recompute_tokens_per_s`.",
    "cost.recompute_tokens_per_s": "The engine's prefill speed. Exactly one of this and "
                                   "`recompute_us_per_token`.",
    "cost.prior_load_gbps": "Load bandwidth assumed for a tier until its loads are measured.",
}

EXTRA_MEANINGS = {
    "config": "Path of a kvtier YAML file (this page's keys).",
    "kvtier": "The same keys inline, as a mapping. Give `config` or `kvtier`, not both; "
              "neither means the defaults.",
    "sync_load_budget_bytes": "CPU hits up to this many bytes per engine step (per rank) load "
                              "inside the step that computes their request; larger ones load "
                              "asynchronously (disk and shared-tier hits are promoted into CPU "
                              "memory first, then load as CPU hits). Bytes or a "
                              "size such as `\"2GiB\"`; 0 loads every hit asynchronously. "
                              f"Default {format_size(DEFAULT_SYNC_LOAD_BUDGET)}.",
    "whole_tail_layer_bytes": "A hit that reaches the prompt's last token is loaded whole (the "
                              "step computes one token) up to this many bytes of hit per "
                              "layer; a larger one stops a block short, so the forward can "
                              "follow the copy layer by layer. Bytes or a size. Default "
                              f"{format_size(DEFAULT_WHOLE_TAIL_LAYER_BYTES)}.",
    "same_thread_fast_path": "With TP 1 (vLLM's uni-process executor), the scheduler starts a "
                             "CPU hit's copy at its lookup and hands the load to the worker "
                             "as soon as it is planned; `false` leaves it to the worker's "
                             "first hook of the step. `true` or `false`; default `true`.",
    "store_every_steps": "Running requests' decoded blocks (a block per request every "
                         "`block_tokens` tokens) are stored every this many engine steps, as "
                         "one copy; a prompt's blocks and a finished request's last blocks "
                         "are stored at once. A store copy costs vLLM's engine thread a fixed "
                         "amount of CUDA calls whatever its size, so a copy at every decode "
                         "step slows every step past saturation. A whole number from 1 (every "
                         f"step) to 1024; default {DEFAULT_STORE_EVERY_STEPS}.",
    "offload_prompt_only": "Store only the blocks a prompt fills, never those filled by "
                           "generated tokens. `true` (the default, as vLLM's native connector's "
                           "since 0.34): a chat's next turn stores the answer with its own "
                           "prompt, and once the working set outgrows the CPU tier an answer's "
                           "room costs more hits than it adds. `false` stores decoded blocks "
                           "too: a few more hits when the whole working set fits in the tier. "
                           "`true` or `false`.",
}

NOT_A_DEFAULT = {
    "tiers.disk.path": "required",
    "tiers.host.capacity": "required",
    "tiers.remote.url": "one of url / nodes",
    "tiers.remote.nodes": "one of url / nodes",
    "cost.recompute_us_per_token": "one of the two",
    "cost.recompute_tokens_per_s": "one of the two",
}
"""Keys set only so that the probe config loads; their loaded value is the probe's, not a
default, so the page says this instead."""

CONTEXT_DEFAULTS = {
    "block_tokens": "vLLM's block size (`16` outside vLLM)",
}
"""Keys whose default depends on where kvtier runs; the loaded value is only one of them."""

EXCLUSIVE = {
    "tiers.remote.nodes": "tiers.remote.url",
    "cost.recompute_tokens_per_s": "cost.recompute_us_per_token",
}
"""Probing the key on the left needs the key on the right gone (exactly one of them loads)."""

UNACCEPTABLE = [["probe"]]
"""A value no key accepts (a list of lists): the loader's error for it says what is allowed."""


def _probe_config(disk_dir: str) -> dict[str, Any]:
    """A config with every optional section present and only its required keys set."""
    return {
        "tiers": {"disk": {"path": disk_dir}, "remote": {"url": "redis://127.0.0.1:6379"},
                  "host": {"capacity": "4GiB"}},
        "events": {},
        "metrics": {},
        "cost": {"recompute_us_per_token": 1.0},
    }


def config_keys() -> list[str]:
    """Every leaf key the loader accepts, section by section, in the loader's order."""
    keys = []
    for section, names in _LAYOUT.items():
        for name in names:
            key = f"{section}.{name}" if section else name
            if key not in _LAYOUT:
                keys.append(key)
    return keys


def _set(tree: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for step in path:
        tree = tree.setdefault(step, {})
    tree[last] = value


def _drop(tree: dict, key: str) -> None:
    *path, last = key.split(".")
    for step in path:
        tree = tree[step]
    tree.pop(last, None)


def allowed_values(key: str, disk_dir: str) -> str:
    """What the loader says it accepts for ``key``, from its error for an unacceptable value."""
    data = _probe_config(disk_dir)
    if key in EXCLUSIVE:
        _drop(data, EXCLUSIVE[key])
    _set(data, key, UNACCEPTABLE)
    try:
        load_config(data=data, env={})
    except ConfigError as exc:
        if exc.key != key or not exc.allowed:
            raise SystemExit(f"gen_config_doc: probing {key} failed at {exc.key}: {exc}")
        return exc.allowed
    raise SystemExit(f"gen_config_doc: {key} accepted {UNACCEPTABLE!r}; cannot read what it allows")


def _attribute(config: Any, key: str) -> Any:
    """The loaded value of ``key``: sections map to attributes by their last name
    (``tiers.cpu`` -> ``config.cpu``); ``cost.recompute_tokens_per_s`` is stored as per-token
    microseconds, so it has no value of its own."""
    *section, name = key.split(".")
    node = config
    if section:
        node = getattr(config, section[-1])
    return getattr(node, name, None)


def _show(value: Any, allowed: str) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and allowed.startswith(SIZE_ALLOWED):
        return f"`{format_size(value).replace(' ', '')}`"
    if isinstance(value, str):
        return f"`{value!r}`" if value == "" else f"`{value}`"
    return f"`{value}`"


def defaults(disk_dir: str) -> Any:
    return load_config(data=_probe_config(disk_dir), env={})


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    keys = config_keys()
    missing = [k for k in keys if k not in MEANINGS]
    stale = [k for k in MEANINGS if k not in keys]
    if missing or stale:
        raise SystemExit("gen_config_doc: config keys without a meaning in "
                         f"scripts/gen_config_doc.py: {missing}; meanings of keys the loader "
                         f"does not accept: {stale}")
    sections = [s for s in _LAYOUT if s not in SECTIONS] + [s for s in SECTIONS if s not in _LAYOUT]
    extra_off = sorted(set(EXTRA_KEYS) ^ set(EXTRA_MEANINGS))
    if sections or extra_off:
        raise SystemExit(f"gen_config_doc: sections or extra-config keys out of step: "
                         f"{sections} {extra_off}")
    env_of = {key: var for var, (key, _) in ENV_OVERRIDES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        disk_dir = str(Path(tmp) / "disk")
        loaded = defaults(disk_dir)
        allowed = {key: allowed_values(key, disk_dir) for key in keys}
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_doc.py from kvtier/config: do not edit by hand. "
        "tests/docs checks that this file is what the script writes. -->",
        "",
        "A kvtier config is a YAML file (or the same keys inline in vLLM's "
        "`kv_connector_extra_config`). Unknown keys, bad values and out-of-range numbers are "
        "refused with one error naming the file, line, key and what is allowed, e.g. "
        "`kvtier.yaml:3: tiers.cpu.capacty: unknown key (did you mean 'capacity'?)`. Nothing is "
        "created until the whole config is valid. Sizes are written `512MiB`, `32GiB`, `2TB` or "
        "plain bytes (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB and a bare K/M/G/T powers "
        "of 1024).",
        "",
        "Sections marked *optional* are off unless present; a `KVTIER_*` variable for one of "
        "their keys turns them on. The variable in a key's *environment* column wins over the "
        "file or inline config (an empty value counts as unset).",
        "",
    ]
    for section, names in _LAYOUT.items():
        leaves = [f"{section}.{n}" if section else n for n in names]
        leaves = [k for k in leaves if k not in _LAYOUT]
        if not leaves:
            continue
        title = f"`{section}`" if section else "Top level"
        optional = " (optional)" if section in _OPTIONAL_SECTIONS else ""
        lines += [f"## {title}{optional}", "", SECTIONS[section], "",
                  "| key | meaning | default | allowed | environment |",
                  "|---|---|---|---|---|"]
        for key in leaves:
            default = (NOT_A_DEFAULT.get(key) or CONTEXT_DEFAULTS.get(key)
                       or _show(_attribute(loaded, key), allowed[key]))
            env = f"`{env_of[key]}`" if key in env_of else ""
            lines.append(f"| `{key}` | {_cell(MEANINGS[key])} | {default} | "
                         f"{_cell(allowed[key])} | {env} |")
        lines.append("")
    lines += [
        "## vLLM `kv_connector_extra_config`",
        "",
        "The keys kvtier reads from `--kv-transfer-config`'s `kv_connector_extra_config` "
        "(any other key is refused at start-up). See [vLLM integration](vllm.md).",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_cell(EXTRA_MEANINGS[k])} |" for k in EXTRA_KEYS]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], OUT, argv)
    return write_or_check(args.out, render(), args.check, "scripts/gen_config_doc.py")


if __name__ == "__main__":
    sys.exit(main())
