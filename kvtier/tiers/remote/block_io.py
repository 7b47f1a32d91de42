"""Blocks between CPU slot buffers and the shared tier, over pipelined RESP connections.

A block's value is the disk tier's record (``header | key | payload``), plus a keyed tag when
the tier has a MAC key. A SET sends the header it built and the payload straight from the CPU
slot; a GET of an uncompressed record scatters the header into a small buffer and the payload
straight into the CPU slot (:mod:`.resp`), then verifies it there: header checksum, the stored
identity (server key + geometry fingerprint), lengths, the payload checksum and the tag. A value
that fails any check is a miss (the slot is the promotion's own until the load completes, so
its bytes are never used), counted as rejected; nothing unverified is reported loaded.

Connections (:mod:`.nodes`) are kept per node, opened on first use and dropped on any
connection or protocol error (the block is then a transient failure: the engine recomputes
it). With a Cluster the slot map is read once and again after a ``MOVED``.
"""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.record import (CODEC_NONE, HEADER_BYTES, CorruptRecord, data_checksum,
                                      decode_head, encode_head)
from kvtier.tiers.layout import LAYOUT_VERSION
from kvtier.tiers.remote.wire import failures
from kvtier.tiers.remote.keys import RemoteKeys
from kvtier.tiers.remote.wire.nodes import Node, NodeConnections
from kvtier.tiers.remote.wire.resp import ProtocolError, RespError, command, command_with_value
from kvtier.tiers.remote.secrets import MAC_BYTES, RemoteSecrets, record_mac

log = logging.getLogger(__name__)
OTHER_VALUE_SLACK = 1 << 20  # a compressed record may exceed its raw size by a little
HASH_THREADS = 2  # checksums and tags of landed values, beside the thread that receives them
HASH_BATCH_BYTES = 4 << 20  # values hashed per task: a task's overhead is paid per batch
WRITE_WINDOW_BYTES = 2 << 20  # SET bytes one I/O process keeps in flight (at least one block)
READY_REPORTS = 8  # a fetch reports its verified blocks in about this many parts (``ready``)
READY_MIN_BLOCKS = 4  # ... of at least this many blocks: a report costs a frame and a wake-up


@dataclass
class BlockIOStats:
    gets: int = 0
    hits: int = 0
    misses: int = 0  # absent: never stored, or evicted by the server
    rejected: int = 0  # present but failed verification (corrupt, foreign, forged, oversized)
    unauthenticated: int = 0  # of rejected: no valid MAC tag
    puts: int = 0
    failed_puts: int = 0
    get_bytes: int = 0
    put_bytes: int = 0
    errors: int = 0  # commands lost to a connection, protocol or server error
    tls_errors: int = 0  # of errors: TLS refused (wrong CA, other host name, no TLS there)
    auth_errors: int = 0  # of errors: the server refused AUTH
    unlisted_refused: int = 0  # blocks not sent to a Cluster node outside ``nodes``
    last_error: str = ""
    degraded: bool = False  # the tier is failing fast (set by whoever tracks its health)
    degradations: int = 0

    def add(self, other: dict) -> None:
        for k, v in other.items():
            if k == "last_error":
                self.last_error = v or self.last_error
            elif k == "degraded":
                self.degraded = bool(v)
            elif hasattr(self, k):
                setattr(self, k, getattr(self, k) + int(v))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PutResult:
    ok: list[bool]  # per position: the server acknowledged the SET
    lost: list[int]  # positions lost to a connection or protocol error (not a refusal)


@dataclass(frozen=True)
class FetchResult:
    failed: list[int]  # positions that are misses (absent, rejected, or lost to an error)
    transient: list[int]  # of failed: lost to a connection or server error (not absent)


