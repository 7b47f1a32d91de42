"""kvtier settings: YAML / dict / environment in, validated frozen dataclasses out."""

from kvtier.config.errors import ConfigError
from kvtier.config.env import ENV_OVERRIDES
from kvtier.config.loader import load_config
from kvtier.config.schema import (ADMISSION_POLICIES, COMPRESSIONS, EVICTION_POLICIES,
                                  AdmissionConfig, CostConfig, CpuTierConfig, DiskTierConfig,
                                  EventsConfig, KvtierConfig, MetricsConfig, StatsConfig)
from kvtier.config.remote import RemoteTierConfig
from kvtier.config.sizes import format_size, parse_size

__all__ = [
    "ADMISSION_POLICIES", "COMPRESSIONS", "ENV_OVERRIDES", "EVICTION_POLICIES", "AdmissionConfig",
    "ConfigError", "CostConfig", "CpuTierConfig", "DiskTierConfig", "EventsConfig",
    "KvtierConfig", "MetricsConfig", "RemoteTierConfig", "StatsConfig", "format_size",
    "load_config", "parse_size",
]
