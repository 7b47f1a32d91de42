"""The shared tier: verified kvtier records in Redis / Valkey (standalone or Cluster)."""

from kvtier.tiers.remote.keys import RemoteKeys, derive_namespace
from kvtier.tiers.remote.store import RemoteStore, RemoteUnavailable

__all__ = ["RemoteKeys", "RemoteStore", "RemoteUnavailable", "derive_namespace"]