class _ReadyReporter:
    """Reports a fetch's checked batches that passed (``RemoteBlockIO.fetch``'s ``ready``), in
    order, once at least a ``READY_REPORTS``-th of the fetch (and ``READY_MIN_BLOCKS``) is
    waiting to be reported. Only looks at checks already finished: never waits for one."""

    def __init__(self, ready: Callable[[list[int]], None] | None, n: int,
                 checks: list[tuple[list[int], Future]]) -> None:
        self.ready = ready
        self.every = max(READY_MIN_BLOCKS, -(-n // READY_REPORTS))
        self.enabled = ready is not None and n >= 2 * self.every
        self.checks = checks
        self.seen = 0  # checks looked at so far
        self.waiting: list[int] = []

    def poll(self) -> None:
        if not self.enabled:
            return
        while self.seen < len(self.checks) and self.checks[self.seen][1].done():
            positions, check = self.checks[self.seen]
            self.seen += 1
            if check.exception() is None:
                self.waiting += [i for i, good in zip(positions, check.result()) if good]
        if len(self.waiting) >= self.every:
            out, self.waiting = self.waiting, []
            self.ready(out)


class RemoteBlockIO:
    def __init__(self, cfg: RemoteTierConfig, keys: RemoteKeys, secrets: RemoteSecrets,
                 slot_buffer: Callable[[int], memoryview], block_bytes: int) -> None:
        self.cfg = cfg
        self.keys = keys
        self.secrets = secrets
        self.slot_buffer = slot_buffer
        self.block_bytes = block_bytes
        self.codec = BlockCodec(cfg.compression, cfg.zstd_level)
        self.tag_bytes = MAC_BYTES if secrets.mac_key else 0
        self.stats = BlockIOStats()
        # Hashing a value (xxh3, and keyed BLAKE3 with a MAC key) runs here while the next
        # values are received: both release the GIL, so the tag costs CPU, not stream time.
        self._hashing = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvtier-remote-hash")
        self.nodes = NodeConnections(cfg, secrets, log_unlisted=False)

    def _lost(self, node: Node, exc: BaseException) -> None:
        self.stats.errors += 1
        what = failures.kind(exc)
        if what == "tls":
            self.stats.tls_errors += 1
        elif what == "auth":
            self.stats.auth_errors += 1
        self.stats.last_error = self.secrets.redact(
            f"{node[0]}:{node[1]}: {failures.describe(exc)}")[:300]
        self.nodes.drop(node)

    def _server_error(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self.stats.last_error = self.secrets.redact(str(exc))[:300]

    def _by_node(self, server_keys: Sequence[bytes]) -> dict[Node, list[int]]:
        try:
            groups = self.nodes.by_node(server_keys)
        except ConnectionError as exc:  # no slot map: every key is lost
            self._lost(self.nodes.seeds[0], exc)
            return {}
        self.stats.unlisted_refused += self.nodes.take_refused()
        return groups

    def warm_up(self) -> bool:
        """Connect (and authenticate) to every node before the first block needs it."""
        try:
            for node in self.nodes.primaries():
                for conn in self.nodes.lanes(node, self.cfg.connections):
                    conn.call("PING")
            return True
        except (OSError, RespError, ProtocolError, ValueError) as exc:
            self._lost(self.nodes.seeds[0], exc)
            return False

    # ---- values ----------------------------------------------------------------------------
    def _value_parts(self, record_key: bytes, payload: memoryview) -> list:
        codec_id, stored = self.codec.encode(payload)
        head = encode_head(record_key, codec=codec_id, layout_version=LAYOUT_VERSION,
                           seq=self.secrets.record_seq,
                           raw_len=len(payload), stored_len=len(stored),
                           checksum=data_checksum(record_key, stored))
        parts = [head, stored]
        if self.secrets.mac_key:
            parts.append(record_mac(self.secrets.mac_key, record_key, stored))
        return parts

    def _records(self, blocks: list[tuple[bytes, memoryview]]) -> list[list]:
        return [self._value_parts(record_key, payload) for record_key, payload in blocks]

    def _per_batch(self) -> int:
        return max(1, HASH_BATCH_BYTES // self.block_bytes)

    def put(self, slots: Sequence[int], block_keys: Sequence[bytes]) -> PutResult:
        """SET each slot's block under its key; which the server acknowledged."""
        if len(slots) != len(block_keys):
            raise ValueError(f"{len(block_keys)} keys for {len(slots)} CPU slots")
        server_keys = [self.keys.server_key(k) for k in block_keys]
        ok = [False] * len(server_keys)
        refused: set[int] = set()
        groups = self._by_node(server_keys)
        for node, positions in groups.items():
            built: list[Future] = []
            try:
                lanes = self.nodes.lanes(node, len(positions))
                per = self._per_batch()
                built = [self._hashing.submit(self._records, [
                    (self.keys.record_key(server_keys[i]), self.slot_buffer(slots[i]))
                    for i in positions[b:b + per]]) for b in range(0, len(positions), per)]
                sizes: list[int] = []
                window = max(1, WRITE_WINDOW_BYTES // self.block_bytes)
                for k, i in enumerate(positions):  # interleaved: every lane carries bytes
                    if k >= window:  # a bounded window (see _put_reply)
                        self._put_reply(lanes, positions, sizes, k - window, ok, refused)
                    parts = built[k // per].result()[k % per]
                    sizes.append(sum(memoryview(p).nbytes for p in parts))
                    lanes[k % len(lanes)].send([command_with_value((b"SET", server_keys[i]),
                                                                   parts)])
                for k in range(max(0, len(positions) - window), len(positions)):
                    self._put_reply(lanes, positions, sizes, k, ok, refused)
            except (OSError, ProtocolError) as exc:
                self._lost(node, exc)
            finally:  # no record is still being built from a slot once put() returns
                for f in built:
                    f.cancel()
                wait(built)
        self.stats.puts += sum(ok)
        self.stats.failed_puts += len(ok) - sum(ok)
        return PutResult(ok, [i for i, good in enumerate(ok) if not good and i not in refused])

    def _put_reply(self, lanes: list, positions: list[int], sizes: list[int], k: int,
                   ok: list[bool], refused: set[int]) -> None:
        """Read the reply to the ``k``-th SET of a put. A put keeps at most
        ``WRITE_WINDOW_BYTES`` unanswered: the server runs one event loop for every client,
        and a whole share of SETs queued at once made each presence lookup of the scheduler
        wait behind them, tens of times its quiet answer time, while a bounded window wrote
        as fast (docs/design-measurements.md)."""
        i = positions[k]
        try:
            ok[i] = lanes[k % len(lanes)].read_reply() == "OK"
        except RespError as exc:  # OOM (maxmemory), MOVED: that block only
            refused.add(i)
            self._server_error(exc)
            if exc.moved:
                self.nodes.forget_slots()
            return
        if ok[i]:
            self.stats.put_bytes += sizes[k]

    def fetch(self, block_keys: Sequence[bytes], slots: Sequence[int],
              ready: Callable[[list[int]], None] | None = None) -> FetchResult:
        """GET each block into its slot, verified; the positions that are misses.

        ``ready``: called, while the fetch goes on, with positions whose blocks landed and
        passed verification, about ``READY_REPORTS`` times (what is verified last is only in
        the result). Their slots are final, so the caller may copy them on (a load's CPU ->
        GPU copies overlap its shared-tier read); a reported position is never a miss."""
        if len(slots) != len(block_keys):
            raise ValueError(f"{len(block_keys)} keys for {len(slots)} CPU slots")
        server_keys = [self.keys.server_key(k) for k in block_keys]
        record_keys = [self.keys.record_key(k) for k in server_keys]
        verdict: list[str] = ["lost"] * len(server_keys)
        groups = self._by_node(server_keys)
        max_other = self.block_bytes + OTHER_VALUE_SLACK
        landed: list[tuple] = []  # values awaiting their payload check: (position, key, ...)
        checks: list[tuple[list[int], Future]] = []  # batches being checked beside the receive
        reporter = _ReadyReporter(ready, len(block_keys), checks)
        per = self._per_batch()
        for node, positions in groups.items():
            try:
                lanes = self.nodes.lanes(node, len(positions))
                for j, lane in enumerate(lanes):
                    lane.send([command("GET", server_keys[i])
                               for i in positions[j::len(lanes)]])
                for k, i in enumerate(positions):
                    conn = lanes[k % len(lanes)]
                    head = memoryview(bytearray(HEADER_BYTES + len(record_keys[i])))
                    tag = memoryview(bytearray(self.tag_bytes))
                    out = self.slot_buffer(slots[i])
                    parts = [head, out, tag] if self.tag_bytes else [head, out]
                    try:
                        got = conn.read_value_into(parts, max_other)
                    except RespError as exc:
                        self._server_error(exc)
                        if exc.moved:
                            self.nodes.forget_slots()
                        continue
                    except ProtocolError as exc:  # oversized value: rejected, stream dropped
                        self._reject(block_keys[i], str(exc))
                        verdict[i] = "rejected"
                        raise
                    if got is None:
                        verdict[i] = "absent"
                    elif isinstance(got, bytes):
                        verdict[i] = self._verify_other(block_keys[i], record_keys[i], got, out)
                    else:
                        bad, checksum = self._landed_head(block_keys[i], record_keys[i], head,
                                                          out)
                        verdict[i] = bad or "verifying"
                        if not bad:
                            landed.append((i, record_keys[i], out, tag, checksum))
                            if len(landed) >= per:
                                checks.append(self._check_batch(landed))
                                landed = []
                                reporter.poll()
                    if verdict[i] != "absent":
                        self.stats.get_bytes += len(got) if isinstance(got, bytes) else got
            except (OSError, ProtocolError) as exc:
                self._lost(node, exc)
        if landed:
            checks.append(self._check_batch(landed))
        for positions, check in checks:
            for i, good in zip(positions, check.result()):
                if good:
                    verdict[i] = "hit"
                elif self.tag_bytes:  # the keyed tag covers what the checksum covers, and forgery
                    verdict[i] = self._reject(block_keys[i], "no valid MAC tag", forged=True)
                else:
                    verdict[i] = self._reject(block_keys[i], "corrupt: payload checksum mismatch")
        self.stats.gets += len(verdict)
        self.stats.hits += verdict.count("hit")
        self.stats.misses += verdict.count("absent")
        failed = [i for i, v in enumerate(verdict) if v != "hit"]
        return FetchResult(failed, [i for i in failed if verdict[i] == "lost"])

    def _reject(self, block_key: bytes, why: str, forged: bool = False) -> str:
        self.stats.rejected += 1
        self.stats.unauthenticated += forged
        log.warning("kvtier: remote block %s rejected (%s): a miss", block_key.hex()[:16], why)
        return "rejected"

    def _tag_ok(self, record_key: bytes, stored: memoryview, tag: memoryview) -> bool:
        want = record_mac(self.secrets.mac_key, record_key, stored)
        return hmac.compare_digest(want, bytes(tag))

    def _landed_head(self, block_key: bytes, record_key: bytes, head: memoryview,
                     out: memoryview) -> tuple[str | None, int]:
        """The header checks of a value received in place: a rejection, or None and the
        payload checksum the header states (the payload is checked by :meth:`_payload_ok`)."""
        try:
            h = decode_head(head, record_key)
        except CorruptRecord as exc:
            return self._reject(block_key, f"corrupt: {exc}"), 0
        if h.layout_version != LAYOUT_VERSION:
            return self._reject(block_key, f"layout version {h.layout_version}"), 0
        if h.codec != CODEC_NONE or h.raw_len != len(out) or h.stored_len != len(out):
            return self._reject(block_key, "lengths or codec do not match the slot"), 0
        return None, h.data_checksum

    def _check_batch(self, landed: list[tuple]) -> tuple[list[int], Future]:
        return [v[0] for v in landed], self._hashing.submit(self._payloads_ok, landed)

    def _payloads_ok(self, landed: list[tuple]) -> list[bool]:
        """Each landed payload against its tag (with a MAC key) or its checksum; runs on a
        hashing thread, so it touches no shared state."""
        if self.tag_bytes:
            return [self._tag_ok(key, out, tag) for _, key, out, tag, _ in landed]
        return [data_checksum(key, out) == checksum for _, key, out, _, checksum in landed]

    def _verify_other(self, block_key: bytes, record_key: bytes, value: bytes,
                      out: memoryview) -> str:
        """A value whose size is not an uncompressed record's: a compressed one, or junk."""
        body = memoryview(value)
        if self.tag_bytes:
            if len(value) < self.tag_bytes:
                return self._reject(block_key, "no valid MAC tag", forged=True)
            body, tag = body[:-self.tag_bytes], body[-self.tag_bytes:]
        try:
            h = decode_head(body, record_key)
        except CorruptRecord as exc:  # with a MAC key, whatever lacks a valid tag is forged
            return self._reject(block_key, f"corrupt: {exc}", forged=bool(self.tag_bytes))
        start = HEADER_BYTES + h.key_len
        stored = body[start:]
        if self.tag_bytes and (len(stored) != h.stored_len
                               or not self._tag_ok(record_key, stored, tag)):
            return self._reject(block_key, "no valid MAC tag", forged=True)
        if len(stored) != h.stored_len or h.raw_len != len(out):
            return self._reject(block_key, "truncated or of another block size")
        if h.layout_version != LAYOUT_VERSION:
            return self._reject(block_key, f"layout version {h.layout_version}")
        if data_checksum(record_key, stored) != h.data_checksum:
            return self._reject(block_key, "corrupt: payload checksum mismatch")
        if h.codec == CODEC_NONE:
            return self._reject(block_key, "corrupt: stored length")
        if not self.codec.decode_into(h.codec, bytes(stored), out):
            return self._reject(block_key, "corrupt: codec")
        return "hit"

    def close(self) -> None:
        self.nodes.close()
        self._hashing.shutdown(wait=True)
