"""Authentication and authorization: tokens, scopes, the challenge-response handshake and object tags (the capabilities
a metaserver grants for node reads and writes are umbp/caps.py's, re-exported here). Sans-I/O (HMAC arithmetic and
tables only); a leaf module that the metaserver, the nodes and the clients all import.

Tokens. A pool runs *open* (no token: everything allowed, said loudly at start-up) or *closed*:

- ``--token SECRET`` (or ``UMBP_TOKEN``): one secret, shared by every process of the pool, with every right;
- ``--tokens FILE``: a TOML table of scoped tokens plus the cluster secret::

      cluster_secret = "..."                 # metaservers and nodes: node registration, capabilities, object tags
      [[tokens]]
      name = "tenant-a"
      secret = "..."
      namespaces = { "tenant-a" = "rw", "shared/*" = "r" }   # fnmatch patterns -> r | rw
      [[tokens]]
      name = "tenant-q"
      secret = "..."
      namespaces = { "tenant-q/*" = "rw" }
      quota = "1GiB"                         # optional: every namespace it may write shares this (group token:tenant-q)
      [[tokens]]
      name = "ops"
      secret = "..."
      admin = true                           # EVICT, DRAIN, LIST of every namespace (and every namespace rw)

      [quotas]                               # optional: bytes a namespace, or all a pattern matches, may hold
      "tenant-a" = "512MiB"                  # a size string (umbp.sizes) or an int of bytes
      "batch/*" = "2GiB"                     # one quota for every namespace the pattern matches, together
      [reservations]                         # optional: a floor other groups' puts do not evict a group below
      "tenant-a" = "128MiB"                  # a [quotas] key, or an rw pattern of a token with a quota

  The cluster secret itself is a token with every right (nodes use it to register). The file is read strictly: it
  must be UTF-8; top-level keys are ``cluster_secret``, ``tokens``, ``quotas`` and ``reservations`` only, a token's
  are ``name``, ``secret``, ``namespaces``, ``admin`` and ``quota`` only; ``admin`` is a TOML boolean (``"false"`` is
  an error, not true); no two tokens share a secret or a name, and no token's secret is the cluster secret. Any
  violation is a ConfigError naming the entry, and the server refuses to start. ``Tokens.quotas`` maps the
  ``[quotas]`` keys to bytes; ``Tokens.quota_rules`` is every quota group with its reservation (umbp/quotarules.py
  says which namespace belongs to which group); both are empty for a file without quotas, ``--token`` alone or an
  open pool. The metaserver enforces them (metaserver/table/quotas.py).

Handshake (every control and data connection; the secret never crosses the wire)::

    client -> HELLO {"client": name, "nonce": 32 random bytes}
    server -> {"server", "version", "auth": bool, "nonce": 32 random bytes}
    client -> AUTH {"id": token_id(secret), "proof": HMAC(secret, "client" | server_nonce | client_nonce)}
    server -> {"scope": name, "proof": HMAC(secret, "server" | client_nonce | server_nonce)}

The server's proof lets the client tell a real server from an impostor that only collects proofs. A client that
holds a token accepts nothing less: a server that answers HELLO with ``auth: false`` (an open server, or an
impostor downgrading the connection) is refused with AuthError before the client sends a namespace or a key, so a
client with a token always ends its handshake with a verified server proof. Until AUTH succeeds a closed server
answers every other request (PING and HELLO aside) with AUTH "authentication required".

Tags. The object header's key hash becomes a keyed blake2b of ns | key under a key derived from the cluster secret
(the *tag*), handed out by the metaserver, so a header built from public fields does not pass a reader's check
(``Tokens.tag``).

Capabilities (the grants a metaserver hands out for node writes and reads, checked at the node) are umbp/caps.py's;
this module re-exports them, so callers import them from either.

Confidentiality on the wire needs TLS (``--tls-cert``/``--tls-key`` on servers, ``tls_ca`` on clients:
transport/framed.py). Costs: one HMAC-SHA256 per handshake step; per key a keyed blake2b tag (about 3x cheaper than
HMAC-SHA256).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import struct
import tomllib
from dataclasses import dataclass

import numpy as np

from umbp.caps import (CAP_CACHE, CAP_MAC, CAP_MIN, CLOCK_SKEW_S, WRITE_CAP_SIZE, CapCache,  # noqa: F401 - re-exported
                       check_read_capability, check_write_capability, fence_token, open_fence, read_capabilities_packed,
                       read_capability, read_capability_packed, with_caps, write_capabilities_packed, write_capability)
from umbp.errors import AuthError, ConfigError
from umbp.quotarules import QuotaRules, build_rules, parse_quotas, quota_size

NONCE_BYTES = 32


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
    """The secrets a server accepts. With no cluster secret (``Tokens(None, {})``) it accepts everything; ``closed``
    is False then."""

    def __init__(self, cluster_secret: bytes | None, scoped: dict[str, tuple[bytes, Scope]],
                 quotas: dict[str, int] | None = None, rules: QuotaRules | None = None):
        self.cluster_secret = cluster_secret
        self.quotas: dict[str, int] = dict(quotas or {})  # [quotas] key -> bytes (enforced elsewhere)
        self.quota_rules = rules if rules is not None else QuotaRules.of(self.quotas)  # every group, reservations
        self._tag_key = (hmac.digest(cluster_secret, b"umbp-tag-v2", "sha256") if cluster_secret is not None
                         else None)
        self._by_id = dict(scoped)
        if cluster_secret is not None:
            self._by_id[token_id(cluster_secret)] = (cluster_secret, FULL)

    @property
    def closed(self) -> bool:
        return self.cluster_secret is not None

    @classmethod
    def load(cls, token: str | None, tokens_file: str | None, component: str) -> "Tokens":
        """From ``--token`` and/or ``--tokens FILE`` (a token given both ways must be the file's cluster secret).
        ConfigError naming the entry for anything the module docstring's format does not allow."""
        scoped: dict[str, tuple[bytes, Scope]] = {}
        cluster = token.encode() if token else None
        quotas: dict[str, int] = {}
        rules = None
        if tokens_file:
            try:
                with open(tokens_file, "rb") as fh:
                    doc = tomllib.load(fh)
            except UnicodeDecodeError as e:
                raise ConfigError(component, f"cannot read tokens file {tokens_file}: not UTF-8 text "
                                             f"(byte {e.start})") from e
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(component, f"cannot read tokens file {tokens_file}: {e}") from e
            unknown = set(doc) - {"cluster_secret", "tokens", "quotas", "reservations"}
            if unknown:
                raise ConfigError(component, f"{tokens_file}: unknown top-level keys {sorted(unknown)} (expected "
                                             f"cluster_secret, [[tokens]], [quotas], [reservations])")
            cs = doc.get("cluster_secret")
            if not isinstance(cs, str) or len(cs) < 16:
                raise ConfigError(component, f"{tokens_file}: cluster_secret must be a string of 16+ characters")
            if cluster is not None and cluster != cs.encode():
                raise ConfigError(component, "--token differs from the tokens file's cluster_secret")
            cluster = cs.encode()
            entries = doc.get("tokens", [])
            if not isinstance(entries, list):
                raise ConfigError(component, f"{tokens_file}: tokens must be an array of tables ([[tokens]])")
            seen_secret: dict[bytes, str] = {cluster: "cluster_secret"}
            seen_name: dict[str, str] = {}
            token_quotas: list[tuple[str, int, tuple[str, ...]]] = []  # (name, bytes, rw patterns), file order
            for i, t in enumerate(entries):
                where = f"{tokens_file}: tokens[{i}]"
                if not isinstance(t, dict):
                    raise ConfigError(component, f"{where}: must be a table ([[tokens]])")
                if "name" in t:
                    if not isinstance(t["name"], str) or not t["name"]:
                        raise ConfigError(component, f"{where}: name must be a non-empty string")
                    where += f" (name {t['name']!r})"
                if not isinstance(t.get("secret"), str) or len(t["secret"]) < 16:
                    raise ConfigError(component, f"{where}: secret must be a string of 16+ characters")
                unknown = set(t) - {"name", "secret", "namespaces", "admin", "quota"}
                if unknown:
                    raise ConfigError(component, f"{where}: unknown fields {sorted(unknown)} (expected name, "
                                                 f"secret, namespaces, admin, quota)")
                nss = t.get("namespaces", {})
                if not isinstance(nss, dict) or not all(r in ("r", "rw") for r in nss.values()):
                    raise ConfigError(component, f"{where}: namespaces must map patterns to 'r' or 'rw'")
                admin = t.get("admin", False)
                if type(admin) is not bool:
                    raise ConfigError(component, f"{where}: admin must be a boolean (true or false, unquoted), got "
                                                 f"{admin!r}")
                secret = t["secret"].encode()
                if secret in seen_secret:
                    raise ConfigError(component, f"{where}: its secret is the same as {seen_secret[secret]}'s "
                                                 f"(every token needs its own secret)")
                seen_secret[secret] = f"tokens[{i}]"
                name = t.get("name", f"token{i}")
                if name in seen_name:
                    raise ConfigError(component, f"{where}: name {name!r} is already used by {seen_name[name]}")
                seen_name[name] = f"tokens[{i}]"
                scoped[token_id(secret)] = (secret, Scope(name, tuple(nss.items()), admin))
                if "quota" in t:
                    if admin:
                        raise ConfigError(component, f"{where}: an admin token may write every namespace and takes "
                                                     f"no quota")
                    rw = tuple(p for p, r in nss.items() if r == "rw")
                    if not rw:
                        raise ConfigError(component, f"{where}: quota covers no namespace (the token has no rw "
                                                     f"pattern)")
                    token_quotas.append((name, quota_size(t["quota"], f"{where}: quota", component), rw))
            quotas = parse_quotas(doc.get("quotas", {}), tokens_file, component)
            rules = build_rules(quotas, token_quotas, doc.get("reservations", {}), tokens_file, component)
        return cls(cluster, scoped, quotas, rules)

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
        """The object header's key hash: keyed blake2b in a closed pool; in an open one (no key) exactly
        ``objformat.key_hash``, the hash every client computes itself."""
        return self.tags(ns, [key])[0]

    def tags(self, ns: str, keys: list, rank: int | None = None) -> list[int]:
        """``tag`` of every key of one namespace (the keyed state is set up once per batch). ``rank``: the tags of
        rank ``rank``'s sub-slots of shared entries (metaserver/table/shared.py): ``rank_tags`` of the keys' shard bases
        (``shard_bases``), so no plain key's tag and no other rank's sub-slot tag equals them."""
        if rank is not None:
            return rank_tags(np.array(self.shard_bases(ns, keys), np.uint64), rank).tolist()
        h0 = hashlib.blake2b(digest_size=8, key=self._tag_key or b"")
        h0.update(ns.encode() + b"\0")
        return _digests(h0, keys)

    def shard_bases(self, ns: str, keys: list) -> list[int]:
        """The rank-independent part of shared entries' sub-slot tags: keyed blake2b over ns | key under its own
        personalisation (so never a plain key's tag). The metaserver's page table keeps it per row and derives each
        rank's tag from it with ``rank_tags``, one numpy step a batch instead of a blake2b a key and rank."""
        h0 = hashlib.blake2b(digest_size=8, key=self._tag_key or b"", person=b"umbp-shard")
        h0.update(ns.encode() + b"\0")
        return _digests(h0, keys)


def _digests(h0, keys: list) -> list[int]:
    """The 8-byte digest, as an int, of ``h0``'s state followed by each key."""
    copy = h0.copy
    digests = []
    for key in keys:
        h = copy()
        h.update(key)
        digests.append(h.digest())
    return list(struct.unpack(f"<{len(digests)}Q", b"".join(digests)))  # one call, not an int per digest


_GOLDEN = 0x9E3779B97F4A7C15
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))


