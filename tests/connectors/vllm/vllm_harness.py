"""Drive a real vLLM (0.32) Scheduler plus worker-side KV connectors on CPU, without a model.

Why: a KV connector is two halves (scheduler side in the engine core, worker side in each
model runner) glued together by vLLM's scheduler. Unit-testing one half with mocks misses
exactly the bugs that matter (block ids, preemption, finish ordering, multi-worker
aggregation). This module builds the real ``Scheduler`` with the connector under test
loaded through ``KVTransferConfig`` and runs engine steps the way vLLM's model runner does:

    schedule() -> [per worker] handle_preemptions -> bind_connector_metadata ->
    start_load_kv -> (fake forward writes KV) -> wait_for_save -> get_transfer_results ->
    get_block_ids_with_load_errors / get_kv_connector_stats / build_connector_worker_meta ->
    clear_connector_metadata -> KVOutputAggregator.aggregate -> update_from_output()

The fake forward writes a deterministic pattern into the KV pages of every *computed*
token (never into tokens the connector claimed to load), so a test can check byte for
byte that a load put the right KV into the right GPU blocks.

Needs the environment variables in ``ENV`` to be set before vLLM is imported (importing this
module sets them; tests/connectors/vllm/conftest.py imports it first).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from itertools import count
from typing import Any

from vllm_env import ENV  # noqa: E402,F401  (sets the variables before vLLM loads)

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

# vLLM 0.34 dropped ModelRunnerOutput.req_id_to_index (it derives it from req_ids)
RUNNER_OUTPUT_HAS_INDEX = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}

EOS_TOKEN_ID = 2
VOCAB = 1000


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry the fake KV cache is built with (a tiny Llama)."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]


def write_model_config(directory: str, shape: ModelShape = ModelShape()) -> str:
    """Write a local LlamaForCausalLM config (ModelConfig cannot reach a hub here)."""
    os.makedirs(directory, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.num_kv_heads * 2 * shape.head_dim, "intermediate_size": 256,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_kv_heads * 2,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID}, f)
    return directory


def make_vllm_config(
    model_dir: str,
    *,
    connector: str,
    module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    max_model_len: int = 2048,
    kv_role: str = "kv_both",
    load_failure_policy: str = "recompute",
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    world_size: int = 1,
    kv_events: bool = False,
) -> VllmConfig:
    """A VllmConfig for scheduler tests: CPU device, local model config, one connector."""
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=False,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    # The engine core resolves the layout before building connectors; tests must too.
    cache_config.kv_cache_layout = KVCacheLayout.LBHNC.name
    kvt = KVTransferConfig(
        kv_connector=connector, kv_connector_module_path=module_path, kv_role=kv_role,
        kv_connector_extra_config=dict(extra_config or {}),
        kv_load_failure_policy=load_failure_policy,
    )
    vc = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                    cache_config=cache_config, kv_transfer_config=kvt,
                    device_config=DeviceConfig("cpu"),
                    kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events,
                                                    publisher="null") if kv_events else None)
    vc.parallel_config.world_size = world_size
    return vc


def make_kv_cache_config(
    vllm_config: VllmConfig,
    num_blocks: int,
    shape: ModelShape = ModelShape(),
    sliding_window: int | None = None,
) -> KVCacheConfig:
    """One KV cache group over all layers, laid out layer-outermost (LBHNC) like vLLM 0.32.

    ``sliding_window`` makes the group a SlidingWindowSpec (still a single group).
    """
    block_size = vllm_config.cache_config.block_size
    if sliding_window is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=shape.num_kv_heads,
                                 head_size=shape.head_dim, dtype=shape.dtype)
    else:
        spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=shape.num_kv_heads,
                                 head_size=shape.head_dim, dtype=shape.dtype,
                                 sliding_window=sliding_window)
    page = spec.page_size_bytes
    layers = shape.layer_names
    tensor = KVCacheTensor(size=page * num_blocks * len(layers), layers=layers,
                           layer_stride=page * num_blocks, block_stride=page)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return cfg


def make_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                   async_scheduling: bool = False) -> Scheduler:
    """The real scheduler; it builds the SCHEDULER-role connector itself. ``async_scheduling``:
    vLLM's AsyncScheduler (the GPU default; vLLM's CPU platform turns it off, so the config
    flag cannot ask for it here)."""
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, hash_block_size=hash_block_size, log_stats=True)


def make_kv_caches(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors exactly as vLLM 0.32 allocates them: views ``[B, H, N, 2*D]`` of
    one int8 buffer (K in C[:D], V in C[D:] for GPU kernels; CPU kernels read the same
    bytes as [H, 2N, D]). Each (layer, block) page is one contiguous run of bytes."""
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)


def make_worker_connector(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                          kv_caches: dict[str, torch.Tensor] | None):
    """A WORKER-role instance of the configured connector class, caches registered."""
    with set_current_vllm_config(vllm_config):
        conn = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                   kv_cache_config)
        if kv_caches is not None:
            conn.register_kv_caches(kv_caches)
    return conn


