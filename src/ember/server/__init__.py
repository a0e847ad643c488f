"""`ember serve`: Tinker's HTTP protocol over `ember.service` for the official `tinker` SDK.

`create_app(service, ServerConfig(...))` builds the FastAPI app; `ember.server.wire` holds
the protobuf/JSON codecs; `ember.server.cli` is the `ember serve` subcommand.
"""

from ember.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from ember.server.app import create_app

        return create_app
    raise AttributeError(f"module 'ember.server' has no attribute {name!r}")
