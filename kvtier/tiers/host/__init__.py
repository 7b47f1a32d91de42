"""The host tier: one CPU pool per host that every kvtier instance on it (every vLLM engine,
every TP rank) maps, so a block one instance stored is a CPU hit for the others.

* ``directory.py``: the index (regions, published keys, readers' pins), in the service;
* ``service.py``: the per-host process that owns the pools' memory and the index;
* ``client.py``: an instance's connection (and the service's start);
* ``protocol.py``: the frames between them.
"""

from kvtier.tiers.host.client import HostAddress, HostClient, HostTierUnavailable

__all__ = ["HostAddress", "HostClient", "HostTierUnavailable"]