def rank_workers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, world_size: int,
                 forward: Callable[[dict[str, torch.Tensor]], Any]) -> tuple[list, list, list]:
    """(caches, worker connectors, forwards) of ``world_size`` ranks: each its own KV caches
    and its own rank in a copy of the parallel config (its own disk directory)."""
    caches, workers, forwards = [], [], []
    for rank in range(world_size):
        wvc = vllm_config
        if world_size > 1:
            wvc = copy.copy(vllm_config)
            wvc.parallel_config = copy.copy(vllm_config.parallel_config)
            wvc.parallel_config.rank = rank
        c = make_kv_caches(kv_cache_config)
        caches.append(c)
        workers.append(make_worker_connector(wvc, kv_cache_config, c))
        forwards.append(forward(c))
    return caches, workers, forwards


def scheduled_starts(so: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed tokens before this step (where its forward starts)."""
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


# --------------------------------------------------------------------------- requests


class RequestMaker:
    """Builds ``Request`` objects with the same block hasher the engine core uses."""

    def __init__(self, hash_block_size: int) -> None:
        init_none_hash(sha256)  # the engine does this once per process (sha256 default)
        self._hasher = get_request_block_hasher(hash_block_size, sha256)
        self._ids = count()

    def __call__(self, token_ids: Sequence[int], *, max_tokens: int = 4,
                 kv_transfer_params: dict | None = None, req_id: str | None = None,
                 ignore_eos: bool = True, kv_hints=None) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=extra)
        sp.update_from_generation_config({}, EOS_TOKEN_ID)
        return Request(request_id=req_id or f"req-{next(self._ids)}",
                       prompt_token_ids=list(token_ids), sampling_params=sp,
                       pooling_params=None, block_hasher=self._hasher,
                       **({"kv_hints": kv_hints} if kv_hints is not None else {}))


def random_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def next_token(all_token_ids: Sequence[int]) -> int:
    """Deterministic 'sampled' token (never EOS), so decoded blocks hash reproducibly."""
    return 3 + (sum(all_token_ids[-4:]) * 31 + len(all_token_ids)) % (VOCAB - 3)


# --------------------------------------------------------------------------- fake forward


def token_kv_value(token_ids: Sequence[int], pos: int, layer: int) -> float:
    """KV content of one token: depends on the whole prefix (as real KV does) and the layer.
    Exact in float32 (< 2**24)."""
    h = 0
    for t in token_ids[: pos + 1]:
        h = (h * 1_000_003 + t) % 8_388_593
    return float((h + 7919 * layer) % 16_777_213)


class FakeForward:
    """Stands in for the model: writes KV for the tokens the scheduler computes this step."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], shape: ModelShape, block_size: int):
        self.shape, self.block_size = shape, block_size
        self.layers = [kv_caches[n].view(shape.dtype) for n in shape.layer_names]

    def write(self, scheduler: Scheduler, so: SchedulerOutput,
              tokens: Callable[[Request], Sequence[int]] | None = None) -> None:
        """``tokens``: a request's known tokens (default ``all_token_ids``; an async loop adds
        the ones sampled but not delivered yet, as the GPU runner has them on the device)."""
        starts = scheduled_starts(so)
        for req_id, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            ids = tokens(req) if tokens is not None else req.all_token_ids
            block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for pos in range(starts[req_id], starts[req_id] + n):
                if pos >= len(ids):  # placeholder slot for a not-yet-sampled token
                    break
                b, slot = block_ids[pos // self.block_size], pos % self.block_size
                for li, layer in enumerate(self.layers):
                    layer[b, :, slot, :] = token_kv_value(ids, pos, li)

    def mismatches(self, token_ids: Sequence[int], block_ids: Sequence[int],
                   num_tokens: int) -> list[int]:
        """Token positions < num_tokens whose KV in ``block_ids`` is not the expected one."""
        bad = []
        for pos in range(num_tokens):
            b, slot = block_ids[pos // self.block_size], pos % self.block_size
            for li, layer in enumerate(self.layers):
                want = token_kv_value(token_ids, pos, li)
                if not torch.all(layer[b, :, slot, :] == want):
                    bad.append(pos)
                    break
        return bad


# --------------------------------------------------------------------------- engine loop


@dataclass
class StepRecord:
    scheduler_output: SchedulerOutput
    kv_output: KVConnectorOutput | None
    finished: list[str] = field(default_factory=list)
    kv_connector_stats: list[dict] = field(default_factory=list)  # as the stats logger gets them


class EngineLoop:
    """Runs engine steps: the real scheduler plus N worker-side connectors (one per TP rank).

    ``workers`` are objects with the worker half of KVConnectorBase_V1 (a real connector in
    WORKER role, or a scripted stand-in). Each worker gets its own ``FakeForward`` when
    ``forwards`` is given (one per worker, same order).
    """

    def __init__(self, scheduler: Scheduler, workers: Sequence[Any],
                 forwards: Sequence[FakeForward] | None = None,
                 after_forward: Callable[[int, Any, SchedulerOutput], None] | None = None):
        self.scheduler, self.workers = scheduler, list(workers)
        self.forwards = list(forwards or [])
        self.after_forward = after_forward
        self.aggregator = KVOutputAggregator(expected_finished_count=len(self.workers))
        self.forward_context = ForwardContext(no_compile_layers={}, attn_metadata={},
                                              slot_mapping={})
        # Layers whose attention "runs" vLLM's per-layer hook (wait_for_layer_load) in each
        # forward, as the model's attention layers do outside a full CUDA graph; None: no hooks
        self.layer_hooks: list[str] | None = None
        self.history: list[StepRecord] = []
        self.outputs: dict[str, list[int]] = {}
        # req_id -> (local prefix-cache hit tokens, connector-loaded tokens) at first prefill
        self.prefill: dict[str, tuple[int, int]] = {}

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.scheduler.add_request(r)

    def tokens(self, req: Request) -> Sequence[int]:
        """The tokens the forward sees (an async loop adds undelivered samples)."""
        return req.all_token_ids

    def _runner_output(self, so: SchedulerOutput, kv_out: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            ids = self.tokens(req)
            # schedule() already advanced num_computed_tokens; a token is sampled only once
            # the whole known sequence is computed (not for a partial prefill chunk).
            done = req.num_computed_tokens >= len(ids)
            sampled.append([next_token(ids)] if done else [])
        index = ({"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
                 if RUNNER_OUTPUT_HAS_INDEX else {})  # vLLM 0.34 derives it from req_ids
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=None,
                                 kv_connector_output=kv_out, **index)

    def step(self) -> StepRecord:
        so = self.scheduler.schedule()
        return self.deliver(so, self.execute(so))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The workers' half of a step: hooks, fake forward, outputs merged across ranks."""
        meta = so.kv_connector_metadata
        outs = []
        for i, w in enumerate(self.workers):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            hooks = self.layer_hooks
            ctx = self.forward_context
            if hooks is not None:
                ctx = ForwardContext(no_compile_layers={}, attn_metadata={"hooked": True},
                                     slot_mapping={})
            w.start_load_kv(ctx)
            for name in hooks or ():
                w.wait_for_layer_load(name)
            if i < len(self.forwards):
                self.forwards[i].write(self.scheduler, so, self.tokens)
            if self.after_forward is not None:
                self.after_forward(i, w, so)
            w.wait_for_save()
            tr = w.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=tr.finished_sending or None,
                finished_recving=tr.finished_recving or None,
                failed_recving=set(tr.failed_recving),
                invalid_block_ids=set(w.get_block_ids_with_load_errors()),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outs.append(self._runner_output(so, kv_out))
        return self.aggregator.aggregate(outs)

    def deliver(self, so: SchedulerOutput, merged: ModelRunnerOutput) -> StepRecord:
        """The engine's half: the scheduler takes the step's outputs."""
        engine_outputs = self.scheduler.update_from_output(so, merged)
        rec = StepRecord(so, merged.kv_connector_output)
        for eco in engine_outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.kv_connector_stats:
                rec.kv_connector_stats.append(stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                ps = o.prefill_stats
                if ps is not None and o.request_id not in self.prefill:
                    self.prefill[o.request_id] = (ps.num_local_cached_tokens,
                                                  ps.num_external_cached_tokens)
                if o.finished:
                    rec.finished.append(o.request_id)
        self.history.append(rec)
        return rec

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.requests) or bool(s.finished_req_ids) or bool(
            s.connector is not None and s.connector.has_pending_push_work())

    def run_until_idle(self, max_steps: int = 200, idle_timeout_s: float = 60.0) -> list[StepRecord]:
        """Step until nothing is left. Steps that schedule no tokens (only transfers in flight on
        the connector's threads) yield the CPU briefly and do not count towards ``max_steps``;
        ``idle_timeout_s`` only guards against a hang."""
        start = len(self.history)
        steps = 0
        deadline = time.monotonic() + idle_timeout_s
        while self.busy():
            if steps >= max_steps or time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {steps} steps")
            rec = self.step()
            if rec is None:  # an async loop filled its queue: nothing delivered this time
                continue
            if rec.scheduler_output.total_num_scheduled_tokens:
                steps += 1
            else:
                time.sleep(0.002)
        return self.history[start:]


def assert_no_leaks(scheduler: Scheduler) -> None:
    """Every request gone and every GPU block back in the free queue (ref_cnt 0)."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert not scheduler.running and not scheduler.waiting
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1  # block 0 = null
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def block_ids_of(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def collect(records: Iterable[StepRecord], fn: Callable[[StepRecord], Iterable[Any]]) -> list[Any]:
    return [x for r in records for x in fn(r)]
