"""The shared tier's data path in the test's own process: ``RemoteBlockIO`` (what each I/O
process of ``RemoteIOProcesses`` runs) over CPU slots that are plain bytearrays, so a test can
fill a slot, store it, damage the value with a plain client and see what a read reports.
"""

from __future__ import annotations

from kvtier.config import load_config
from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote import RemoteKeys, derive_namespace
from kvtier.tiers.remote.block_io import FetchResult, PutResult, RemoteBlockIO
from kvtier.tiers.remote.secrets import RemoteSecrets

BLOCK = 256 << 10


def remote_cfg(**remote) -> RemoteTierConfig:
    """A tier config with short timeouts: a hung or dead server costs a test little."""
    remote.setdefault("timeout_s", 0.2)
    remote.setdefault("connect_timeout_s", 0.2)
    remote.setdefault("probe_interval_s", 0.3)
    return load_config(data={"tiers": {"remote": remote}}, env={}).remote


class Slots:
    """CPU slots as bytearrays; called with a slot id, what ``slot_buffer`` must return."""

    def __init__(self, count: int, block_bytes: int) -> None:
        self.data = [bytearray(block_bytes) for _ in range(count)]

    def __call__(self, slot: int) -> memoryview:
        return memoryview(self.data[slot])


def open_io(cfg: RemoteTierConfig, fingerprint: str = "geo-a", namespace: str | None = None,
            *, keys: RemoteKeys | None = None, secrets: RemoteSecrets | None = None,
            slots: int = 40, block_bytes: int = BLOCK) -> RemoteBlockIO:
    keys = keys or RemoteKeys(namespace or derive_namespace(fingerprint), fingerprint)
    return RemoteBlockIO(cfg, keys, secrets or RemoteSecrets(), Slots(slots, block_bytes),
                         block_bytes)


def write(io: RemoteBlockIO, keys: list[bytes], payloads: list[bytes]) -> PutResult:
    """Copy each payload into slot 0, 1, ... and store those slots under ``keys``."""
    for i, p in enumerate(payloads):
        io.slot_buffer.data[i][:] = p
    return io.put(list(range(len(keys))), keys)


def read(io: RemoteBlockIO, keys: list[bytes]) -> tuple[list[bytes], FetchResult]:
    """Fetch ``keys`` into slots 0, 1, ...; what each slot then holds, and the result (a
    slot of a failed position holds whatever the read left there: never to be used)."""
    r = io.fetch(keys, list(range(len(keys))))
    return [bytes(io.slot_buffer.data[i]) for i in range(len(keys))], r
