"""The errors that say whose fault a failure is: `UserError` (the caller's input) and the rest.

A failed request reports a category (docs/protocol.md): `user` when the request itself was
wrong, `server` otherwise. The category is decided by the exception's type and nothing
else: code that validates what a caller sent raises `UserError` (a `ValueError`, so plain
Python callers may catch either) naming what was wrong; any other exception -- a
`ValueError` from torch or numpy caused by a bug in ember included -- is a `server` error,
logged with its traceback. It lives here, below every package, so that the engine, the
losses, the samplers and the models raise it at their own validation boundaries without
importing the service (which re-exports these names: `ember.service.UserError`).
"""

from __future__ import annotations

from tinker import types


class ServiceError(Exception):
    """Base of the errors raised by direct calls. `category` as in RequestFailedResponse."""

    category: types.RequestErrorCategory = types.RequestErrorCategory.Unknown


class UserError(ServiceError, ValueError):
    """Bad input from the caller (HTTP 400)."""

    category = types.RequestErrorCategory.User


class ServerError(ServiceError, RuntimeError):
    """Our fault (HTTP 500)."""

    category = types.RequestErrorCategory.Server
