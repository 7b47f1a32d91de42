"""Environment overrides: ``KVTIER_*`` variables that win over the file or dict.

Deployments (containers, vLLM launch scripts) often cannot edit the YAML, so the few settings
people tune per host can be set from the environment. Values arrive as strings; each parser
converts what it can and passes anything else through unchanged, so the loader's normal
validation reports it, naming the variable.
"""

from __future__ import annotations

from typing import Any, Callable


def _env_int(text: str) -> Any:
    try:
        return int(text.strip())
    except ValueError:
        return text  # validation then reports it, naming the variable


def _env_float(text: str) -> Any:
    try:
        return float(text.strip())
    except ValueError:
        return text


def _env_bool(text: str) -> Any:
    return {"1": True, "true": True, "yes": True, "on": True,
            "0": False, "false": False, "no": False, "off": False}.get(text.strip().lower(), text)


ENV_OVERRIDES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "KVTIER_BLOCK_TOKENS": ("block_tokens", _env_int),
    "KVTIER_CPU_CAPACITY": ("tiers.cpu.capacity", str),
    "KVTIER_CPU_EVICTION": ("tiers.cpu.eviction", str),
    "KVTIER_CPU_ADMISSION": ("tiers.cpu.admission", str),
    "KVTIER_DISK_PATH": ("tiers.disk.path", str),
    "KVTIER_DISK_CAPACITY": ("tiers.disk.capacity", str),
    "KVTIER_DISK_EVICTION": ("tiers.disk.eviction", str),
    "KVTIER_DISK_COMPRESSION": ("tiers.disk.compression", str),
    "KVTIER_DISK_FSYNC": ("tiers.disk.fsync", _env_bool),
    "KVTIER_DISK_IO_PROCESS": ("tiers.disk.io_process", _env_bool),
    "KVTIER_DISK_ADMISSION": ("tiers.disk.admission", str),
    "KVTIER_REMOTE_URL": ("tiers.remote.url", str),
    "KVTIER_REMOTE_NODES": ("tiers.remote.nodes", str),
    "KVTIER_REMOTE_NAMESPACE": ("tiers.remote.namespace", str),
    "KVTIER_HOST_CAPACITY": ("tiers.host.capacity", str),
    "KVTIER_HOST_DIR": ("tiers.host.dir", str),
    "KVTIER_STORE_THRESHOLD": ("admission.store_threshold", _env_int),
    "KVTIER_OFFLOAD_RATIO": ("admission.offload_ratio", _env_float),
    "KVTIER_EVENTS_ENDPOINT": ("events.endpoint", str),
    "KVTIER_EVENTS_REPLAY_ENDPOINT": ("events.replay_endpoint", str),
    "KVTIER_EVENTS_TOPIC": ("events.topic", str),
    "KVTIER_EVENTS_BUFFER_BATCHES": ("events.buffer_batches", _env_int),
    "KVTIER_EVENTS_ALLOW_REMOTE": ("events.allow_remote", _env_bool),
    "KVTIER_METRICS_PORT": ("metrics.port", _env_int),
    "KVTIER_METRICS_HOST": ("metrics.host", str),
}
"""Variable -> (config key, parser). Empty values count as unset. Any KVTIER_DISK_* enables
the disk tier; KVTIER_DISK_PATH alone gives it the default capacity. Likewise any
KVTIER_EVENTS_* turns the event stream on and any KVTIER_METRICS_* the metrics endpoint."""
