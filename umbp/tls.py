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

import ctypes
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


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
TLS_MMAP_THRESHOLD = 64 << 20
TLS_TRIM_THRESHOLD = 256 << 20


def tune_malloc_for_tls() -> bool:
    """Keep a TLS server's large transient buffers off mmap (glibc; False, changing nothing, elsewhere).

    The event loop's TLS transport (uvloop's and asyncio's ``SSLProtocol``) encrypts each write into a memory BIO
    and reads the ciphertext out into a new bytes object of the write's size: 1 MiB and more for a node's page.
    glibc serves a block that large with mmap and returns it with munmap, and its dynamic threshold never keeps the
    next block of the same size on the heap, so every answer touched 256+ fresh pages (page faults, zeroing):
    py-spy put 45 % of a TLS node's CPU in ``MemoryBIO.read``'s copy and 3 % in munmap. With blocks up to 64 MiB on
    the heap and its top kept up to 256 MiB, tcp gets of 1 MiB x64 over TLS went 0.46-0.48 -> 0.63-0.67 GB/s on
    the 2-core VM (blocking Python TLS over loopback, no event loop: 0.90-1.05 GB/s). The cost: freed buffers stay
    in the process (up to the trim threshold) instead of going back to the kernel at once."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, TLS_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   TLS_TRIM_THRESHOLD))


def trim_malloc() -> bool:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``; False, doing nothing, elsewhere).

    A connection flood's buffers (readers' staging, the event loop's TLS read buffer of 256 KiB a connection,
    OpenSSL's state) are freed when its connections close, but glibc keeps freed heap memory in the process: 3,000
    TLS handshakes held left a node 700 MB larger after they had gone, and ``tune_malloc_for_tls`` keeps even
    large blocks on the heap. malloc_trim returns every free page of every arena whatever the trim threshold (a
    few ms for a heap of some hundred MB); the servers call it, at most once a second, after enough connection
    memory was freed (umbp/serving.py)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


# Kernel TLS (kTLS) for the client's receive side, opt-in: OpenSSL moves the record decryption into the kernel after
# the handshake (the socket's ULP becomes "tls"), so a receive is one syscall and no Python per 16 KiB record. Needs
# the kernel's tls module (``/proc/sys/net/ipv4/tcp_available_ulp`` lists "tls"), an OpenSSL built with it (3.0+;
# Python 3.12 names the option ``ssl.OP_ENABLE_KTLS``, 3.11 takes its bit), and for receiving OpenSSL 3.0 only TLS
# 1.2 (so kTLS also caps the client at 1.2, AES-GCM). The node encrypts into a memory BIO (transport/tlsserve.py),
# where kTLS cannot apply. Opted into by ``ClientConfig.ktls`` (its data connections to nodes only). Not available on
# the 2-core VM (no tls ULP): unmeasured; bench/getpath.py --tls says which.
OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)  # SSL_OP_ENABLE_KTLS, OpenSSL 3.0's SSL_OP_BIT(3)
TCP_ULP = 31  # linux/tcp.h: the socket's upper-layer protocol ("tls" once kTLS is on)


def ktls_status() -> tuple[bool, str]:
    """(whether kTLS can be tried here, why or why not): the kernel's tls ULP and the OpenSSL version."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as fh:
            ulps = fh.read().split()
    except OSError:
        return False, "no /proc/sys/net/ipv4/tcp_available_ulp (not Linux?)"
    if "tls" not in ulps:
        return False, f"the kernel offers no tls ULP (tcp_available_ulp: {' '.join(ulps) or 'none'}; modprobe tls)"
    if ssl.OPENSSL_VERSION_INFO < (3, 0):
        return False, f"{ssl.OPENSSL_VERSION} has no kTLS option (3.0+)"
    return True, f"kernel tls ULP and {ssl.OPENSSL_VERSION}"


def ktls_engaged(sock) -> bool:
    """Whether a connected socket's receive path runs in the kernel's TLS (its ULP is "tls")."""
    try:
        return sock.getsockopt(6, TCP_ULP, 16).rstrip(b"\0") == b"tls"  # 6: IPPROTO_TCP
    except OSError:
        return False


@functools.lru_cache(maxsize=8)
def _client_context(ca: str, ktls: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)  # verifies the chain and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ktls:
        ctx.options |= OP_ENABLE_KTLS
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2  # OpenSSL 3.0 receives over kTLS with 1.2 only
    return ctx


def client_context(ca: str, component: str = "tls", ktls: bool = False) -> ssl.SSLContext:
    """The context a client connects with (one per CA file and ``ktls``, shared); ConfigError when the file is no CA
    bundle."""
    try:
        return _client_context(ca, ktls)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(component, f"cannot load the TLS CA bundle {ca}: {e}") from e
