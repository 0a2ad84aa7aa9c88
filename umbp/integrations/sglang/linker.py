"""SGLang direct KV-store linker on the pool: ``UmbpDirectLinker``, loaded by SGLang's own linker factory.

Start SGLang with ``--unified-cache-external-linker-backend dynamic`` and
``--unified-cache-external-linker-config '{"linker": "UmbpDirectLinker", "linker_module_path":
"umbp.integrations.sglang.linker", "linker_extra_config": {"metaserver": "HOST:PORT"}}'``.
``create_unified_cache_linker`` imports this module, checks the class subclasses ``UnifiedCacheLinker`` and is not
abstract, and builds it as ``cls(server_args, params, components=..., extra_config=..., forward_stream=...)``.

What moves: KV pages straight between SGLang's device KV pools (the GPU's HBM) and the pool, with no per-rank host
tier. A page is one pool object holding all its layers layer-major (layer l: K rows then V rows for MHA, the latent
rows for MLA: ``umbp.engine.layout``), so a layer group of a page is one ranged read. Loads run through the engine's
``LayerwiseLoader``: group by group on a background thread, zero-copy from a same-host node's mapped arena (the GPU
gather kernel reads the ``cudaHostRegister``-ed arena), else ranged reads into pinned staging and the gather; each
layer is reported to SGLang's ``LayerWiseLoadCounter`` only after its device copies have finished, so the forward
that waits on layer l (``wait_until(l)``) never reads a slot still being written. Offloads pack device slots into
pinned memory with the gather kernel and put them (``skip_existing``: pages already in the pool are not moved).

TP split of replicated (MLA) KV (``tp_split``, on by default for an MLA pool with TP > 1): every TP rank holds the
same KV bytes, so instead of each rank reading every page the batch loads through ``umbp.engine.tp.TPGroup``: each
rank reads 1/N of the pages (page i on rank i % N) into an exchange buffer, and per layer group the ranks
``all_gather`` it and scatter every page into their own slots. That exchange runs on the load thread over a process
group of its own with the TP group's ranks (NCCL for CUDA KV; for CPU KV the TP group's backend, gloo in SGLang),
created at construction, because SGLang's forward uses the TP group's communicators on the main thread meanwhile
and one communicator must not be driven from two threads.

Contracts (SGLang's ``UnifiedCacheLinker``):
- ``lookup`` returns every restorable prefix length: ``[1..n]`` where ``n`` is the leading run of pages present
  (one PREFIX round trip, no lease). SGLang intersects these across the attention TP (and CP) ranks
  (``UnifiedCacheLinkerWrapper._sync_restorable_prefix``: an ``all_reduce`` MIN of a 0/1 mask), so every rank
  loads the same hit prefix, and reduces the ``finish`` verdict with MIN (``finish_loads``). ``load`` only queues;
  ``start_layer_wise_loading`` starts everything queued as one batch and returns its counter index (-1 when nothing
  was queued); ``finish_layer_wise_loading`` waits for it and is True only when every page of every layer landed.
  A page evicted between lookup and load fails the batch (SGLang aborts those requests; nothing wrong is ever
  reported as loaded).
- With ``tp_split`` a load batch is collective: every rank of the TP group must start the same batches in the same
  order with the same keys (SGLang's reduced lookup gives that). The batch first checks it (one ``all_reduce`` of
  the page count and a hash of the key list); ranks that disagree (an eviction between two ranks' lookups, a load
  cancelled on one rank only) fail that batch on every rank with nothing written. Failures after that are
  collective too (``TPGroup``: a rank whose share fails makes every rank fail the same step). A rank that starts a
  batch its peers never start waits in the first collective until the exchange group's timeout (torch's default).
  Construction is collective over the whole world (every rank builds the linker: the exchange groups are created
  in the same order everywhere).
- ``offload`` queues; results come back in order through ``num_completed_offloads`` / ``pop_completed_offload``.
- MLA/DSA-style replicated KV is named without the TP rank (stored once); only TP rank 0 offloads it (the others
  report success at once, as SGLang's built-in linkers do), with or without ``tp_split``: rank 0 moves every
  offloaded page device -> host -> pool alone. MHA KV is per rank.
- ``reset`` quiesces both queues and forgets queued work; ``close`` also stops the threads and the client. An
  unexpected error in a worker thread fails that one task (counted in ``stats["worker_errors"]``, logged); the
  thread keeps serving, and ``reset`` waits with a bound (a dead worker or a stalled queue raises, never hangs).

Supported pools: SGLang's plain ``MHATokenToKVPool`` and ``MLATokenToKVPool`` (the FULL component). SWA tails are
skipped by SGLang's wrapper (tombstoned, recomputed); Mamba, DSA indexer and DeepSeek-V4 pools are refused at
construction with the reason.

Costs: per load batch one LOOKUP plus per layer group one ranged read per page (or none, mapped) and one gather
launch; per offload one EXISTS, one gather and one put. With ``tp_split`` (P pages, N ranks) each rank instead
reads ceil(P/N) pages per group from the pool (pool -> host and host -> device traffic 1/N of an unsplit load's:
``self.tp.counters``), then per group one tiny ``all_reduce`` (prefix and failure agreement), one ``all_gather`` of
N x ceil(P/N) pages' group bytes (over NVLink with NCCL) and an index copy per layer; per batch one more tiny
``all_reduce`` and a hash of the keys (the key-list check). The first layer group is ready only when the slowest
rank's share of it is, and the batch is as slow as the slowest rank; the exchange buffer holds ceil(P/N) pages on
the device (grown by doubling, kept). The world-wide ``all_gather_object`` and ``new_group`` calls are paid once,
at construction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

import umbp
from umbp.engine.layout import PagedKV
from umbp.engine.loader import LayerwiseLoader
from umbp.engine.offload import PipelinedStore
from umbp.engine.tp import TPGroup
from umbp.errors import ConfigError, DeadlineExceeded, InvalidArgument, NotFound, TransportError, UmbpError
from umbp.integrations.sglang.naming import ObjectNaming, dtype_name, namespace_for, parents_for

logger = logging.getLogger(__name__)
COMPONENT = "sglang linker"
CONFIG_KEYS = {"metaserver", "namespace", "transport", "token", "timeout_s", "layer_group_size", "use_mapped",
               "gather_method", "model", "tp_split"}


def _tp_group(params: Any) -> Any:
    """The (attention) TP group the KV is replicated over; None is the world."""
    return getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)


def _tp_rank_size(group: Any) -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


def _exchange_group(group: Any, cuda: bool) -> Any:
    """A new process group with the ranks of ``group`` (None: the world) for the TP split's exchange. Collective over
    the world: ``new_group`` must be called by every rank, in the same order, for every group created, and with DP
    attention or PP there are several TP groups. So each rank publishes its group's ranks (``all_gather_object``),
    and every rank creates one group per distinct rank tuple in sorted order, keeping the one holding itself.
    Backend: NCCL for CUDA KV (SGLang's TP cache group is a gloo CPU group; gloo cannot gather CUDA tensors), else
    the TP group's backend. Raises ``ConfigError`` on every rank when members of one group disagree on it."""
    dist = torch.distributed
    ranks = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else \
        tuple(range(dist.get_world_size()))
    backend = "nccl" if cuda else str(dist.get_backend(group))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ranks, backend))
    backends: dict[tuple, set] = {}
    for r, b in every:
        backends.setdefault(tuple(r), set()).add(b)
    mixed = [r for r, bs in backends.items() if len(bs) > 1]
    if mixed:
        raise ConfigError(COMPONENT, f"TP groups {mixed} mix KV devices (backends {[backends[r] for r in mixed]}); "
                                     f"tp_split needs the same on every rank")
    mine = None
    for r in sorted(backends):
        g = dist.new_group(list(r), backend=next(iter(backends[r])))
        if r == ranks:
            mine = g
    return mine


