"""What both halves of the connector derive from vLLM's config, identically.

The scheduler (engine-core process) and every worker build their own connector instance and
share nothing but the per-step metadata, so anything both must agree on — the kvtier config,
block size in tokens, bytes per block, the disk geometry fingerprint — is computed here from
``VllmConfig`` + ``KVCacheConfig`` by one function both roles call.

Refusals happen here, at start-up, with the setting to change: cache kinds without one page
per block and layer (chunked-local attention), Mamba/SSM state groups vLLM keeps no prefix
state for (:mod:`state_groups`), pipeline or context parallelism, a kvtier block that is not
a whole number of vLLM blocks. Hybrid models (full-attention, sliding-window and Mamba/SSM
state groups of vLLM's hybrid allocator) are served per group (:mod:`group_keys`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from kvtier.config import KvtierConfig, load_config
from kvtier.config.sizes import parse_size
from kvtier.connectors.vllm.compat import load_failures
from kvtier.connectors.vllm.state_groups import (STATE_KIND, is_state_spec, state_page_bytes,
                                                 state_spec_problem)
from kvtier.tiers.layout import BlockGeometry

log = logging.getLogger(__name__)

EXTRA_KEYS = ("config", "kvtier", "sync_load_budget_bytes", "whole_tail_layer_bytes",
              "same_thread_fast_path", "store_every_steps", "offload_prompt_only")
DEFAULT_SYNC_LOAD_BUDGET = 4 << 30
"""Per engine step, CPU hits up to this many bytes (per rank) load inside the step that
computes their request (see ``scheduler/side.py``); 4 GiB covers a 32k-token Llama-8B prefix."""
DEFAULT_WHOLE_TAIL_LAYER_BYTES = 24 << 20
"""A hit reaching the prompt's last token loads its last block whole (one token computed) up
to this many bytes of hit per layer; beyond it the hit is cut a block short, so the forward's
layers can follow the copy layer by layer (``scheduler/side.py``'s ``claim`` says why; figures:
docs/design-measurements.md)."""
DEFAULT_STORE_EVERY_STEPS = 4
"""Running requests' completed blocks are planned as stores every this many engine steps
(a finished request's at once): each store copy costs vLLM's engine thread a fixed amount of
CUDA calls, whatever its size, so a store every step puts that cost on every decode step
(``scheduler/side.py`` says why; figures: docs/design-measurements.md)."""
HMA_FLAG = "--disable-hybrid-kv-cache-manager"
UNSTABLE_HASHES = ("xxhash", "xxhash_cbor")  # random per-process seed unless PYTHONHASHSEED


class ConnectorSetupError(ValueError):
    """The engine's configuration cannot be served by kvtier; the message says what to change."""


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group as events describe it (vLLM's spec kind, window in tokens)."""

    kind: str
    sliding_window: int | None = None

    @property
    def is_state(self) -> bool:
        """A Mamba/SSM state group (:mod:`state_groups`)."""
        return self.kind == STATE_KIND


@dataclass(frozen=True)
class ConnectorSettings:
    config: KvtierConfig
    block_size: int  # vLLM tokens per engine block
    hash_block_size: int  # tokens per entry of request.block_hashes
    block_tokens: int  # tokens per kvtier block (a multiple of both)
    layer_names: tuple[str, ...]  # the KV cache group's layers, in the group's order
    page_bytes: int  # bytes of one engine block of one layer (one rank)
    sliding_window: int | None  # tokens, when the only group is a sliding-window group
    world_size: int  # workers that each report every job
    tp_size: int
    kv_dtype: str  # dtype of the cache pages (informational part of the geometry)
    identity: str  # what the disk fingerprint binds blocks to (model, dtype, hashing, ...)
    sync_load_budget_bytes: int = DEFAULT_SYNC_LOAD_BUDGET
    whole_tail_layer_bytes: int = DEFAULT_WHOLE_TAIL_LAYER_BYTES  # per layer of the hit
    same_thread_fast_path: bool = True  # TP 1: the scheduler starts copies early (fast_path)
    store_every_steps: int = DEFAULT_STORE_EVERY_STEPS  # running requests' stores: cadence
    offload_prompt_only: bool = True  # store prompt blocks only, never decoded ones
    vllm_kv_events: bool = True  # vLLM publishes KV events: take_events must describe blocks
    groups: tuple[GroupInfo, ...] = ()  # vLLM's KV cache groups (several: hybrid allocator)
    replicated_kv: bool = False  # MLA: every TP rank holds the same bytes (shared tier: once)
    engine_id: str = ""  # vLLM's engine id: a worker in the scheduler's process (fast_path)
    state_layers: tuple[str, ...] = ()  # layers of Mamba/SSM state groups (state_groups.py)
    # vLLM zeroes the new blocks of a synchronous hit in the worker after the connector's
    # load was enqueued (Mamba or mixed-precision caches): hits must load asynchronously
    zeroes_new_blocks: bool = False
    max_num_seqs: int = 0  # vLLM's cap on running requests (0: not known)

    @property
    def fails_per_request(self) -> bool:
        """A failed load is reported as its request (``failed_recving``), never as engine
        block ids: several KV cache groups, whose block ids vLLM cannot map back to requests
        (it raises on them), on a vLLM that takes requests (:mod:`compat.load_failures`)."""
        return load_failures.per_request(len(self.groups))

    @property
    def async_loads_only(self) -> bool:
        """Every hit loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS):
        where vLLM zeroes a synchronous hit's new blocks over the copy (``zeroes_new_blocks``),
        and where a failed load can only be reported by request (``fails_per_request``),
        since vLLM restarts only a request still waiting for its load: a synchronous load's
        forward has run on its blocks by the time its failure is known, and its block ids
        would end the engine."""
        return self.zeroes_new_blocks or self.fails_per_request

    @property
    def engine_blocks_per_block(self) -> int:
        return self.block_tokens // self.block_size

    @property
    def hashes_per_block(self) -> int:
        return self.block_tokens // self.hash_block_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def geometry(self, tp_rank: int) -> BlockGeometry:
        """The byte geometry of one rank's blocks; the rank is part of the identity because
        tensor-parallel ranks hold different heads of the same block."""
        return BlockGeometry(
            num_layers=self.num_layers,
            kv_parts=1,  # vLLM 0.32 keeps K and V side by side inside one page
            engine_blocks_per_block=self.engine_blocks_per_block,
            page_bytes=self.page_bytes,
            dtype=self.kv_dtype,
            model=f"{self.identity};tp={tp_rank}/{self.tp_size}",
        )

    @functools.cached_property
    def block_bytes(self) -> int:  # read on every lookup and store: computed once
        return self.geometry(0).block_bytes

    def rank_config(self, tp_rank: int) -> KvtierConfig:
        """The config one worker runs: with several workers, each gets its own disk directory
        (``<path>/rank<r>``), since each holds a different slice of every block."""
        if self.config.disk is None or self.world_size <= 1:
            return self.config
        disk = replace(self.config.disk, path=self.config.disk.path / f"rank{tp_rank}")
        return replace(self.config, disk=disk)

    @property
    def replicated(self) -> bool:
        """Every rank holds the same bytes (MLA) and there are several: each block is stored
        once, by rank 0, in the disk and the shared tiers."""
        return self.replicated_kv and self.world_size > 1

    def disk_ranks(self) -> list[int]:
        """The ranks whose disk directories hold blocks: every rank's, or rank 0's alone for
        a replicated layout (the other ranks read it; see tiers/disk/io/replicated.py)."""
        if self.config.disk is None:
            return []
        return [0] if self.replicated else list(range(self.world_size))

    def disk_paths(self) -> list[Path]:
        """The disk directories the scheduler reads at start-up (see ``disk_ranks``)."""
        return [self.rank_config(r).disk.path for r in self.disk_ranks()]

    def disk_geometries(self) -> list[BlockGeometry]:
        """The geometry each of ``disk_paths`` was written for."""
        return [self.geometry(r) for r in self.disk_ranks()]


def _extra_bytes(extra: Mapping[str, Any] | None, key: str, default: int) -> int:
    """``kv_connector_extra_config[key]``: a byte count >= 0 (``"2GiB"`` works too)."""
    value = (extra or {}).get(key, default)
    try:
        n = parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ConnectorSetupError(f"kv_connector_extra_config.{key}: {exc}") from None
    if n < 0:
        raise ConnectorSetupError(f"kv_connector_extra_config.{key} must be >= 0")
    return n


def sync_load_budget(extra: Mapping[str, Any] | None) -> int:
    """``kv_connector_extra_config.sync_load_budget_bytes``: bytes (``"2GiB"`` works too) of
    CPU hits per step loaded synchronously; 0 loads every hit asynchronously."""
    return _extra_bytes(extra, "sync_load_budget_bytes", DEFAULT_SYNC_LOAD_BUDGET)


def _extra_bool(extra: Mapping[str, Any] | None, key: str, default: bool) -> bool:
    value = (extra or {}).get(key, default)
    if not isinstance(value, bool):
        raise ConnectorSetupError(f"kv_connector_extra_config.{key} must be true or false, "
                                  f"got {value!r}")
    return value


def same_thread_fast_path(extra: Mapping[str, Any] | None) -> bool:
    """``kv_connector_extra_config.same_thread_fast_path``: with TP 1, the scheduler side
    starts a CPU hit's copy at the lookup and submits it when planned (:mod:`fast_path`);
    false: the worker submits it at its first hook of the step. Default true."""
    return _extra_bool(extra, "same_thread_fast_path", True)


def offload_prompt_only(extra: Mapping[str, Any] | None) -> bool:
    """``kv_connector_extra_config.offload_prompt_only``: store only the blocks a prompt fills,
    never those filled by generated tokens. Default true, as vLLM's native connector's since
    0.34: a chat's next turn stores the answer with its own prompt anyway, and once the
    working set outgrows the CPU tier the room an answer takes costs more hits than it adds
    (``benchmarks/results/policy_vs_native_cpu.md``). False stores decoded blocks too: a few
    more hits when everything fits in the tier."""
    return _extra_bool(extra, "offload_prompt_only", True)


def store_every_steps(extra: Mapping[str, Any] | None) -> int:
    """``kv_connector_extra_config.store_every_steps``: running requests' completed blocks
    are stored every this many engine steps (``DEFAULT_STORE_EVERY_STEPS``); 1: every step."""
    value = (extra or {}).get("store_every_steps", DEFAULT_STORE_EVERY_STEPS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        raise ConnectorSetupError("kv_connector_extra_config.store_every_steps must be a whole "
                                  f"number of engine steps from 1 to 1024, got {value!r}")
    return value


def whole_tail_layer_bytes(extra: Mapping[str, Any] | None) -> int:
    """``kv_connector_extra_config.whole_tail_layer_bytes``: bytes per layer of a hit up to
    which its last block is loaded whole (``DEFAULT_WHOLE_TAIL_LAYER_BYTES``); 0: never."""
    return _extra_bytes(extra, "whole_tail_layer_bytes", DEFAULT_WHOLE_TAIL_LAYER_BYTES)


def load_kvtier_config(extra: Mapping[str, Any] | None) -> KvtierConfig:
    """``kv_connector_extra_config``: ``{"config": "/path.yaml"}`` or ``{"kvtier": {...}}``
    (the YAML's keys inline); neither means defaults. ``KVTIER_*`` variables override both."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConnectorSetupError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; kvtier reads "
            f"'config' (path of a kvtier YAML file) or 'kvtier' (the YAML's keys inline), "
            f"and {', '.join(repr(k) for k in EXTRA_KEYS[2:])}"
        )
    if "config" in extra and "kvtier" in extra:
        raise ConnectorSetupError(
            "kv_connector_extra_config: give either 'config' (a YAML path) or 'kvtier' (inline), "
            "not both"
        )
    if "config" in extra:
        path = extra["config"]
        if not isinstance(path, (str, os.PathLike)):
            raise ConnectorSetupError("kv_connector_extra_config.config must be a file path")
        return load_config(path)
    if "kvtier" in extra:
        data = extra["kvtier"]
        if not isinstance(data, Mapping):
            raise ConnectorSetupError(
                "kv_connector_extra_config.kvtier must be a mapping of kvtier config keys"
            )
        return load_config(data=data)
    return load_config()


def _model_identity(vllm_config: Any, spec: Any, layout: str | None, hash_algo: str) -> str:
    """Everything that changes the bytes stored under one block hash, or what a hash means."""
    mc = vllm_config.model_config
    try:
        hf = mc.hf_config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config that cannot be dumped still has a repr
        hf = repr(mc.hf_config)
    parts = {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_config": hashlib.sha256(hf.encode()).hexdigest()[:16],
        "dtype": str(mc.dtype),
        "kv_dtype": str(spec.dtype).replace("torch.", ""),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "layout": str(layout),
        "block_size": str(spec.block_size),
        "hash": hash_algo,
        "hashseed": os.environ.get("PYTHONHASHSEED", "unset"),
    }
    return ";".join(f"{k}={v}" for k, v in parts.items())


def _check_spec(spec: Any) -> int | None:
    """The group's spec must keep one dense page per engine block per layer; returns the
    sliding window (tokens) of a sliding-window group, else None."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kind = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec) and kind in ("SlidingWindowSpec",):
        return int(spec.sliding_window)
    if isinstance(spec, FullAttentionSpec) and kind in (
        "FullAttentionSpec", "MLAAttentionSpec"
    ):
        if getattr(spec, "attention_chunk_size", None):
            raise ConnectorSetupError(
                "kvtier: chunked-local attention caches are not supported; start vLLM with "
                f"{HMA_FLAG} (every layer is then cached as full attention)")
        return None
    raise ConnectorSetupError(
        f"kvtier: KV cache spec {kind} is not supported (supported: full attention, MLA, "
        "sliding window, Mamba/SSM state with prefix caching)"
    )


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``): only then do kvtier's events
    need token ids and wire hashes on vLLM's path, a cost per block on every hit."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def _hybrid_groups(groups: list, windows: list[int | None]) -> tuple[GroupInfo, ...]:
    """Several groups (vLLM's hybrid allocator): same block size and page size in every
    group, as the allocator guarantees (a state group's page is padded to the attention
    page); each group's kind for events and the log."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    specs = [g.kv_cache_spec for g in groups]
    pages = {state_page_bytes(s) if is_state_spec(s) else int(s.real_page_size_bytes)
             for s in specs}
    if len({int(s.block_size) for s in specs}) > 1 or len(pages) > 1:
        raise ConnectorSetupError(
            "kvtier: KV cache groups with different block or page sizes are not supported; "
            f"start vLLM with {HMA_FLAG}")
    return tuple(GroupInfo(str(get_kv_cache_spec_kind(s).value), w)
                 for s, w in zip(specs, windows))


def block_tokens(config: KvtierConfig, block_size: int, hash_block_size: int) -> int:
    """Tokens per kvtier block: vLLM's block size unless the config sets ``block_tokens``
    (vLLM 0.34's default block size is 64, earlier releases' 16: kvtier follows whichever
    the engine runs, so no ``--block-size`` has to match a config). A set value must be a
    whole number of vLLM blocks and hash blocks; one that is not is refused in one line."""
    unit = math.lcm(block_size, hash_block_size)
    if not config.given("block_tokens"):
        return unit
    bt = config.block_tokens
    if bt % unit:
        raise ConnectorSetupError(
            f"kvtier: block_tokens={bt} must be a multiple of vLLM's block size {unit}, "
            "or be unset")
    return bt


def derive_settings(vllm_config: Any, kv_cache_config: Any) -> ConnectorSettings:
    kvt = vllm_config.kv_transfer_config
    extra = kvt.kv_connector_extra_config if kvt is not None else None
    config = load_kvtier_config(extra)
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if not groups:
        raise ConnectorSetupError("kvtier: the model has no KV cache group to offload")
    attention = [g for g in groups if not is_state_spec(g.kv_cache_spec)]
    if not attention:
        raise ConnectorSetupError("kvtier: a model with Mamba/SSM state groups only is not "
                                  "supported (a hit needs attention blocks); serve it without "
                                  "kvtier's --kv-transfer-config")
    spec = attention[0].kv_cache_spec  # the geometry, dtype and identity come from attention
    block_size = int(spec.block_size)
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    for g in groups:
        problem = (state_spec_problem(g.kv_cache_spec, block_size, hash_block_size)
                   if is_state_spec(g.kv_cache_spec) else None)
        if problem:
            raise ConnectorSetupError(problem)
    windows = [None if is_state_spec(g.kv_cache_spec) else _check_spec(g.kv_cache_spec)
               for g in groups]
    window = windows[0] if len(groups) == 1 else None
    hybrid = _hybrid_groups(groups, windows)
    pc = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise ConnectorSetupError(f"kvtier does not support {name} > 1 yet")
    bt = block_tokens(config, block_size, hash_block_size)
    if bt != config.block_tokens:  # the manager (cost model, admission) reads the config's
        config = replace(config, block_tokens=bt)
    if any(w is not None for w in windows) and bt != block_size:
        raise ConnectorSetupError(
            f"kvtier: a sliding-window model needs block_tokens equal to vLLM's block size "
            f"({block_size}), got {bt}"
        )
    if len(groups) > 1 and bt != block_size:
        raise ConnectorSetupError(
            f"kvtier: hybrid KV cache groups need block_tokens equal to vLLM's block size "
            f"({block_size}), got {bt}; or start vLLM with {HMA_FLAG}"
        )
    hash_algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if hash_algo in UNSTABLE_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        log.warning(
            "kvtier: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives new block hashes "
            "in every process: disk-tier blocks of earlier runs can never hit. Set "
            "PYTHONHASHSEED (same value everywhere) or use sha256.", hash_algo,
        )
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    settings = ConnectorSettings(
        config=config,
        block_size=block_size,
        hash_block_size=hash_block_size,
        block_tokens=bt,
        layer_names=tuple(n for g in groups for n in g.layer_names),
        page_bytes=int(spec.real_page_size_bytes),
        sliding_window=window,
        world_size=int(pc.world_size),
        tp_size=int(pc.tensor_parallel_size),
        kv_dtype=str(spec.dtype).replace("torch.", ""),
        identity=_model_identity(vllm_config, spec, layout, hash_algo)
        + (f";groups={'/'.join(g.kind for g in hybrid)}" if len(groups) > 1 else ""),
        sync_load_budget_bytes=sync_load_budget(extra),
        whole_tail_layer_bytes=whole_tail_layer_bytes(extra),
        same_thread_fast_path=same_thread_fast_path(extra),
        store_every_steps=store_every_steps(extra),
        offload_prompt_only=offload_prompt_only(extra),
        vllm_kv_events=kv_events_enabled(vllm_config),
        groups=hybrid,
        replicated_kv=type(spec).__name__ == "MLAAttentionSpec",
        engine_id=str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or ""),
        state_layers=tuple(n for g in groups if is_state_spec(g.kv_cache_spec)
                           for n in g.layer_names),
        zeroes_new_blocks=bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)),
        max_num_seqs=int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs",
                                 0) or 0),
    )
    config.check_block_bytes(settings.block_bytes)
    return settings


def describe(settings: ConnectorSettings) -> str:
    c = settings.config
    return json.dumps({
        "block_tokens": settings.block_tokens,
        "block_bytes": settings.block_bytes,
        "cpu_blocks": c.cpu_slots(settings.block_bytes),
        "disk_blocks": c.disk_blocks(settings.block_bytes),
        "disk": str(c.disk.path) if c.disk is not None else None,
        "sync_load_budget_bytes": settings.sync_load_budget_bytes,
        "whole_tail_layer_bytes": settings.whole_tail_layer_bytes,
        "store_every_steps": settings.store_every_steps,
        "offload_prompt_only": settings.offload_prompt_only,
        "kv_cache_groups": [g.kind + (f"(window {g.sliding_window})" if g.sliding_window else "")
                            for g in settings.groups],
    })
