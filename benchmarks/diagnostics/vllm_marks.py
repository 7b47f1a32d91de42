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
import importlib.abc
import importlib.util
import inspect
import sys
import threading
import time

from kvtier.observe.timeline import timeline

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


# vLLM's serving processes (``vllm_serve.py --vllm-marks``): the engine core's intake (its input
# thread decodes a request, its busy loop takes it), its output thread (encode, send) and the API
# server's side (decode the engine's outputs, turn them into the response)
SERVE_PHASES = [
    ("vllm.v1.engine.core", "EngineCoreProc", "_handle_client_request"),
    ("vllm.v1.engine.core", "EngineCore", "preprocess_add_request"),
    ("vllm.v1.engine.core", "EngineCore", "add_request"),
    ("vllm.v1.engine.core", "EngineCore", "post_step"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_send_msg_tracking_payload"),
    ("vllm.v1.serial_utils", "MsgpackEncoder", "encode"),
    ("vllm.v1.serial_utils", "MsgpackEncoder", "encode_into"),
    ("vllm.v1.serial_utils", "MsgpackDecoder", "decode"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
]


def _wrap(cls: type, name: str) -> bool:
    raw = inspect.getattr_static(cls, name, None)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw
    if fn is None or getattr(fn, "_kvtier_marked", False):
        return False
    tl = timeline()
    label = f"{cls.__name__}.{name}"

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        tl.mark("vllm", label + ">", cpu=time.thread_time(), tid=threading.get_native_id())
        try:
            return fn(*args, **kwargs)
        finally:
            tl.mark("vllm", label + "<", cpu=time.thread_time(), tid=threading.get_native_id())

    marked._kvtier_marked = True
    setattr(cls, name, kind(marked) if kind else marked)
    return True


def _patch(module, phases) -> list[str]:
    done = []
    for mod_name, cls_name, name in phases:
        if mod_name != module.__name__:
            continue
        cls = getattr(module, cls_name, None)
        if cls is not None and _wrap(cls, name):
            done.append(f"{cls_name}.{name}")
    return done


def install(phases=PHASES) -> list[str]:
    """Wrap every phase that exists in this vLLM; returns the ones wrapped."""
    import importlib

    done = []
    for mod_name in dict.fromkeys(m for m, _, _ in phases):
        try:
            module = importlib.import_module(mod_name)
        except ImportError:  # another vLLM version or platform
            continue
        done += _patch(module, phases)
    return done


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps a module's phases right after the module is first imported, in whatever process
    imports it (vLLM's engine core and API server are processes of their own; importing vLLM
    early from ``sitecustomize`` would change what they import and when)."""

    def __init__(self, phases) -> None:
        self.phases = phases
        self.pending = {m for m, _, _ in phases}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)  # the lookup below must not come back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        phases = self.phases

        def exec_module(module):
            run(module)
            _patch(module, phases)

        spec.loader.exec_module = exec_module
        return spec


def install_on_import(phases=PHASES + SERVE_PHASES) -> None:
    """For ``serve_marks/sitecustomize.py``: mark these phases once their modules load."""
    sys.meta_path.insert(0, _PatchOnImport(phases))
