"""The multi-tenant core: sessions, training runs, ordered request queues, futures,
sampler snapshots, checkpoints and their persistence. No HTTP here (see `ember.server`).

Public surface: `ServiceAPI` (the interface, `ember.service.api`), `Service` (its
implementation), `build_service` (a Service from its config) and `ServiceConfig`.
"""

from ember.service.api import (
    FutureState,
    NotFoundError,
    ServerError,
    ServiceAPI,
    ServiceError,
    SessionGoneError,
    Submission,
    UserError,
)
from ember.service.config import ServiceConfig

__all__ = [
    "FutureState",
    "NotFoundError",
    "ServerError",
    "Service",
    "ServiceAPI",
    "ServiceConfig",
    "ServiceError",
    "SessionGoneError",
    "Submission",
    "UserError",
    "build_service",
]


def __getattr__(name: str):
    if name in ("Service", "build_service"):
        from ember.service import core

        return getattr(core, name)
    raise AttributeError(f"module 'ember.service' has no attribute {name!r}")
