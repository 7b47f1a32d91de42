"""Admission: per-tier plug-ins (``base``) and request-level wrappers (``wrappers``)."""

from kvtier.manager.admission.base import (
    AdmissionPolicy,
    AdmitAll,
    SightingThreshold,
    admission_names,
    make_admission,
    register_admission,
)
from kvtier.manager.admission import reuse_gate as _reuse_gate  # noqa: F401  (registers it)

__all__ = ["AdmissionPolicy", "AdmitAll", "SightingThreshold", "admission_names", "make_admission",
           "register_admission"]
