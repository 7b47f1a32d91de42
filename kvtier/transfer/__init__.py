"""Worker side: moves blocks between tiers on request, never deciding what to move."""

from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import DirectionStats, JobResult, Route, TransferOutcome, route_name

__all__ = [
    "DirectionStats",
    "JobResult",
    "Route",
    "TransferEngine",
    "TransferHandler",
    "TransferOutcome",
    "route_name",
]
