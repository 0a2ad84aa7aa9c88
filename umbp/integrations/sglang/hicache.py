"""SGLang HiCache L3 storage backend on the pool: ``UmbpHiCacheStorage``, loaded by SGLang's own factory.

Start SGLang with ``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "umbp", "module_path": "umbp.integrations.sglang.hicache",
"class_name": "UmbpHiCacheStorage", "metaserver": "HOST:PORT", "interface_v1": 1}'``. SGLang's
``StorageBackendFactory.create_backend("dynamic", ...)`` imports this module, checks the class subclasses
``HiCacheStorage`` and builds it as ``cls(storage_config, kwargs)``; the cache controller then registers its host KV
pool (``register_mem_pool_host``) and, for hybrid models, its side pools (``register_mem_host_pool_v2``).

What moves: pages between SGLang's per-rank host KV pool (the L2 tier, pinned DRAM) and the pool. With
``interface_v1`` SGLang calls ``batch_get_v1`` / ``batch_set_v1`` with host indices and the bytes move straight
between the host pool's buffers and the node arenas (shm memcpy, RDMA into the registered host pool, or TCP
``recv_into``), no staging copy; without it SGLang's generic path hands over one flat tensor per page
(``batch_get`` / ``batch_set``), which costs SGLang a copy on its side. Both name and lay out the objects
identically (``naming``), so pages written by one are read by the other.

Contracts:
- Return values are SGLang's: per-page bools for v1/v2 (True = the page is stored / landed; a page that already
  existed counts as stored, that is the dedup), the leading-run length for ``batch_exists``. Pool errors
  (``PoolFull``, ``TransportError``, ``CorruptionError``) never escape into SGLang's storage threads: they are logged
  and the pages of that call report False, so SGLang recomputes them. A stale or torn read is never reported as a hit.
- MLA/DSA pages are named without the TP rank: every rank's put names the same objects and the pool keeps one copy.
- ``"tp_shared_entries": true`` (extra_config; default false: per-rank names): TP-sharded (MHA) KV is named without
  the rank (``{hash}_k``, ``{hash}_v``) and each rank's client has ``shard=(tp_rank, tp_size)``, so the pool keeps ONE
  directory entry, one etcd record and one LOOKUP key per object for all TP ranks (``metaserver/shared.py``): a
  rank's set reports True once its part is written; the page exists (``batch_exists``, gets) once every rank's is.
  Replicated KV (MLA) and heterogeneous TP (split heads) keep their names; every rank of a TP group must set it alike.
- Thread safety: SGLang calls from its prefetch and backup threads at once; the client serialises its calls.

Costs: one metaserver round trip per batch call (ALLOC+COMMIT for puts, LOOKUP for gets, PREFIX for
``batch_exists``) plus the data movement; Python work O(pages x objects per page x parts per object).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import umbp
from umbp.buffers import HostSpans
from umbp.errors import ConfigError, InvalidArgument, UmbpError
from umbp.integrations.sglang import hostmem
from umbp.integrations.sglang.naming import ObjectNaming, dtype_name, namespace_for, parents_for

logger = logging.getLogger(__name__)
COMPONENT = "sglang hicache"

# Keys of --hicache-storage-backend-extra-config this backend reads (SGLang's own are passed through too).
CONFIG_KEYS = {"metaserver", "namespace", "transport", "token", "timeout_s", "tp_shared_entries"}
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys"}
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
CLEAR_ROUNDS = 1000  # clear() removes at most CLEAR_ROUNDS * CLEAR_BATCH objects per call
CLEAR_BATCH = 10_000


def _flag(v: Any) -> bool:
    """An extra_config boolean: true, 1, "true", "1", "yes", "on" (SGLang passes JSON, users pass strings)."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass
class StorageMetrics:
    """The fields of SGLang's ``StorageMetrics`` (pages per call, GB/s per call), drained by ``get_stats``."""

    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


