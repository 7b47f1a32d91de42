"""Load failures for connector tests: a worker's CPU -> GPU copy that raises, as a failed copy
would (the job fails, none of its engine blocks is trusted). Only the copy is replaced; the
worker, its transfer engine and vLLM's scheduler run as they do in production."""

from __future__ import annotations

from kvtier.manager.specs import Medium


def fail_next_copy(worker_connector) -> list:
    """The worker's next CPU -> GPU copy raises; later ones run. Returns the list that records
    the destination of the copy that failed."""
    handler = worker_connector._worker.runtime.engine._handlers[(Medium.CPU, Medium.GPU)]
    original, failed = handler.run, []

    async def run(src, dst):
        if not failed:
            failed.append(dst)
            raise OSError("injected: the CPU -> GPU copy failed")
        return await original(src, dst)

    handler.run = run
    return failed
