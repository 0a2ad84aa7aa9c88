"""TLS for UMBP's TCP connections (the standard library's ``ssl``): contexts for servers and clients.

Optional: a server given ``tls_cert`` and ``tls_key`` (``--tls-cert``/``--tls-key``) serves TLS only on its TCP
port (metaserver control, node data and the RDMA queue-pair exchange, node registration); a client given ``tls_ca``
(``tls_ca=``, ``UMBP_TLS_CA``, ``--tls-ca``) speaks TLS to every metaserver and node it reaches over TCP and checks
each certificate against that CA bundle and the address it dialled (a certificate for ``127.0.0.1`` needs
``subjectAltName = IP:127.0.0.1``). Client certificates are not asked for: clients authenticate with their token
(umbp/auth.py) inside the encrypted connection. The shm path needs none (same host); RDMA data moves on its own
network, unencrypted. TLS 1.2 at least. Costs: one handshake per connection (a few ms), then AES-GCM on every byte
(the bench prints the throughput ratio of 1 MiB gets with TLS off and on).

A leaf module (imports only ``umbp.errors``), shared by the metaserver, the node and the clients.
"""

from __future__ import annotations

import functools
import ssl

from umbp.errors import ConfigError


def server_context(cert: str, key: str, component: str) -> ssl.SSLContext | None:
    """The context a server wraps its listener in; None when it serves plain TCP (no cert given)."""
    if not cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(component, f"cannot load the TLS certificate {cert} and key {key}: {e}") from e
    return ctx


@functools.lru_cache(maxsize=8)
def _client_context(ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)  # verifies the chain and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_context(ca: str, component: str) -> ssl.SSLContext:
    """The context a client connects with (one per CA file, shared); ConfigError when the file is no CA bundle."""
    try:
        return _client_context(ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(component, f"cannot load the TLS CA bundle {ca}: {e}") from e