class UmbpHiCacheStorage(HiCacheStorage):
    """HiCache L3 backend over ``umbp.Client``. ``client_factory`` (tests) replaces ``umbp.Client``."""

    def __init__(self, storage_config: HiCacheStorageConfig, factory_kwargs: Optional[dict] = None, *,
                 client_factory: Optional[Callable[..., Any]] = None):
        if storage_config is None:
            raise ConfigError(COMPONENT, "a HiCacheStorageConfig is required")
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        unknown = set(extra) - CONFIG_KEYS - SGLANG_KEYS
        if unknown:
            logger.warning("%s: ignoring unknown extra_config keys %s", COMPONENT, sorted(unknown))
        self._client_args = {k: extra.get(k) for k in ("metaserver", "token", "transport")}
        if extra.get("timeout_s") is not None:
            self._client_args["timeout"] = float(extra["timeout_s"])
        self._namespace_override = extra.get("namespace")
        self._client_factory = client_factory or umbp.Client
        sc = storage_config
        self.rank_replicated = bool(sc.is_mla_model)
        split: tuple[int, ...] = ()
        if sc.should_split_heads and not self.rank_replicated:
            if not sc.tp_lcm_size or sc.tp_lcm_size % sc.tp_size:
                raise ConfigError(COMPONENT, f"should_split_heads needs tp_lcm_size a multiple of tp_size, got "
                                             f"{sc.tp_lcm_size} and {sc.tp_size}")
            self.split_factor = sc.tp_lcm_size // sc.tp_size
            split = tuple(sc.tp_rank * self.split_factor + i for i in range(self.split_factor))
        else:
            self.split_factor = 1
        self.naming = ObjectNaming(rank_replicated=self.rank_replicated, tp_rank=sc.tp_rank, pp_rank=sc.pp_rank,
                                   pp_size=sc.pp_size, attn_cp_rank=sc.attn_cp_rank, attn_cp_size=sc.attn_cp_size,
                                   split_ranks=split)
        if sc.dcp_size > 1:
            # A DCP rank holds its token shard of every logical page: the shard is part of the object's identity.
            self.naming = dataclasses.replace(self.naming, attn_cp_rank=sc.dcp_rank, attn_cp_size=sc.dcp_size)
        # tp_shared_entries: TP-sharded KV as ONE shared entry per logical object, each rank its part through a
        # client with shard=(tp_rank, tp_size) (metaserver/shared.py). Not for replicated KV (MLA: already one
        # object, deduplicated) nor split heads (a rank holds several smaller-TP ranks' parts: per-rank names).
        self.tp_shared = (_flag(extra.get("tp_shared_entries")) and not self.rank_replicated and not split
                          and sc.tp_size > 1)
        if self.tp_shared:
            self.naming = dataclasses.replace(self.naming, shared=True)
            self._client_args["shard"] = (sc.tp_rank, sc.tp_size)
        self.ns_tp = None if self.rank_replicated else (sc.tp_lcm_size if split else sc.tp_size)
        self.mem_pool_host = None
        self.registered_pools: dict = {}
        self._extents: dict[int, hostmem.Extents] = {}
        self._registered_allocs: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._client = None
        self._namespace: Optional[str] = None
        self.metrics = StorageMetrics()
        self.enable_metrics = bool(sc.enable_storage_metrics)
        self.counters = {"pages_set": 0, "pages_got": 0, "pages_missed": 0, "errors": 0, "registered_buffers": 0}

    # ---- the client and its namespace -----------------------------------------------------------------------

    def _geometry(self) -> tuple[str, int, str]:
        pool = self.mem_pool_host
        if pool is None:
            return "unregistered", 0, "raw"
        return str(pool.layout), int(pool.page_size), dtype_name(pool.dtype)

    @property
    def namespace(self) -> str:
        if self._namespace_override:
            return str(self._namespace_override)
        layout, page_size, dtype = self._geometry()
        return namespace_for(self.storage_config.model_name, layout, page_size, dtype, self.ns_tp)

    @property
    def client(self):
        """The pool client, created on first use under the namespace of the registered host pool."""
        with self._lock:
            ns = self.namespace
            if self._client is not None and self._namespace != ns:
                self._client.close()
                self._client = None
            if self._client is None:
                self._client = self._client_factory(namespace=ns, **self._client_args)
                self._namespace = ns
                for ptr, size in sorted(self._registered_allocs):
                    self._client.register_buffer(hostmem.view_at(ptr, size))
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # ---- host pool registration -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Record SGLang's host KV pool (the anchor of v1 and of the KV pool in v2) and register its memory with
        the client, so RDMA reads and writes it in place (harmless on shm and TCP)."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in LAYOUTS:
            raise ConfigError(COMPONENT, f"host pool layout {layout!r} is not supported (use one of {LAYOUTS})")
        super().register_mem_pool_host(mem_pool_host)
        self.registered_pools[PoolName.KV] = mem_pool_host
        self._register_memory(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if host_pool_name == PoolName.KV and self.mem_pool_host is None:
            self.register_mem_pool_host(host_pool)
            return
        self.registered_pools[host_pool_name] = host_pool
        self._register_memory(host_pool)

    def _register_memory(self, host_pool) -> None:
        if getattr(host_pool, "kv_buffer", None) is None and not hostmem.pool_buffers(host_pool):
            return  # a logical anchor: indices only, the side pools hold the bytes
        extents = hostmem.Extents(hostmem.pool_buffers(host_pool))
        self._extents[id(host_pool)] = extents
        new = [a for a in extents.allocations() if a not in self._registered_allocs]
        self._registered_allocs.update(new)
        if self._client is not None:
            for ptr, size in new:
                self._client.register_buffer(hostmem.view_at(ptr, size))
        self.counters["registered_buffers"] += len(new)

    def _anchor_is_logical(self) -> bool:
        return self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", None) is None

    def _page_tokens(self, pool) -> int:
        if self.storage_config.dcp_size > 1 and self.storage_config.logical_page_size:
            return int(self.storage_config.logical_page_size)
        return int(getattr(pool, "page_size", 1) or 1)

    # ---- moving objects -------------------------------------------------------------------------------------

    def _put_objects(self, names: list[str], parts: list[list[memoryview]] | HostSpans, parents: list
                     ) -> list[bool]:
        """Store each object (True: stored now or already there). A pool error fails the whole call. ``parts``: each
        object's views, or ``HostSpans`` (one run an object)."""
        if not names:
            return []
        try:
            if type(parts) is HostSpans:
                self.client.batch_put(names, parts, parents)
            elif all(len(p) == 1 for p in parts):
                self.client.batch_put(names, [p[0] for p in parts], parents)
            else:
                self.client.batch_put_ranges(names, parts, parents)
            return [True] * len(names)
        except (UmbpError, OSError) as e:
            self.counters["errors"] += 1
            logger.warning("%s: put of %d objects failed: %s", COMPONENT, len(names), e)
            return [False] * len(names)

    def _get_objects(self, names: list[str], parts: list[list[memoryview]] | HostSpans) -> list[bool]:
        """Fill each object's parts from the pool (True: every byte landed, sizes match exactly). ``parts``: each
        object's views, or ``HostSpans`` (one run an object: read with no object a page)."""
        if not names:
            return []
        spans = type(parts) is HostSpans
        want = parts.nbytes.tolist() if spans else [sum(len(v) for v in p) for p in parts]
        try:
            if spans:
                got = self.client.batch_get_into(names, parts)
            elif all(len(p) == 1 for p in parts):
                got = self.client.batch_get_into(names, [p[0] for p in parts])
            else:
                ranges = []
                for p in parts:
                    off, rs = 0, []
                    for v in p:
                        rs.append((off, len(v)))
                        off += len(v)
                    ranges.append(rs)
                got = self.client.batch_get_ranges_into(names, ranges, parts)
        except (UmbpError, OSError) as e:
            self.counters["errors"] += 1
            logger.warning("%s: get of %d objects failed: %s", COMPONENT, len(names), e)
            return [False] * len(names)
        return [g == w for g, w in zip(got, want)]

    @staticmethod
    def _per_page(results: list[bool], per_page: int) -> list[bool]:
        return [all(results[i:i + per_page]) for i in range(0, len(results), per_page)]

    def _prefix_objects(self, extra_info: Optional[HiCacheStorageExtraInfo], suffixes: Sequence[str]
                        ) -> Optional[list[str]]:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if not prefix:
            return None
        return [f"{prefix[-1]}{s}" for s in suffixes]

    def _record(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if not self.enable_metrics or pages == 0:
            return
        elapsed = max(time.perf_counter() - started, 1e-9)
        getattr(self.metrics, f"{kind}_pgs").append(pages)
        getattr(self.metrics, f"{kind}_bandwidth").append(nbytes / elapsed / 1e9)

    # ---- v1: zero copy over host indices --------------------------------------------------------------------

    def _kv_parts(self, pool, keys: List[str], host_indices) -> tuple[list[str], list[list[Any]]]:
        n = len(keys)
        tokens = self._page_tokens(pool)
        if len(host_indices) != n * tokens:
            raise InvalidArgument(COMPONENT, f"{n} keys need {n * tokens} host indices, got {len(host_indices)}")
        if self.split_factor > 1:
            ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, self.split_factor)
        else:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        suffixes = self.naming.kv_suffixes()
        # one run an object (page_first layouts): raw spans, no view an object; else views and Rows
        return self.naming.kv_objects(keys), hostmem.objects(ptrs, sizes, n, len(suffixes),
                                                             self._extents.get(id(pool)))

    def batch_set_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        if not keys:
            return []
        if self._anchor_is_logical():
            return [True] * len(keys)
        started = time.perf_counter()
        names, parts = self._kv_parts(self.mem_pool_host, keys, host_indices)
        per = len(self.naming.kv_suffixes())
        parents = parents_for(per, names, self._prefix_objects(extra_info, self.naming.kv_suffixes()))
        ok = self._per_page(self._put_objects(names, parts, parents), per)
        self.counters["pages_set"] += sum(ok)
        self._record("backup", sum(ok), _nbytes(parts), started)
        return ok

    def batch_get_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        if not keys:
            return []
        if self._anchor_is_logical():
            return [True] * len(keys)
        started = time.perf_counter()
        names, parts = self._kv_parts(self.mem_pool_host, keys, host_indices)
        ok = self._per_page(self._get_objects(names, parts), len(self.naming.kv_suffixes()))
        self.counters["pages_got"] += sum(ok)
        self.counters["pages_missed"] += len(ok) - sum(ok)
        self._record("prefetch", sum(ok), _nbytes(parts), started)
        return ok

    # ---- existence ------------------------------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of ``keys`` have every object present (one PREFIX round trip)."""
        if not keys:
            return 0
        per = len(self.naming.kv_suffixes())
        try:
            return self.client.prefix_hits(self.naming.kv_objects(keys)) // per
        except (UmbpError, OSError) as e:
            self.counters["errors"] += 1
            logger.warning("%s: exists query failed: %s", COMPONENT, e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the generic (non-zero-copy) interface: one flat tensor per page ------------------------------------

    def _flat_objects(self, key: str, flat: memoryview) -> tuple[list[str], list[memoryview]]:
        order = self.naming.flat_piece_order()
        pieces = hostmem.split_equal(flat, len(order), f"page {key[:16]}")
        return self.naming.kv_objects([key]), [pieces[i] for i in order]

    def _target_view(self, target_location: Any, target_sizes: Any, what: str) -> memoryview:
        if isinstance(target_location, int):
            if not isinstance(target_sizes, int):
                raise InvalidArgument(COMPONENT, f"{what}: a pointer target needs an int size")
            return hostmem.view_at(target_location, target_sizes)
        return hostmem.flat_byte_view(target_location, what, writable=True)

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Fill ``target_location`` (a flat page tensor, a buffer, or a pointer with ``target_sizes`` bytes) with
        page ``key``; returns it, or None on a miss. Without a target, returns the page as a new uint8 tensor."""
        if target_location is None:
            import torch

            names = self.naming.kv_objects([key])
            try:
                blobs = [self.client.get(n) for n in names]
            except (UmbpError, OSError) as e:
                self.counters["errors"] += 1
                logger.warning("%s: get %s failed: %s", COMPONENT, key[:16], e)
                return None
            if any(b is None for b in blobs):
                return None
            pieces = [b"" for _ in blobs]
            for obj_index, piece_index in enumerate(self.naming.flat_piece_order()):
                pieces[piece_index] = blobs[obj_index]
            return torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
                  ) -> List[Any]:
        """SGLang's generic prefetch: each target is a flat page (``get_dummy_flat_data_page``). Returns per key
        the filled target, or None where the page is missing."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidArgument(COMPONENT, "batch_get needs one target per key")
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        names, views = [], []
        for i, key in enumerate(keys):
            flat = self._target_view(target_locations[i], sizes[i], f"target_locations[{i}]")
            n, v = self._flat_objects(key, flat)
            names += n
            views += [[x] for x in v]
        per = len(self.naming.kv_suffixes())
        ok = self._per_page(self._get_objects(names, views), per)
        self.counters["pages_got"] += sum(ok)
        self.counters["pages_missed"] += len(ok) - sum(ok)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None,
                              [target_location] if target_location is not None else None,
                              [target_sizes] if target_sizes is not None else None)

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """SGLang's generic backup: ``values[i]`` is page i flat (``get_data_page``), or ``target_locations[i]``
        a pointer with ``target_sizes[i]`` bytes. True when every page is stored (or already was)."""
        if not keys:
            return False
        names, views = [], []
        for i, key in enumerate(keys):
            if values is not None:
                flat = hostmem.flat_byte_view(values[i], f"values[{i}]")
            elif target_locations is not None and target_sizes is not None:
                flat = self._target_view(target_locations[i], target_sizes[i], f"target_locations[{i}]")
            else:
                raise InvalidArgument(COMPONENT, "batch_set needs values or target locations with sizes")
            n, v = self._flat_objects(key, flat)
            names += n
            views += [[x] for x in v]
        per = len(self.naming.kv_suffixes())
        parents = parents_for(per, names, None)
        ok = self._per_page(self._put_objects(names, views, parents), per)
        self.counters["pages_set"] += sum(ok)
        return all(ok)

    # ---- v2: several pools per model --------------------------------------------------------------------------

    def _pool_suffixes(self, name, pool) -> tuple[str, ...]:
        if name == PoolName.KV:
            return self.naming.kv_suffixes()
        if name == PoolName.MAMBA:
            return self.naming.pool_suffixes(str(name), 1, sharded=True)
        components = getattr(pool, "components", None)
        if components is not None:
            return self.naming.pool_suffixes(str(name), len(components), bool(getattr(pool, "packed", True)))
        if getattr(pool, "v_buffer", None) is not None and not self.rank_replicated:
            return self.naming.pool_suffixes(str(name), 2, packed=False)
        return self.naming.pool_suffixes(str(name), 1)

    def _pool_objects(self, name, pool, keys: Sequence[str]) -> tuple[list[str], int]:
        suffixes = self._pool_suffixes(name, pool)
        return [f"{k}{s}" for k in keys for s in suffixes], len(suffixes)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The usable prefix over the KV pool and each side pool's hit policy. ``restorable_prefix_pages`` lists
        every prefix length (pages) at which all pools are restorable."""
        kv_pages = len(keys) if self._anchor_is_logical() else self.batch_exists(keys, extra_info)
        hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable or transfer.name == PoolName.KV:
                continue
            pool = self.registered_pools.get(transfer.name)
            if pool is None:
                raise ConfigError(COMPONENT, f"pool {transfer.name} was never registered")
            names, per = self._pool_objects(transfer.name, pool, keys[:kv_pages])
            try:
                present = self.client.batch_exists(names)
            except (UmbpError, OSError) as e:
                self.counters["errors"] += 1
                logger.warning("%s: exists query for pool %s failed: %s", COMPONENT, transfer.name, e)
                return PoolTransferResult(0, {}, [])
            page_ok = self._per_page(list(present), per)
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                ok_lengths = {n for n in range(1, kv_pages + 1) if all(page_ok[max(0, n - window):n])}
            elif transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                # Its own verdict, never a gate on the KV hit: leading complete groups of group_pages pages.
                g = max(1, transfer.group_pages or 1)
                lead = page_ok.index(False) if False in page_ok else len(page_ok)
                if lead // g:
                    hits[transfer.name] = lead // g * g
                continue
            else:
                lead = page_ok.index(False) if False in page_ok else len(page_ok)
                ok_lengths = set(range(1, lead + 1))
            boundary = max(ok_lengths, default=0)
            if boundary:
                hits[transfer.name] = boundary
            restorable &= ok_lengths
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _batch_io_v2(self, transfers: List[PoolTransfer], is_set: bool,
                     extra_info: Optional[HiCacheStorageExtraInfo]) -> dict:
        results: dict = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            name = transfer.name
            if name == PoolName.KV:
                fn = self.batch_set_v1 if is_set else self.batch_get_v1
                results[name] = fn(keys, transfer.host_indices, extra_info) if keys else []
                continue
            pool = self.registered_pools.get(name)
            if pool is None:
                raise ConfigError(COMPONENT, f"pool {name} was never registered")
            if not keys or transfer.host_indices is None:
                results[name] = [False] * len(keys)
                continue
            tokens = int(getattr(pool, "page_size", 1) or 1)
            if len(transfer.host_indices) != len(keys) * tokens:
                raise InvalidArgument(COMPONENT, f"pool {name}: {len(keys)} keys need {len(keys) * tokens} "
                                                 f"indices, got {len(transfer.host_indices)}")
            names, per = self._pool_objects(name, pool, keys)
            ptrs, sizes = pool.get_page_buffer_meta(transfer.host_indices)
            parts = hostmem.objects(ptrs, sizes, len(keys), per, self._extents.get(id(pool)))
            if is_set:
                prefix = self._prefix_objects(extra_info, self._pool_suffixes(name, pool))
                res = self._put_objects(names, parts, parents_for(per, names, prefix))
            else:
                res = self._get_objects(names, parts)
            results[name] = self._per_page(res, per)
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict:
        return self._batch_io_v2(transfers, False, extra_info)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict:
        return self._batch_io_v2(transfers, True, extra_info)

    # ---- housekeeping ---------------------------------------------------------------------------------------

    def clear(self) -> int:
        """Remove every object of this backend's namespace from the pool (all ranks share it). Returns how many
        were removed; bounded to CLEAR_ROUNDS listings of CLEAR_BATCH objects."""
        from transport.wire import Op

        removed = 0
        ns = self.namespace
        for _ in range(CLEAR_ROUNDS):
            listing = self.client.admin(Op.LIST, {"ns": ns, "limit": CLEAR_BATCH})
            objs = [o[1] for o in listing["objects"] if o[0] == ns]
            if not objs:
                break
            removed += sum(bool(r) for r in self.client.batch_remove(objs))
            if not listing.get("truncated"):
                break
        return removed

    def get_stats(self):
        """SGLang's ``StorageMetrics`` shape (pages and GB/s per call since the last call), then emptied."""
        m, self.metrics = self.metrics, StorageMetrics()
        return m


def _nbytes(parts: list[list[memoryview]] | HostSpans) -> int:
    """The bytes of a batch's objects (for the backend's bandwidth metrics)."""
    return int(parts.nbytes.sum()) if type(parts) is HostSpans else sum(len(v) for p in parts for v in p)
