"""Admission: per-tier plug-ins (``base``) and request-level wrappers (``wrappers``)."""

from kvtier.manager.admission.base import (
    AdmissionPolicy,
    AdmitAll,
    SightingThreshold,
    make_admission,
    register_admission,
)

__all__ = ["AdmissionPolicy", "AdmitAll", "SightingThreshold", "make_admission", "register_admission"]
