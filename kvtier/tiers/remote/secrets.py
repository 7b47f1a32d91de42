"""What a shared tier's connections need that must never sit in the YAML or a log: the ACL
password, the TLS settings and the key of the records' MAC.

Why a MAC: every record carries an xxh3 checksum, which catches damage but not a forger: anyone
who can SET on the server (every tenant of a shared server, any compromised instance) can plant
a record with a valid checksum holding other bytes. With ``auth_key_file`` every record also
carries a keyed BLAKE3 tag over its identity and payload; a value without a valid tag is a
miss, counted, never loaded. Instances that share a tier share the key file.

Secrets are read once per process and kept out of ``repr`` and out of every message.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass, field

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.wire.redact import redact

MAC_BYTES = 32  # keyed BLAKE3's tag
MIN_KEY_FILE_BYTES = 32


class RemoteSecretError(ValueError):
    """A secret named by the config cannot be used (missing, unreadable, too short, exposed)."""


def _read_private(path: str, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise RemoteSecretError(f"tiers.remote.{what}: cannot open {path}: "
                                f"{exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RemoteSecretError(f"tiers.remote.{what}: {path} is not a regular file")
        if info.st_mode & 0o077:
            raise RemoteSecretError(f"tiers.remote.{what}: {path} is readable by others "
                                    f"(mode {info.st_mode & 0o777:o}): chmod 600 it")
        if info.st_size > 1 << 20:
            raise RemoteSecretError(f"tiers.remote.{what}: {path} is larger than 1 MiB")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            return f.read(1 << 20)
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class RemoteSecrets:
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    mac_key: bytes | None = field(default=None, repr=False)  # 32 bytes: keyed BLAKE3
    tls: bool = False
    tls_ca_file: str | None = None

    @classmethod
    def load(cls, cfg: RemoteTierConfig, environ: dict[str, str] | None = None) -> "RemoteSecrets":
        env = os.environ if environ is None else environ
        password = None
        if cfg.password_file is not None:
            text = _read_private(cfg.password_file, "password_file").decode("utf-8", "replace")
            password = text.splitlines()[0] if text else ""
        elif cfg.password_env is not None:
            if cfg.password_env not in env:
                raise RemoteSecretError(f"tiers.remote.password_env: the environment has no "
                                        f"{cfg.password_env}")
            password = env[cfg.password_env]
        mac_key = None
        if cfg.auth_key_file is not None:
            raw = _read_private(cfg.auth_key_file, "auth_key_file")
            material = raw.rstrip(b"\r\n")  # `openssl rand -hex 32 > file` ends in a newline
            if len(material) < MIN_KEY_FILE_BYTES:
                raise RemoteSecretError(f"tiers.remote.auth_key_file: {cfg.auth_key_file} holds "
                                        f"fewer than {MIN_KEY_FILE_BYTES} bytes of key")
            import blake3

            mac_key = blake3.blake3(material).digest()  # any length in, 32 bytes out
        return cls(username=cfg.username, password=password, mac_key=mac_key,
                   tls=cfg.uses_tls, tls_ca_file=cfg.tls_ca_file)

    def redact(self, text: str) -> str:
        """``text`` (a server's error, an exception) with every secret of these replaced by
        ``***`` and any command arguments a server echoed cut off (:mod:`.redact`)."""
        words = [self.password or "", f"{self.username} {self.password}" if self.password else ""]
        if self.mac_key:
            words += [self.mac_key.hex(), repr(self.mac_key)[2:-1]]
        return redact(text, words)

    @property
    def record_seq(self) -> int:
        """What a record's header carries in its ``seq`` field: 0 without a MAC key, else an
        identifier of the key (not the key: a keyed hash of a constant). A value's header can
        then be checked without its payload (write-back's "already held") and a record
        written under an old key is told apart from one under this key."""
        if not self.mac_key:
            return 0
        import blake3

        tag = blake3.blake3(b"kvtier record key id", key=self.mac_key).digest()
        return int.from_bytes(tag[:8], "little") >> 1 or 1

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca_file)
        return ctx

    def to_wire(self) -> dict:
        """For a child process, over its private socket (never its command line)."""
        return {"username": self.username, "password": self.password,
                "mac_key": self.mac_key.hex() if self.mac_key else None, "tls": self.tls,
                "tls_ca_file": self.tls_ca_file}

    @classmethod
    def from_wire(cls, d: dict) -> "RemoteSecrets":
        key = d.get("mac_key")
        return cls(username=d.get("username"), password=d.get("password"),
                   mac_key=bytes.fromhex(key) if key else None, tls=bool(d.get("tls")),
                   tls_ca_file=d.get("tls_ca_file"))


def record_mac(mac_key: bytes, record_key: bytes, stored: memoryview | bytes) -> bytes:
    """The keyed tag of one record: over its identity (server key + geometry) and its bytes, so
    a valid tag can neither be moved to another key nor kept over other bytes."""
    import blake3

    h = blake3.blake3(key=mac_key)
    h.update(len(record_key).to_bytes(4, "little"))
    h.update(record_key)
    h.update(stored)
    return h.digest()