def rank_tags(bases: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s sub-slot tags (uint64) of shard bases ``bases`` (uint64): splitmix64's finalizer of
    ``base + (rank + 1) * golden``. The finalizer is a bijection of 64-bit words and the offsets of two ranks
    differ (golden is odd), so two ranks of one key never get one tag; without the cluster's tag key the bases, and
    so the tags, are not computable from public fields. (A client handed its rank's tag could invert it to the base
    and derive its peers' tags of the same page; a tag is no grant: writing or reading a sub-slot takes the node's
    capability for it.)"""
    x = bases + np.uint64(((rank + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> _SHIFTS[0]
    x *= _MIX[0]
    x ^= x >> _SHIFTS[1]
    x *= _MIX[1]
    x ^= x >> _SHIFTS[2]
    return x


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
        """The AUTH request to send after this HELLO answer, or None when the server is open and this client holds
        no token. A client with a token refuses a server that does not ask for it (AuthError: a downgrade), so every
        caller holding a token ends with ``check`` of the server's proof."""
        if not isinstance(hello, dict) or hello.get("auth") is not True:
            if self.secret is not None:
                who = hello.get("server", "server") if isinstance(hello, dict) else "server"
                raise AuthError(self.component, f"{who} did not ask for authentication (HELLO answered with auth "
                                                f"false), but this client holds a token: refusing a server that "
                                                f"cannot prove it knows the secret (downgrade or impostor?)")
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
