"""Eviction policies, chosen by name in the YAML (``eviction: lru``)."""

from kvtier.manager.policies.base import EvictionPolicy, make_policy, policy_names, register_policy
from kvtier.manager.policies import lru as _lru  # noqa: F401  (registers "lru")

try:  # registered by their modules; absent while under construction
    from kvtier.manager.policies import arc as _arc  # noqa: F401
except ImportError:  # pragma: no cover
    pass

__all__ = ["EvictionPolicy", "make_policy", "policy_names", "register_policy"]
