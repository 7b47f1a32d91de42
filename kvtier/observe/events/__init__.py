"""kvtier's KV-event stream: vLLM-compatible ZMQ publisher with replay, and a consumer.

Sits above the manager (it turns manager events into wire events) and below connectors and
the CLI. See ``wire`` for the format, ``publisher`` for delivery guarantees.
"""

from kvtier.observe.events.consumer import Delivery, EventSubscriber, Gap
from kvtier.observe.events.feed import ManagerFeed, resident_blocks
from kvtier.observe.events.metadata import BlockMeta, MetadataCache, MetadataLookup
from kvtier.observe.events.publisher import EventPublisher, PublisherStats
from kvtier.observe.events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    WIRE_MEDIUM,
    AllBlocksCleared,
    BlockAccessed,
    BlockRemoved,
    BlockStored,
    KvtierEventBatch,
    ReplayGap,
    decode_batch,
    encode_batch,
)

__all__ = [
    "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "WIRE_MEDIUM",
    "AllBlocksCleared", "BlockAccessed", "BlockMeta", "BlockRemoved", "BlockStored",
    "Delivery", "EventPublisher", "EventSubscriber", "Gap", "KvtierEventBatch", "ManagerFeed",
    "MetadataCache", "MetadataLookup", "PublisherStats", "ReplayGap", "decode_batch",
    "encode_batch", "resident_blocks",
]
