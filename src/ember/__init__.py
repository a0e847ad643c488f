"""ember: a self-hosted post-training engine speaking Tinker's training API.

`ember.ServiceClient()` is the in-process client (same methods and types as the official
`tinker` SDK); `ember serve` exposes the same service over Tinker's HTTP protocol.
"""

__version__ = "0.1.0"

__all__ = ["ServiceClient", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import ember.losses` does not pull in the whole service stack.
    if name == "ServiceClient":
        from ember.client import ServiceClient

        return ServiceClient
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
