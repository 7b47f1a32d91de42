"""Worker side: moves blocks between tiers on request, never deciding what to move."""

from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import JobResult, TransferOutcome

__all__ = ["JobResult", "TransferEngine", "TransferHandler", "TransferOutcome"]
