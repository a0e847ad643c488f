"""The multi-tenant core: sessions, training runs, ordered request queues, futures,
sampler snapshots, checkpoints and their persistence. No HTTP here (see `ember.server`).

Public surface: `ServiceAPI` (the interface, `ember.service.api`), `Service` (its
implementation), `build_service` (a Service from its config) and `ServiceConfig`. Each is
imported on first use (`ember.registry.lazy_exports`): `ember.service.config` loads
without tinker or torch.
"""

from ember.registry import lazy_exports

_EXPORTS = {
    "BusyError": "ember.service.api",
    "FutureState": "ember.service.api",
    "NotFoundError": "ember.service.api",
    "ServerError": "ember.service.api",
    "Service": "ember.service.core",
    "ServiceAPI": "ember.service.api",
    "ServiceConfig": "ember.service.config",
    "ServiceError": "ember.service.api",
    "SessionGoneError": "ember.service.api",
    "Submission": "ember.service.api",
    "UserError": "ember.service.api",
    "build_service": "ember.service.core",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
