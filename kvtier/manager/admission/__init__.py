"""Admission: per-tier plug-ins and the offload limit (``base``), the sighting-threshold wrapper
(``wrappers``)."""

from kvtier.manager.admission.base import (
    AdmissionPolicy,
    AdmitAll,
    OffloadLimit,
    SightingThreshold,
    admission_names,
    make_admission,
    register_admission,
)
from kvtier.manager.admission import reuse_gate as _reuse_gate  # noqa: F401  (registers it)

__all__ = ["AdmissionPolicy", "AdmitAll", "OffloadLimit", "SightingThreshold", "admission_names",
           "make_admission", "register_admission"]
