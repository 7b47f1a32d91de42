"""Timeline marks inside vLLM's own step, for ``vllm_e2e_child.py --vllm-marks`` (benchmark only).

Why: kvtier's timeline (``KVTIER_TIMELINE``) shows when kvtier's hooks run; the gaps between
them are vLLM's or the interpreter's (another thread holding the GIL). Wrapping the step's
phases (engine step, schedule, execute_model, forward, sampling, output update) with marks on
the same clock shows which. Patches the in-process engine's classes; nothing is changed but
the marks. Each mark carries the engine thread's CPU time (``cpu``, seconds): a phase whose wall
time grows while its CPU time does not waited (GIL, I/O); one whose CPU time grows too ran slower.
"""

from __future__ import annotations

import functools
import threading
import time

from kvtier.connectors.timeline import timeline

PHASES = [
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    # the model runner vLLM 0.32 uses on GPUs
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "add_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "pre_forward"),
    ("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "finish_forward"),
    ("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "post_forward"),
]


def install() -> list[str]:
    """Wrap every phase that exists in this vLLM; returns the ones wrapped."""
    import importlib

    tl = timeline()
    done = []
    for module, cls_name, name in PHASES:
        try:
            cls = getattr(importlib.import_module(module), cls_name, None)
        except ImportError:  # another vLLM version or platform
            continue
        fn = getattr(cls, name, None) if cls is not None else None
        if fn is None:
            continue

        def wrap(fn=fn, label=f"{cls_name}.{name}"):
            @functools.wraps(fn)
            def marked(*args, **kwargs):
                tl.mark("vllm", label + ">", cpu=time.thread_time(), tid=threading.get_native_id())
                try:
                    return fn(*args, **kwargs)
                finally:
                    tl.mark("vllm", label + "<", cpu=time.thread_time())
            return marked

        setattr(cls, name, wrap())
        done.append(f"{cls_name}.{name}")
    return done
