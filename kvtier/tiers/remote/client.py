"""The redis-py asyncio client for a ``tiers.remote`` config, with bounded waits.

redis-py's defaults do not suit a tier under a scheduler: a standalone client with no socket
timeout waits forever on a hung (SIGSTOPped) server, and a Cluster client retries a dead node
for tens of seconds. Here every socket has ``connect_timeout_s`` / ``timeout_s``, retries are
``retries`` with a short backoff, and Cluster slot-map refreshes are bounded the same way.
hiredis, when installed, parses replies (redis-py picks it up by itself).
"""

from __future__ import annotations

from typing import Any

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.remote.secrets import RemoteSecrets

MAX_CONNECTIONS = 32  # per server node; the store keeps fewer commands than this in flight


def make_client(cfg: RemoteTierConfig, secrets: RemoteSecrets | None = None) -> Any:
    """A ``redis.asyncio.Redis`` or ``RedisCluster``; create it on the loop that will use it.
    ``secrets``: the ACL user and password and TLS settings (the same the I/O processes use)."""
    try:
        from redis.asyncio import Redis
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError, TimeoutError
    except ImportError as exc:  # pragma: no cover - the extra is part of the test deps
        raise RuntimeError("tiers.remote needs redis-py: pip install 'kvtier[remote]' "
                           f"(redis[hiredis]); {exc}") from None
    retry = Retry(ExponentialBackoff(cap=0.05, base=0.005), cfg.retries)
    common = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.connect_timeout_s,
                  retry=retry, retry_on_error=[ConnectionError, TimeoutError],
                  decode_responses=False, socket_keepalive=True)
    url = cfg.url
    if secrets is not None:
        if secrets.username:
            common["username"] = secrets.username
        if secrets.password is not None:
            common["password"] = secrets.password
        if secrets.tls:
            if cfg.cluster:
                common["ssl"] = True
            elif url.startswith("redis://"):  # tls: true on a plain URL
                url = "rediss://" + url[len("redis://"):]
            if secrets.tls_ca_file:
                common["ssl_ca_certs"] = secrets.tls_ca_file
    if cfg.cluster:
        nodes = [ClusterNode(host, int(port)) for host, _, port in
                 (n.rpartition(":") for n in cfg.nodes)]
        # require_full_coverage=False: a dead primary costs only the keys of its slots
        return RedisCluster(startup_nodes=nodes, require_full_coverage=False,
                            max_connections=MAX_CONNECTIONS,
                            **common)
    return Redis.from_url(url, max_connections=MAX_CONNECTIONS, **common)
