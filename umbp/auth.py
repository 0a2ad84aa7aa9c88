"""Authentication and authorization: tokens, scopes, the challenge-response handshake, and the capabilities a
metaserver grants for node reads and writes. Sans-I/O (HMAC arithmetic and tables only); a leaf module that the
metaserver, the nodes and the clients all import.

Tokens. A pool runs *open* (no token: everything allowed, said loudly at start-up) or *closed*:

- ``--token SECRET`` (or ``UMBP_TOKEN``): one secret, shared by every process of the pool, with every right;
- ``--tokens FILE``: a TOML table of scoped tokens plus the cluster secret::

      cluster_secret = "..."                 # metaservers and nodes: node registration, capabilities, object tags
      [[tokens]]
      name = "tenant-a"
      secret = "..."
      namespaces = { "tenant-a" = "rw", "shared/*" = "r" }   # fnmatch patterns -> r | rw
      [[tokens]]
      name = "ops"
      secret = "..."
      admin = true                           # EVICT, DRAIN, LIST of every namespace (and every namespace rw)

  The cluster secret itself is a token with every right (nodes use it to register).

Handshake (every control and data connection; the secret never crosses the wire)::

    client -> HELLO {"client": name, "nonce": 32 random bytes}
    server -> {"server", "version", "auth": bool, "nonce": 32 random bytes}
    client -> AUTH {"id": token_id(secret), "proof": HMAC(secret, "client" | server_nonce | client_nonce)}
    server -> {"scope": name, "proof": HMAC(secret, "server" | client_nonce | server_nonce)}

The server's proof lets the client tell a real server from an impostor that only collects proofs. Until AUTH
succeeds a closed server answers every other request (PING and HELLO aside) with AUTH "authentication required".

Capabilities. In a closed pool the metaserver hands a writer, with each allocation, ``HMAC(cap_key, "w" | offset |
payload_len | gen)`` and a reader, with each lookup, ``HMAC(cap_key, "r" | offset | payload_len | gen)``; the node
checks them before touching its arena, so a connection can only write the slots it was granted and read the objects
it looked up (namespace rights are checked at the metaserver). ``cap_key`` is derived from the cluster secret, the
node id and the arena id: both sides compute it, nothing about it crosses the wire. The object header's key hash
becomes ``HMAC(cluster_secret, ns | key)`` (the *tag*), handed out by the metaserver, so a header built from public
fields does not pass a reader's check.

What this does not cover: a process that can map an arena file (same host, file permissions) or holds a node's RDMA
rkey can read and write that arena directly; the rkey and the arena path are only told to authenticated clients.
Confidentiality on the wire needs TLS (not built yet). Costs: one HMAC-SHA256 per handshake step, about 1 µs per
capability or tag.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import struct
import tomllib
from dataclasses import dataclass

from umbp.errors import AuthError, ConfigError

NONCE_BYTES = 32
_CAP = struct.Struct("<cQQQ")


@dataclass(frozen=True)
class Scope:
    """What one token may do. ``namespaces``: (fnmatch pattern, "r" | "rw") pairs, first match wins."""

    name: str
    namespaces: tuple[tuple[str, str], ...] = ()
    admin: bool = False
    node: bool = False  # may register and heartbeat as a storage node

    def right(self, ns: str) -> str:
        if self.admin:
            return "rw"
        for pattern, right in self.namespaces:
            if fnmatch.fnmatchcase(ns, pattern):
                return right
        return ""

    def check(self, ns: str, write: bool, component: str) -> None:
        right = self.right(ns)
        if not right or (write and right != "rw"):
            what = "write" if write else "read"
            raise AuthError(component, f"token {self.name!r} may not {what} namespace {ns!r}")


FULL = Scope("full", (("*", "rw"),), admin=True, node=True)  # the cluster secret; and everyone in an open pool


def token_id(secret: bytes) -> str:
    """A public name for a secret (what AUTH sends instead of it)."""
    return hashlib.sha256(b"umbp-token-id|" + secret).hexdigest()[:16]


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.digest(secret, b"umbp-auth-v1|" + role + b"|" + first + second, "sha256")


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class Tokens:
    """The secrets a server accepts. ``Tokens.open()`` accepts everything; ``closed`` is False then."""

    def __init__(self, cluster_secret: bytes | None, scoped: dict[str, tuple[bytes, Scope]]):
        self.cluster_secret = cluster_secret
        self._by_id = dict(scoped)
        if cluster_secret is not None:
            self._by_id[token_id(cluster_secret)] = (cluster_secret, FULL)

    @property
    def closed(self) -> bool:
        return self.cluster_secret is not None

    @classmethod
    def load(cls, token: str | None, tokens_file: str | None, component: str) -> "Tokens":
        """From ``--token`` and/or ``--tokens FILE`` (a token given both ways must be the file's cluster secret)."""
        scoped: dict[str, tuple[bytes, Scope]] = {}
        cluster = token.encode() if token else None
        if tokens_file:
            try:
                with open(tokens_file, "rb") as fh:
                    doc = tomllib.load(fh)
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(component, f"cannot read tokens file {tokens_file}: {e}") from e
            cs = doc.get("cluster_secret")
            if not isinstance(cs, str) or len(cs) < 16:
                raise ConfigError(component, f"{tokens_file}: cluster_secret must be a string of 16+ characters")
            if cluster is not None and cluster != cs.encode():
                raise ConfigError(component, "--token differs from the tokens file's cluster_secret")
            cluster = cs.encode()
            for i, t in enumerate(doc.get("tokens", [])):
                where = f"{tokens_file}: tokens[{i}]"
                if not isinstance(t, dict) or not isinstance(t.get("secret"), str) or len(t["secret"]) < 16:
                    raise ConfigError(component, f"{where}: secret must be a string of 16+ characters")
                unknown = set(t) - {"name", "secret", "namespaces", "admin"}
                if unknown:
                    raise ConfigError(component, f"{where}: unknown fields {sorted(unknown)}")
                nss = t.get("namespaces", {})
                if not isinstance(nss, dict) or not all(r in ("r", "rw") for r in nss.values()):
                    raise ConfigError(component, f"{where}: namespaces must map patterns to 'r' or 'rw'")
                secret = t["secret"].encode()
                scope = Scope(str(t.get("name", f"token{i}")), tuple(nss.items()), bool(t.get("admin", False)))
                scoped[token_id(secret)] = (secret, scope)
        return cls(cluster, scoped)

    def verify(self, tid: object, client_proof: object, server_nonce: bytes, client_nonce: bytes,
               component: str) -> tuple[Scope, bytes]:
        """Check an AUTH request; returns (scope, the server's proof). Raises AuthError."""
        found = self._by_id.get(tid) if isinstance(tid, str) else None
        if found is None or not isinstance(client_proof, bytes):
            raise AuthError(component, "authentication failed: unknown token")
        secret, scope = found
        if not hmac.compare_digest(client_proof, proof(secret, b"client", server_nonce, client_nonce)):
            raise AuthError(component, "authentication failed: wrong proof")
        return scope, proof(secret, b"server", client_nonce, server_nonce)

    # -- capabilities and tags (closed pools only; an open pool uses keyless values) -------------------------
    def cap_key(self, node_id: str, arena_id: bytes) -> bytes | None:
        if self.cluster_secret is None:
            return None
        return hmac.digest(self.cluster_secret, b"umbp-cap-v1|" + node_id.encode() + b"|" + arena_id, "sha256")

    def tag(self, ns: str, key: bytes) -> int:
        """The object header's key hash: keyed in a closed pool, ``wire.key_hash``'s blake2b in an open one."""
        if self.cluster_secret is None:
            h = hashlib.blake2b(ns.encode() + b"\0" + key, digest_size=8).digest()
        else:
            h = hmac.digest(self.cluster_secret, b"umbp-tag-v1|" + ns.encode() + b"\0" + key, "sha256")[:8]
        return int.from_bytes(h, "little")


def capability(cap_key: bytes | None, kind: bytes, offset: int, payload_len: int, gen: int) -> bytes:
    """The grant to read (kind b"r") or write (b"w") one object; b"" when the pool is open."""
    if cap_key is None:
        return b""
    return hmac.digest(cap_key, _CAP.pack(kind, offset, payload_len, gen), "sha256")[:16]


def check_capability(cap_key: bytes | None, cap: object, kind: bytes, offset: int, payload_len: int, gen: int,
                     component: str) -> None:
    if cap_key is None:
        return
    if not isinstance(cap, bytes) or not hmac.compare_digest(cap, capability(cap_key, kind, offset, payload_len,
                                                                            gen)):
        what = "write to" if kind == b"w" else "read"
        raise AuthError(component, f"no valid capability to {what} the object at {offset}")


class ClientAuth:
    """The client side of the handshake, in steps so blocking and asyncio callers share it::

        hello = auth.hello_meta(name); reply = <HELLO>; meta = auth.auth_meta(reply)
        if meta is not None: auth.check(<AUTH with meta>)
    """

    def __init__(self, token: str | None, component: str):
        self.secret = token.encode() if token else None
        self.component = component
        self.nonce = nonce()
        self._server_nonce = b""
        self.scope = "open"

    def hello_meta(self, client_name: str) -> dict:
        return {"client": client_name, "nonce": self.nonce}

    def auth_meta(self, hello: object) -> dict | None:
        """The AUTH request to send after this HELLO answer, or None when the server is open."""
        if not isinstance(hello, dict) or not hello.get("auth"):
            return None
        if self.secret is None:
            raise AuthError(self.component, f"{hello.get('server', 'server')} requires a token (--token, "
                                            f"UMBP_TOKEN or Client(token=...))")
        sn = hello.get("nonce")
        if not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
            raise AuthError(self.component, "server sent no valid challenge")
        self._server_nonce = sn
        return {"id": token_id(self.secret), "proof": proof(self.secret, b"client", sn, self.nonce)}

    def check(self, reply: object) -> str:
        """Verify the server's proof in the AUTH answer; returns the granted scope name."""
        sp = reply.get("proof") if isinstance(reply, dict) else None
        if not isinstance(sp, bytes) or not hmac.compare_digest(
                sp, proof(self.secret, b"server", self.nonce, self._server_nonce)):
            raise AuthError(self.component, "the server could not prove it knows the token (impostor?)")
        self.scope = str(reply.get("scope", "?"))
        return self.scope


class ServerAuth:
    """Per-connection state of the server side: ``hello`` then ``auth``; ``scope`` is set once authenticated."""

    __slots__ = ("tokens", "component", "nonce", "client_nonce", "scope")

    def __init__(self, tokens: Tokens, component: str):
        self.tokens = tokens
        self.component = component
        self.nonce = nonce()
        self.client_nonce = b""
        self.scope: Scope | None = None if tokens.closed else FULL

    def hello(self, meta: object, server: str, version: int) -> dict:
        """Answer HELLO; remembers the client's nonce for AUTH (a HELLO without one cannot authenticate)."""
        cn = meta.get("nonce") if isinstance(meta, dict) else None
        self.client_nonce = cn if isinstance(cn, bytes) and len(cn) == NONCE_BYTES else b""
        return {"server": server, "version": version, "auth": self.tokens.closed, "nonce": self.nonce}

    def auth(self, meta: object) -> dict:
        if not isinstance(meta, dict) or set(meta) != {"id", "proof"}:
            raise AuthError(self.component, "AUTH: meta must be {'id', 'proof'}")
        if not self.client_nonce:
            raise AuthError(self.component, "AUTH before a HELLO carrying a 32-byte nonce")
        scope, server_proof = self.tokens.verify(meta["id"], meta["proof"], self.nonce, self.client_nonce,
                                                 self.component)
        self.scope = scope
        return {"scope": scope.name, "proof": server_proof}

    def require(self) -> Scope:
        """The connection's scope; AuthError when a closed server has not seen a valid AUTH yet."""
        if self.scope is None:
            raise AuthError(self.component, "authentication required (HELLO, then AUTH with a token)")
        return self.scope
