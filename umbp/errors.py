"""One error hierarchy for every UMBP component.

Every message starts with the component that raised it ("metaserver: pool full", "node n1: bad range"), so a log
line or a traceback names where things went wrong without a stack walk. Foreign errors (OSError, aetcd/grpc,
pyverbs) are translated at the boundary with ``raise ... from``; nothing above the transports sees them raw.

This module is a leaf: it imports nothing from UMBP, so the metaserver, the transports and the client may all use it.
"""

from __future__ import annotations


class UmbpError(Exception):
    """Base of every error UMBP raises on purpose."""

    def __init__(self, component: str, message: str):
        self.component = component
        self.detail = message
        super().__init__(f"{component}: {message}")


class ConfigError(UmbpError, ValueError):
    """A setting is missing, malformed or out of range (raised at construction, never later)."""


class StartupError(UmbpError):
    """A process could not start: its port is busy, its arena file cannot be created, a child it launched exited."""


class ProtocolError(UmbpError):
    """Bytes on a connection do not form a valid frame; the connection that carried them is no longer usable."""


class FrameTooLarge(ProtocolError):
    """A frame announces a meta or data part over the receiver's limit (a server answers TOO_LARGE, not BAD_FRAME)."""


class TransportError(UmbpError):
    """A peer could not be reached, closed the connection, or a transfer failed mid-way."""


class TransportUnavailable(TransportError):
    """The transport the caller forced (``transport="shm"``/``"rdma"``) cannot reach this node at all."""


class DeadlineExceeded(TransportError, TimeoutError):
    """An operation did not finish within its deadline (which covers every retry of it)."""


class CorruptionError(UmbpError):
    """Bytes read back do not match the object header (key hash, generation, length, checksum).

    Raised instead of ever handing wrong bytes to the caller: a stale or torn read is an error, not data."""


class RemoteError(UmbpError):
    """A server answered a request with an error code; ``code`` is the ``transport.wire.Status`` value."""

    code: int = 0

    def __init__(self, component: str, message: str, code: int | None = None):
        super().__init__(component, message)
        if code is not None:
            self.code = code


class BadRequest(RemoteError, ValueError):
    """The server rejected the request as malformed: wrong types, unknown fields, values out of range."""


class NotFound(RemoteError, KeyError):
    """The key, node or object the request names does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class PoolFull(RemoteError):
    """No space can be found or freed: every evictable page is leased, pending, or too small a hole."""


class QuotaExceeded(PoolFull):
    """A put would take its namespace over its quota (bytes, from the tokens file's ``[quotas]`` table) even after
    evicting the namespace's own unpinned pages; the message names the namespace. A ``PoolFull`` for callers that
    treat both alike."""

    code = 12  # transport.wire.Status.QUOTA


class NotLeader(RemoteError):
    """This metaserver is a standby; ``leader`` (when known) is the address of the current leader."""

    def __init__(self, component: str, message: str, code: int | None = None, leader: str | None = None):
        super().__init__(component, message, code)
        self.leader = leader


class Unavailable(RemoteError):
    """The server is alive but cannot serve now (starting up, etcd unreachable, shutting down). Retryable."""


class TxnTooLarge(Unavailable):
    """etcd refused a transaction for its number of operations (its ``--max-txn-ops``): retryable in smaller ones
    (the metaserver's etcd writer splits and lowers its transaction size, ``metaserver/store/batcher.py``)."""


class AuthError(RemoteError, PermissionError):
    """The connection did not authenticate, or the token does not grant this namespace."""

    code = 10  # transport.wire.Status.AUTH (this module imports nothing of UMBP)


class InvalidArgument(UmbpError, TypeError):
    """A caller passed a value of the wrong type or shape (a non-contiguous tensor, a key that is too long)."""
