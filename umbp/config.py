"""Configuration: one frozen dataclass per component, resolved once, validated on construction.

Precedence, highest first: explicit arguments (CLI flags, constructor arguments) > environment variables
(``UMBP_<FIELD>`` upper-cased, e.g. ``UMBP_METASERVER``, ``UMBP_LEASE_TTL``) > the TOML file named by
``UMBP_CONFIG`` (sections ``[metaserver]``, ``[node]``, ``[client]``) > the defaults below. This is the only module
that reads the environment; everything else receives a config object.

A leaf module: the transports and the metaserver import it, so it imports nothing but ``umbp.errors`` and
``umbp.sizes`` (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from umbp.errors import ConfigError
from umbp.sizes import parse_size


MAX_SHARDS = 256  # ranks of one TP-sharded page (``shard=(rank, nranks)``): parts of one shared entry


def check_shard(shard: Any, component: str = "client") -> tuple[int, int] | None:
    """``shard`` as (rank, nranks) with 0 <= rank < nranks <= MAX_SHARDS, None when None; ConfigError otherwise."""
    if shard is None or shard == "":
        return None
    if type(shard) is str:  # UMBP_SHARD=3,8 or a config file's "3,8"
        shard = shard.split(",")
    try:
        rank, n = (int(x) for x in shard)
    except (TypeError, ValueError) as e:
        raise ConfigError(component, f"shard must be (rank, nranks), got {shard!r}") from e
    if not 0 <= rank < n <= MAX_SHARDS:
        raise ConfigError(component, f"shard must be (rank, nranks) with 0 <= rank < nranks <= {MAX_SHARDS}, "
                                     f"got {shard!r}")
    return rank, n


def split_host_port(addr: str, component: str = "config", default_port: int | None = None) -> tuple[str, int]:
    """'host:port' / '[v6]:port' / 'http://host:port' -> (host, port)."""
    text = addr.strip()
    for scheme in ("http://", "https://", "tcp://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep:
            host, port_s = text, ""
    if not port_s:
        if default_port is None:
            raise ConfigError(component, f"address {addr!r} has no port (expected HOST:PORT)")
        port_s = str(default_port)
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(component, f"address {addr!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535 or not host:
        raise ConfigError(component, f"address {addr!r} is not HOST:PORT")
    return host, port


def _addr_list(value: str | list[str] | tuple[str, ...], component: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(a.strip() for a in items if a and a.strip())
    for a in out:
        split_host_port(a, component)
    return out


def _check_limits(cfg, c: str) -> None:
    if cfg.max_connections < 1 or cfg.idle_timeout_s <= 0:
        raise ConfigError(c, "max_connections must be >= 1 and idle_timeout_s positive")
    if cfg.preauth_connections < 1 or cfg.preauth_per_source < 1 or cfg.auth_timeout_s <= 0:
        raise ConfigError(c, "preauth_connections and preauth_per_source must be >= 1 and auth_timeout_s positive")
    _check_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, c, server=True)
    if cfg.token is not None and len(cfg.token) < 16:
        raise ConfigError(c, "token must be at least 16 characters")


def _check_tls(cert: str, key: str, ca: str, c: str, server: bool) -> None:
    """Files exist (read by ``ssl`` later; a missing one is named here). A server needs cert and key together."""
    if server and bool(cert) != bool(key):
        raise ConfigError(c, "tls_cert and tls_key go together (--tls-cert and --tls-key)")
    for what, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if path and not os.path.isfile(path):
            raise ConfigError(c, f"{what}: no such file {path!r}")


# Operations per etcd transaction the metaserver writes: etcd's default cap is 128 (--max-txn-ops), and much of a
# transaction's cost is per transaction in etcd and in the metaserver, so the etcd that `umbp up`, the tests and the
# Kubernetes base start runs with --max-txn-ops=1024 and the metaserver writes that many; against an etcd with a
# lower cap its writer falls back to 128 at the first refusal (metaserver/store/batcher.py).
ETCD_TXN_OPS = 1024


@dataclass(frozen=True)
class MetaserverConfig:
    etcd: str = "127.0.0.1:2379"
    listen: str = "127.0.0.1:7700"
    advertise: str = ""  # address clients should use for this metaserver; defaults to listen
    etcd_prefix: str = "/umbp"
    read_lease_s: float = 10.0  # how long a lookup pins its objects unless released
    pending_ttl_s: float = 30.0  # an allocation not committed by then is freed
    write_cap_ttl_s: float = 10.0  # closed pools: a write capability is refused by the node after this long
    high_watermark: float = 0.95  # background eviction starts above this fill ratio ...
    low_watermark: float = 0.85  # ... and stops below this one
    eviction_policy: str = "lru"  # "lru" or "prefix-lru"
    persist_batch: int = ETCD_TXN_OPS  # operations per etcd transaction at most (lowered to what etcd accepts)
    election_ttl_s: int = 5  # leader key lease: a dead leader is replaced within about this long
    etcd_timeout_s: float = 10.0  # one etcd request at most (a frozen or cut-off etcd fails a call after this long)
    persist_retry_s: float = 10.0  # a failing etcd write is retried this long, then dropped: the leader steps down
    # "durable": a COMMIT is answered once its pages' segment is in etcd; "async": at once, before etcd (a crash
    # loses the last window's pages as misses, never as wrong bytes: metaserver/table/commits.py says why)
    commit: str = "durable"
    slots: int = 0  # slots of a new pool (>1: partitioned, metaserver/ha/partition.py); 0: what the pool has, else 1
    max_batch_keys: int = 100_000
    token: str | None = None  # the cluster secret (umbp/auth.py); None and no tokens_file: the pool runs open
    tokens_file: str = ""  # TOML of scoped tokens plus the cluster secret
    max_connections: int = 4096  # authenticated connections (open pool: all); more get an UNAVAILABLE answer
    idle_timeout_s: float = 600.0  # a connection that sends nothing for this long is closed
    preauth_connections: int = 16  # closed pool: connections not yet authenticated (a newcomer evicts one)
    preauth_per_source: int = 8  # ... of them from one IP address (umbp/admission.py)
    auth_timeout_s: float = 5.0  # closed pool: a connection not authenticated by then is closed (PING or not)
    tls_cert: str = ""  # PEM certificate chain: serve TLS on the TCP port (with tls_key)
    tls_key: str = ""
    tls_ca: str = ""  # PEM CA bundle: verify the metaserver's certificate (node registration link)
    metrics_listen: str = ""  # HOST:PORT for /metrics, /healthz, /readyz (umbp.metrics); empty: off
    gc_freeze_ms: float = 20.0  # metaserver/store/gcpolicy.py: a collection step this long freezes its survivors; -1: off
    kv_events: str = ""  # tcp://HOST:PORT: publish pages stored and dropped as vLLM KV events (replay on PORT+1)

    def __post_init__(self) -> None:
        c = "metaserver"
        split_host_port(self.etcd, c, 2379)
        split_host_port(self.listen, c)
        if self.metrics_listen:
            split_host_port(self.metrics_listen, c)
        if self.advertise:
            split_host_port(self.advertise, c)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(c, "watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
        if self.eviction_policy not in ("lru", "prefix-lru"):
            raise ConfigError(c, f"eviction_policy must be 'lru' or 'prefix-lru', got {self.eviction_policy!r}")
        if self.kv_events and not re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d{1,5})", self.kv_events):
            raise ConfigError(c, f"kv_events must be tcp://HOST:PORT (port 0: any), got {self.kv_events!r}")
        if not 1 <= self.persist_batch <= 4096:
            raise ConfigError(c, "persist_batch must be within 1..4096 (operations per etcd transaction)")
        if (self.read_lease_s <= 0 or self.pending_ttl_s <= 0 or self.write_cap_ttl_s <= 0
                or self.election_ttl_s < 1):
            raise ConfigError(c, "lease durations must be positive")
        if not (self.etcd_timeout_s > 0 and self.persist_retry_s >= 0):
            raise ConfigError(c, "etcd_timeout_s must be positive and persist_retry_s not negative")
        if self.commit not in ("durable", "async"):
            raise ConfigError(c, f"commit must be 'durable' or 'async', got {self.commit!r}")
        if not 0 <= self.slots <= 1024:
            raise ConfigError(c, f"slots must be within 0..1024, got {self.slots}")
        if not (self.gc_freeze_ms >= 0 or self.gc_freeze_ms == -1):
            raise ConfigError(c, f"gc_freeze_ms must be >= 0, or -1 for CPython's own collector, got {self.gc_freeze_ms}")
        _check_limits(self, c)


@dataclass(frozen=True)
class NodeConfig:
    metaserver: tuple[str, ...] = ("127.0.0.1:7700",)
    capacity: int = 1 << 30
    listen: str = "127.0.0.1:0"
    advertise: str = ""  # routable address clients use; defaults to the bound listen address
    lease_ttl: float = 10.0
    node_id: str = ""  # stable name; a node restarted with the same id on the same host reopens its arena
    arena_dir: str = "/dev/shm"
    max_frame_data: int = 1 << 30
    token: str | None = None  # the cluster secret: registers with the metaserver, checks capabilities
    tokens_file: str = ""  # scoped tokens clients may present (the same file as the metaservers')
    max_connections: int = 4096
    idle_timeout_s: float = 600.0
    preauth_connections: int = 16
    preauth_per_source: int = 8
    auth_timeout_s: float = 5.0
    tls_cert: str = ""  # PEM: serve TLS on the data port (with tls_key); clients then need tls_ca
    tls_key: str = ""
    tls_ca: str = ""  # PEM CA bundle: the metaserver's certificate is checked against it (registration link)
    metrics_listen: str = ""  # HOST:PORT for /metrics, /healthz, /readyz (umbp.metrics); empty: off
    disk: str = ""  # the disk tier's file (local NVMe; umbp/node/disk.py); empty: DRAM only
    disk_capacity: int = 0  # its data bytes (a size string); required with disk
    disk_threads: int = 4  # workers doing its preadv/pwritev (bench/disk.py measures 1, 4, 8)

    def __post_init__(self) -> None:
        c = "node"
        object.__setattr__(self, "disk_capacity", parse_size(self.disk_capacity, "disk_capacity"))
        if self.disk and (self.disk_capacity < 1 << 20 or self.disk_capacity % 4096):
            raise ConfigError(c, f"disk_capacity {self.disk_capacity} must be at least 1 MiB and a multiple of 4 KiB "
                                 f"(--disk-capacity with --disk)")
        if not 1 <= self.disk_threads <= 64:
            raise ConfigError(c, f"disk_threads must be within 1..64, got {self.disk_threads}")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, c)
        object.__setattr__(self, "metaserver", _addr_list(self.metaserver, c))
        object.__setattr__(self, "capacity", parse_size(self.capacity, "capacity"))
        if not self.metaserver:
            raise ConfigError(c, "no metaserver address given (--metaserver or UMBP_METASERVER)")
        if self.capacity < 1 << 20:
            raise ConfigError(c, f"capacity {self.capacity} is below the 1 MiB minimum")
        split_host_port(self.listen, c)
        if self.lease_ttl < 1:
            raise ConfigError(c, "lease_ttl must be at least 1 second")
        if self.node_id and not all(ch.isalnum() or ch in "-_." for ch in self.node_id):
            raise ConfigError(c, f"node_id {self.node_id!r} may only hold letters, digits, '-', '_' and '.'")
        _check_limits(self, c)


@dataclass(frozen=True)
class ClientConfig:
    """A client's settings (``umbp.Client(config=...)``, ``UMBP_<FIELD>``, ``[client]``).

    TLS (with ``tls_ca``): ``tls_streams`` (1..16, default 2) is how many connections a node's big read batch (4 MiB
    or more) is split over, received in parallel threads (``ssl`` drops the GIL while it decrypts; the node encrypts
    each connection's answers on a worker thread: transport/tlsserve.py); 1 keeps one connection a node, as plain TCP
    always does; 4 ran slower than 2 on the 16-core host (the client's threads wait for the GIL between records:
    docs/benchmarks/getpath.md). ``ktls`` asks OpenSSL for kernel TLS on the client's data connections to nodes (TLS
    1.2, AES-GCM; needs the kernel's tls module and OpenSSL 3.0+, else those connections run user-space TLS as without
    it: ``umbp.tls.ktls_status``). docs/operations/security.md."""

    metaserver: tuple[str, ...] = ("127.0.0.1:7700",)
    namespace: str = "default"
    token: str | None = None
    transport: str = "auto"  # auto | tcp | shm | rdma
    timeout_s: float = 30.0  # one deadline per call, shared by its retries
    checksum: bool = False  # crc32 every payload on put and verify on get
    staging_bytes: int = 64 << 20  # registered staging area for unregistered buffers (RDMA)
    tls_ca: str = ""  # PEM CA bundle: speak TLS to the metaserver and to nodes over TCP, verifying them against it
    read_ahead: bool = True  # read remembered page locations while the get's LOOKUP is in flight (umbp/speculate.py)
    shard: tuple | None = None  # (rank, nranks): one rank's part of TP-sharded pages (umbp/shard.py)
    tls_streams: int = 2  # TLS: connections a node's big read batch is split over (1..16)
    ktls: bool = False  # TLS: kernel TLS on the data connections to nodes, where the kernel and OpenSSL have it

    def __post_init__(self) -> None:
        c = "client"
        object.__setattr__(self, "metaserver", _addr_list(self.metaserver, c))
        if not self.metaserver:
            raise ConfigError(c, "no metaserver address given")
        if self.transport not in ("auto", "tcp", "shm", "rdma"):
            raise ConfigError(c, f"transport must be auto, tcp, shm or rdma, got {self.transport!r}")
        if not self.namespace or len(self.namespace.encode()) > 128:
            raise ConfigError(c, "namespace must be 1..128 bytes")
        if self.timeout_s <= 0:
            raise ConfigError(c, "timeout_s must be positive")
        _check_tls("", "", self.tls_ca, c, server=False)
        if type(self.tls_streams) is not int or not 1 <= self.tls_streams <= 16:
            raise ConfigError(c, f"tls_streams must be an integer within 1..16, got {self.tls_streams!r}")
        if type(self.ktls) is not bool:
            raise ConfigError(c, f"ktls must be true or false, got {self.ktls!r}")
        object.__setattr__(self, "shard", check_shard(self.shard, c))


_SECTIONS = {MetaserverConfig: "metaserver", NodeConfig: "node", ClientConfig: "client"}


def _coerce(f: dataclasses.Field, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    t = str(f.type)
    if t == "bool":
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if t == "int" and f.name not in ("capacity", "disk_capacity"):
        return int(raw)
    if t == "float":
        return float(raw)
    return raw


def resolve(cls: type, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
    """Build ``cls`` from flags > environment > UMBP_CONFIG file > defaults. ``None`` flags count as unset."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = env.get("UMBP_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                values.update(tomllib.load(fh).get(_SECTIONS[cls], {}))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError("config", f"cannot read UMBP_CONFIG={path}: {e}") from e
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(names)
    if unknown:
        raise ConfigError("config", f"unknown keys in [{_SECTIONS[cls]}] of {path}: {sorted(unknown)}")
    for name, f in names.items():
        raw = env.get("UMBP_" + name.upper())
        if raw is not None and raw != "":
            try:
                values[name] = _coerce(f, raw)
            except ValueError as e:
                raise ConfigError("config", f"UMBP_{name.upper()}={raw!r}: {e}") from e
    for name, v in (flags or {}).items():
        if name not in names:
            raise ConfigError("config", f"unknown setting {name!r} for {cls.__name__}")
        if v is not None:
            values[name] = v
    return cls(**values)