def _page_view(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A token-indexed buffer ``[tokens, ...]`` as ``[pages, page_size, ...]`` (a slot = a page)."""
    pages = t.shape[0] // page_size
    return t[:pages * page_size].view(pages, page_size, *t.shape[1:])


class UmbpDirectLinker(UnifiedCacheLinker):
    """SGLang ``UnifiedCacheLinker`` over ``umbp.Client`` and ``umbp.engine.LayerwiseLoader``."""

    def __init__(self, server_args: Any, params: Any, *, components: Any = None, extra_config: Optional[dict] = None,
                 forward_stream: Any = None, client_factory: Any = None):
        extra = dict(extra_config or {})
        unknown = set(extra) - CONFIG_KEYS
        if unknown:
            raise ConfigError(COMPONENT, f"unknown linker_extra_config keys {sorted(unknown)} "
                                         f"(known: {sorted(CONFIG_KEYS)})")
        names = {getattr(c, "name", str(c)) for c in (components or ())}
        if "MAMBA" in names:
            raise ConfigError(COMPONENT, "Mamba state pools are not supported by the umbp linker")
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.kvcache = kvcache
        if getattr(kvcache, "index_k_with_scale_buffer", None) is not None or hasattr(kvcache, "c4_kv_pool"):
            raise ConfigError(COMPONENT, f"{type(kvcache).__name__} (DSA / DeepSeek-V4 side pools) is not supported")
        if getattr(kvcache, "k_buffer", None) is not None and getattr(kvcache, "v_buffer", None) is not None:
            self.rank_replicated = False
            per_layer = [(_page_view(k, self.page_size), _page_view(v, self.page_size))
                         for k, v in zip(kvcache.k_buffer, kvcache.v_buffer)]
        elif isinstance(getattr(kvcache, "kv_buffer", None), (list, tuple)):
            self.rank_replicated = True
            per_layer = [(_page_view(t, self.page_size),) for t in kvcache.kv_buffer]
        else:
            raise ConfigError(COMPONENT, f"{type(kvcache).__name__} is neither an MHA (k_buffer/v_buffer) nor an "
                                         f"MLA (kv_buffer) token pool")
        self.kv = PagedKV(per_layer)
        self.num_layers = self.kv.num_layers
        self.pools = {PoolName.KV: kvcache}
        tp_group = _tp_group(params)
        self.tp_rank, self.tp_size = _tp_rank_size(tp_group)
        self.naming = ObjectNaming(rank_replicated=self.rank_replicated, tp_rank=self.tp_rank,
                                   pp_rank=int(getattr(params, "pp_rank", 0) or 0),
                                   pp_size=int(getattr(params, "pp_size", 1) or 1),
                                   attn_cp_rank=int(getattr(params, "attn_cp_rank", 0) or 0),
                                   attn_cp_size=int(getattr(params, "attn_cp_size", 1) or 1))
        self.suffix = self.naming.pool_suffixes("kv", 1)[0]
        self.offload_owner = not self.rank_replicated or self.tp_rank == 0
        model = extra.get("model") or getattr(server_args, "model_path", None) or "model"
        dtype = per_layer[0][0].dtype
        self.namespace = str(extra.get("namespace") or namespace_for(
            model, "paged", self.page_size, dtype_name(dtype), None if self.rank_replicated else self.tp_size,
            kind="linker"))
        client_args = {k: extra.get(k) for k in ("metaserver", "token", "transport")}
        if extra.get("timeout_s") is not None:
            client_args["timeout"] = float(extra["timeout_s"])
        self.client = (client_factory or umbp.Client)(namespace=self.namespace, **client_args)
        group = int(extra.get("layer_group_size", 1))
        use_mapped = bool(extra.get("use_mapped", True))
        method = str(extra.get("gather_method", "auto"))
        # Two loaders over one client: loads and offloads run on their own threads, each with its own staging.
        self.loader = LayerwiseLoader(self.client, self.kv, group, use_mapped=use_mapped, method=method)
        # offloads: the device-to-host copy of one chunk overlaps the put of the previous one (umbp.engine.offload)
        self.storer = PipelinedStore(self.client, self.kv, group, method=method)
        self.loader.prepare()  # pin the same-host arenas now, not in front of the first load's first layer
        # the TP split's exchange (None: each rank loads every page itself); its counters are this rank's share
        self.tp = self._split_exchange(extra.get("tp_split"), tp_group, group, use_mapped, method)
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self.pending_loads: dict[str, tuple[list[str], list[int]]] = {}
        self.load_queue: queue.Queue = queue.Queue()
        self.offload_queue: queue.Queue = queue.Queue()
        self.offload_results: queue.Queue = queue.Queue()
        self.stats = {"lookups": 0, "lookup_hit_pages": 0, "loads": 0, "split_loads": 0, "pages_loaded": 0,
                      "load_failures": 0, "offloads": 0, "pages_offloaded": 0, "offload_failures": 0,
                      "worker_errors": 0}
        self.last_worker_error: str | None = None
        self.last_load_error: str | None = None  # why the last failed load batch failed
        self.last_load: dict = {}
        self._closed = False
        self._load_thread = threading.Thread(target=self._load_loop, name=f"umbp-linker-load-tp{self.tp_rank}",
                                             daemon=True)
        self._offload_thread = threading.Thread(target=self._offload_loop,
                                                name=f"umbp-linker-offload-tp{self.tp_rank}", daemon=True)
        self._load_thread.start()
        self._offload_thread.start()
        logger.info("%s: namespace %s, %d layers, %s, tp %d/%d%s, page %d tokens (%d bytes)", COMPONENT,
                    self.namespace, self.num_layers, "MLA (replicated)" if self.rank_replicated else "MHA",
                    self.tp_rank, self.tp_size, " split" if self.tp_split else "", self.page_size,
                    self.kv.page_bytes)

    @property
    def tp_split(self) -> bool:
        """Whether load batches go through the TP split (``self.tp``)."""
        return self.tp is not None

    def _split_exchange(self, split: Any, tp_group: Any, group_size: int, use_mapped: bool,
                        method: str) -> TPGroup | None:
        """``tp_split`` resolved (default on for replicated KV with TP > 1; off for MHA and TP 1, whatever is set)
        and, when on, the ``TPGroup`` over a new exchange group (collective over the world: ``_exchange_group``)."""
        if split is not None and not isinstance(split, bool):
            raise ConfigError(COMPONENT, f"tp_split must be true or false, not {split!r}")
        if not (self.rank_replicated and self.tp_size > 1 and split is not False):
            return None
        return TPGroup(self.client, self.kv, replicated=True, group_size=group_size, use_mapped=use_mapped,
                       method=method, group=_exchange_group(tp_group, self.kv.is_cuda))

    # ---- keys and slots --------------------------------------------------------------------------------------

    def objects(self, page_keys: list[str]) -> list[str]:
        return [f"{k}{self.suffix}" for k in page_keys]

    def slots_of(self, device_indices: Any) -> list[int]:
        """Token indices of whole, aligned pages -> page slots (raises on a misaligned or partial page)."""
        idx = torch.as_tensor(device_indices).detach().to("cpu", torch.int64).flatten()
        ps = self.page_size
        if idx.numel() % ps:
            raise InvalidArgument(COMPONENT, f"{idx.numel()} device indices are not whole pages of {ps}")
        pages = idx.view(-1, ps)
        starts = pages[:, 0]
        if bool((starts % ps).any()) or not torch.equal(pages, starts[:, None] + torch.arange(ps)):
            raise InvalidArgument(COMPONENT, "device indices must be aligned, contiguous pages")
        return (starts // ps).tolist()

    @staticmethod
    def _kv_transfer(transfers: list[PoolTransfer]) -> Optional[PoolTransfer]:
        return next((t for t in transfers if t.name == PoolName.KV), None)

    # ---- lookup and load -------------------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv_transfer(transfers)
        if kv is None or not kv.keys or any(t.name != PoolName.KV and t.keys for t in transfers):
            return []  # only the KV pool is stored: a prefix needing another pool is not restorable here
        self.stats["lookups"] += 1
        try:
            hits = self.client.prefix_hits(self.objects(list(kv.keys)))
        except (UmbpError, OSError) as e:
            logger.warning("%s: lookup for %s failed: %s", COMPONENT, rid, e)
            return []
        self.stats["lookup_hit_pages"] += hits
        return list(range(1, hits + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = self._kv_transfer(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        if rid in self.pending_loads:
            raise InvalidArgument(COMPONENT, f"a load for {rid} is already queued")
        slots = self.slots_of(kv.device_indices)
        if len(slots) != len(kv.keys):
            raise InvalidArgument(COMPONENT, f"{len(kv.keys)} keys for {len(slots)} device pages")
        self.pending_loads[rid] = (self.objects(list(kv.keys)), slots)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        keys = [k for ks, _ in pending.values() for k in ks]
        slots = [s for _, ss in pending.values() for s in ss]
        index = self.layer_done_counter.update_producer()
        ready = None
        if self.kv.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # the scheduler's stream has prepared these slots
        self.stats["loads"] += 1
        self.load_queue.put((index, keys, slots, ready))
        return index

    def _bind_device(self) -> None:
        """Make this worker thread's current CUDA device the KV's: a new thread starts on device 0, and SGLang runs
        TP rank r on GPU r in one process per rank, so anything using the current device (streams, NCCL) would
        otherwise run on GPU 0."""
        if self.kv.is_cuda:
            torch.cuda.set_device(self.kv.device)

    def _load_loop(self) -> None:
        self._bind_device()
        while True:
            task = self.load_queue.get()
            try:
                if task is None:
                    return
                self._load_batch(*task)  # reports every failure through the counter, raises nothing
            except Exception as e:  # noqa: BLE001 - a bug in the bookkeeping must not kill the thread
                self._worker_failed("load", e)
            finally:
                self.load_queue.task_done()

    def _load_batch(self, index: int, keys: list[str], slots: list[int], ready: Any) -> None:
        counter = self.layer_done_counter
        started = time.perf_counter()
        first = None
        try:
            if ready is not None:
                ready.synchronize()
            # split: collective with the other TP ranks (TPGroup); raises on every rank if their keys differ
            if self.tp is not None:
                source = self.tp.load(keys, slots)
                self.stats["split_loads"] += 1  # a batch past the key-list check
            else:
                source = self.loader.load(keys, slots)
            with source as ld:
                for group in ld:
                    if group.event is not None:
                        group.event.synchronize()  # report a layer only once its device copies are done
                    if group.pages < len(keys):
                        raise NotFound(COMPONENT, f"only {group.pages} of {len(keys)} pages are in the pool "
                                                  f"(evicted since lookup?)")
                    for layer in group.layers:
                        counter.complete(index, layer)
                    if first is None:
                        first = time.perf_counter() - started
            self.stats["pages_loaded"] += len(keys)
            total = time.perf_counter() - started
            self.last_load = {"pages": len(keys), "bytes": len(keys) * self.kv.page_bytes,
                              "first_group_s": first, "total_s": total, "split": self.tp_split}
        except BaseException as e:  # noqa: BLE001 - reported through the counter, never raised into SGLang
            self.stats["load_failures"] += 1
            self.last_load_error = f"{type(e).__name__}: {e}"
            logger.warning("%s: layer-wise load of %d pages failed: %s", COMPONENT, len(keys), e)
            counter.fail(index, e if isinstance(e, Exception) else RuntimeError(str(e)))

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    # ---- offload ----------------------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        kv = self._kv_transfer(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        if not self.offload_owner:
            self.offload_results.put(True)  # rank 0 stores the replicated pages for every rank
            return True
        slots = self.slots_of(kv.device_indices)
        if len(slots) != len(kv.keys):
            raise InvalidArgument(COMPONENT, f"{len(kv.keys)} keys for {len(slots)} device pages")
        events = self.record_offload_ready() if self.kv.is_cuda else []
        self.offload_queue.put((list(kv.keys), slots, events))
        return True

    def _offload_loop(self) -> None:
        self._bind_device()
        while True:
            task = self.offload_queue.get()
            try:
                if task is None:
                    return
                page_keys, slots, events = task
                ok = False
                try:
                    for e in events:
                        e.synchronize()
                    names = self.objects(page_keys)
                    self.storer.store(names, slots, parents_for(1, names, None), skip_existing=True)
                    ok = True
                    self.stats["offloads"] += 1
                    self.stats["pages_offloaded"] += len(names)
                except (UmbpError, OSError) as e:
                    self.stats["offload_failures"] += 1
                    logger.warning("%s: offload of %d pages failed: %s", COMPONENT, len(page_keys), e)
                except Exception as e:  # noqa: BLE001 - any other error is one failed offload, not a dead thread
                    self.stats["offload_failures"] += 1
                    self._worker_failed("offload", e)
                self.offload_results.put(ok)
            finally:
                self.offload_queue.task_done()

    def _worker_failed(self, what: str, e: BaseException) -> None:
        """Record an unexpected error of a worker thread (kept alive: the next task is served)."""
        self.stats["worker_errors"] += 1
        self.last_worker_error = f"{what}: {type(e).__name__}: {e}"
        logger.error("%s: unexpected error in the %s thread (it keeps serving): %s", COMPONENT, what,
                     self.last_worker_error, exc_info=e)

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def _drain(self, q: queue.Queue, thread: threading.Thread, what: str) -> None:
        """Wait until every task queued on ``q`` is done. Bounded: raises ``TransportError`` at once if the worker
        thread is dead, and ``DeadlineExceeded`` if no task finishes within ``stall_s`` (one task is at most a few
        client calls, each bounded by the client's deadline)."""
        stall_s = 4 * float(self.client.config.timeout_s) + 10 if hasattr(self.client, "config") else 60.0
        with q.all_tasks_done:
            left = q.unfinished_tasks
            progress_at = time.monotonic()
            for _ in range(1 << 30):  # bounded by the stall deadline below
                if not q.unfinished_tasks:
                    return
                if not thread.is_alive():
                    raise TransportError(COMPONENT, f"the {what} thread is dead with {q.unfinished_tasks} tasks "
                                                    f"queued (last error: {self.last_worker_error})")
                if q.unfinished_tasks < left:
                    left, progress_at = q.unfinished_tasks, time.monotonic()
                if time.monotonic() - progress_at > stall_s:
                    raise DeadlineExceeded(COMPONENT, f"no {what} task finished in {stall_s:.0f}s "
                                                      f"({q.unfinished_tasks} queued)")
                q.all_tasks_done.wait(0.5)

    def reset(self) -> None:
        """Forget queued loads, wait for queued work to finish (bounded: see ``_drain``) and drop the results."""
        self.pending_loads.clear()
        self._drain(self.load_queue, self._load_thread, "load")
        self._drain(self.offload_queue, self._offload_thread, "offload")
        while True:
            try:
                self.offload_results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self.reset()
        self._closed = True
        self.load_queue.put(None)
        self.offload_queue.put(None)
        for t in (self._load_thread, self._offload_thread):
            t.join(10.0)  # each has drained its queue (reset): only the stop marker is left
            if t.is_alive():
                logger.error("%s: %s did not stop within 10 s", COMPONENT, t.name)
        self.loader.close()
        if self.tp is not None:
            self.tp.close()  # its loaders; the exchange group lives until torch.distributed is torn down
        self.storer.close()
        self.client.close()
        logger.info("%s: stats %s", COMPONENT, self.stats)
