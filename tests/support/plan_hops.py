"""A load plan's DISK -> CPU hop, as the tests drive it by hand (production builds every hop
of a load in ``kvtier.runtime.load_job``)."""

from __future__ import annotations

from kvtier.manager.specs import LoadPlan, LoadStoreSpec


def disk_hop(plan: LoadPlan) -> tuple[LoadStoreSpec, LoadStoreSpec] | None:
    idx = [i for i, d in enumerate(plan.from_disk) if d]
    if not idx:
        return None
    return (LoadStoreSpec.disk([plan.keys[i] for i in idx]),
            LoadStoreSpec.cpu([plan.cpu_slots[i] for i in idx]))
