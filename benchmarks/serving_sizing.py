"""How ``serving.py`` sizes a run: the workload, the pool, and the CPU and GPU bytes against
the pool's working set.

Why two ways: the synthetic workload (the default) fixes the CPU bytes (per ``--shape``, or
``--cpu-gib``) and sizes the pool so its working set is ``--working-set`` times them. A
published preset fixes the pool (its conversations, ``--pool`` to change them), so the bytes
follow from its working set instead: the CPU tier is the working set / ``--working-set``
(unless ``--cpu-gib``), and the GPU's KV cache the working set / ``--gpu-working-set``
(default 4: these workloads are compared with the working set 4-10x the GPU's KV cache, and
at their published sizes vLLM's KV cache must still hold one whole conversation, which 4x
does for every preset; raise ``--pool`` to go further). ``--gpu-working-set`` sizes the
synthetic workload's GPU KV the same way when given; ``--gpu-kv-gib`` sets it in bytes.
"""

from __future__ import annotations

import math

from serving_presets import LMCACHE_PRESETS, PRESETS, preset
from serving_workload import Shape

GiB = 1 << 30
SYNTHETIC = "synthetic"
WORKLOADS = (SYNTHETIC, *PRESETS)
PRESET_GPU_WORKING_SET = 4.0


def choose_workload(p, a) -> None:
    """``a.workload`` from the flags; a preset's rates and minimum requests where the flags
    leave them unset."""
    if a.workload_name == SYNTHETIC:
        if a.rounds:
            p.error("--rounds: for the LMCache workloads (" + ", ".join(LMCACHE_PRESETS) + ")")
        a.workload = Shape(a.first_tokens, a.user_tokens, a.answer_tokens, a.turns)
        a.min_requests = a.min_requests or 0
        return
    if a.cpu_smoke:
        p.error("--cpu-smoke: runs the synthetic workload only (no --workload)")
    if a.rounds and a.workload_name not in LMCACHE_PRESETS:
        p.error("--rounds: for the LMCache workloads (" + ", ".join(LMCACHE_PRESETS) + ")")
    if a.rounds and a.rounds < 2:
        p.error("--rounds: 2 or more (a conversation of one round reuses nothing)")
    a.workload = preset(a.workload_name, a.pool, a.rounds)
    a.rates = a.rates or a.workload.rates
    a.min_requests = a.workload.min_requests if a.min_requests is None else a.min_requests


def size_memory(p, a, cpu_gib: float, gpu_gib: float) -> None:
    """``a.pool``, ``a.ws_bytes``, ``a.cpu_bytes``, ``a.gpu_kv_bytes``, ``a.disk_bytes``
    (``cpu_gib``, ``gpu_gib``: the shape's defaults, the synthetic workload's)."""
    if a.gpu_working_set is not None and a.gpu_kv_gib is not None:
        p.error("--gpu-working-set and --gpu-kv-gib: give one (both size the GPU's KV)")
    if a.gpu_working_set is not None and not a.gpu_working_set > 0:
        p.error("--gpu-working-set: must be > 0")
    w = a.workload
    if a.workload_name == SYNTHETIC:
        a.cpu_bytes = int((cpu_gib if a.cpu_gib is None else a.cpu_gib) * GiB)
        if a.cpu_bytes <= 0:
            p.error("--cpu-gib and --gpu-kv-gib: must be > 0")
        per_conv = w.mean_held() * a.token_bytes
        # rounded up: a pool a hair under 2x the CPU tier would leave kvtier_disk's target n/a
        a.pool = a.pool or max(1, math.ceil(a.working_set * a.cpu_bytes / per_conv))
        a.ws_bytes = w.working_set_tokens(a.pool) * a.token_bytes
        gpu_ratio = a.gpu_working_set
    else:
        a.pool = w.conversations
        a.ws_bytes = w.working_set_tokens(a.pool) * a.token_bytes
        a.cpu_bytes = int(a.ws_bytes / a.working_set if a.cpu_gib is None else a.cpu_gib * GiB)
        gpu_ratio = a.gpu_working_set
        if gpu_ratio is None and a.gpu_kv_gib is None:
            gpu_ratio = PRESET_GPU_WORKING_SET
    if gpu_ratio is not None:
        a.gpu_kv_bytes = int(a.ws_bytes / gpu_ratio)
    else:
        a.gpu_kv_bytes = int((gpu_gib if a.gpu_kv_gib is None else a.gpu_kv_gib) * GiB)
    if a.cpu_bytes <= 0 or a.gpu_kv_bytes <= 0:
        p.error("--cpu-gib and --gpu-kv-gib: must be > 0")
    a.disk_bytes = int(a.disk_gib * GiB) if a.disk_gib else int(1.5 * a.ws_bytes)
    if a.gpu_kv_bytes < a.max_len * a.token_bytes:
        flag = "--gpu-kv-gib" if gpu_ratio is None else "--gpu-working-set"
        hint = ("" if gpu_ratio is None else
                f" (working set {a.ws_bytes / a.token_bytes:.0f} tokens / {gpu_ratio:g}; "
                "lower it or raise --pool)")
        p.error(f"{flag}: {a.gpu_kv_bytes / GiB:.3g} GiB holds fewer tokens than one "
                f"conversation's longest turn ({a.max_len}){hint}")


def window_s(a, rate: float) -> float:
    """Seconds of arrivals at ``rate``: ``--duration-s``, longer where ``--min-requests``
    needs it (a preset's 0.1 QPS sends 1.5 requests in 15 s)."""
    return max(a.duration_s, a.min_requests / rate)
