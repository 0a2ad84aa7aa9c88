"""UMBP: a distributed KV-cache page pool for LLM inference.

``umbp.Client`` is the public entry point; it is imported lazily so that leaf modules (``umbp.errors``,
``umbp.sizes``, ``umbp.config``) can be used by the metaserver without pulling in the client and its transports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Client", "__version__"]

if TYPE_CHECKING:
    from umbp.client import Client


def __getattr__(name: str):
    if name == "Client":
        from umbp.client import Client

        return Client
    raise AttributeError(f"module 'umbp' has no attribute {name!r}")
