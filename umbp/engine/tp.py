"""Tensor-parallel group loads and offloads: replicated KV stored once and loaded 1/N per rank, sharded KV per rank.

With MLA (and DSA's indexer KV) every TP rank holds the same KV bytes. Storing or loading them per rank would cost
N times the DRAM, N times the pool reads and N times the PCIe traffic. ``TPGroup`` with ``replicated=True``:

- store: page keys carry no rank (``umbp.keys.rank_key(key, None)``). With ``split=True`` (default) each rank
  offloads only its share, ``umbp.keys.split_for_ranks`` (page i belongs to rank i % N), so each page is written
  once; with ``split=False`` every rank offers every page and the metaserver's dedup (EXISTS at ALLOC) lets exactly
  one writer store each page while the others get False.
- load: each rank fetches its share, layer group by layer group, into a device-side exchange buffer (pool -> host
  -> device: 1/N of the bytes), then per group the ranks ``all_gather`` the group's bytes through
  ``torch.distributed`` (NCCL over NVLink on GPUs, gloo on CPU) and every rank scatters all pages into its KV
  slots (device-local copies). Per group, the ranks agree on the common prefix (an ``all_reduce`` MIN of the
  first missing page), so every rank ends with the same pages.
With ``replicated=False`` (MHA: each rank holds its own heads) keys carry the rank (``{key}_{rank}``) and each rank
stores and loads its own pages through a plain ``LayerwiseLoader``; nothing is exchanged.

Contracts: every rank of the group calls ``store``/``load`` with the same keys in the same order and iterates every
group of a replicated load (the exchange is collective; ``close()`` finishes the remaining groups so the ranks stay
in step). A replicated load checks the keys up front: before any rank reads its share, one ``all_reduce`` MIN of
``[n, -n, h, -h]`` (``n`` pages, ``h`` a 62-bit hash of the key list) tells every rank whether all ranks hold the
same list; if not, every rank raises ``InvalidArgument`` from ``load`` (nothing read, nothing written, no rank left
in a collective). Failure is collective too: every ``next()`` starts with one small ``all_reduce`` in which each
rank says whether its share failed, so when one rank's share raises, that rank raises its error and every other
rank raises ``TransportError`` at the same step; no rank is left waiting in a collective. Counters per rank
(cumulative):
``pool_to_host_bytes``, ``host_to_device_bytes`` (the rank's own share moved into device memory; a CPU KV buffer
counts as the device), ``exchange_bytes`` (received from peers), ``scatter_bytes`` (device-local copies into KV
slots), pages stored/existing/loaded.

Cost per replicated load: one tiny all_reduce (the key-list check) and a hash of the keys; then per layer group
one ranged-read batch of P/N pages, one all_gather of N x ceil(P/N) x group bytes, one tiny all_reduce (prefix
agreement and failure flag), one index copy per layer part. The exchange buffer grows by doubling (its loader is
replaced, the old one closed), so a stream of growing loads reallocates O(log P) times.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from umbp.engine.layout import PagedKV
from umbp.engine.loader import LayerLoad, LayerwiseLoader, ReadyGroup
from umbp.errors import InvalidArgument, TransportError
from umbp.keys import rank_key, split_for_ranks

COMPONENT = "engine tp"


class TPGroup:
    """One rank's view of a TP group sharing a pool. ``group``: a ``torch.distributed`` process group (default: the
    world); ``replicated``: the KV is the same on every rank (MLA) rather than sharded (MHA)."""

    def __init__(self, client: Any, kv: Any, *, replicated: bool, group_size: int = 1, group: Any = None,
                 use_mapped: bool = True, method: str = "auto"):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InvalidArgument(COMPONENT, "torch.distributed is not initialised (init_process_group first)")
        self.client = client
        self.kv = kv if isinstance(kv, PagedKV) else PagedKV(kv)
        self.layout = self.kv.layout(group_size)
        self.replicated = replicated
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.use_mapped = use_mapped
        self.method = method
        self.loader = LayerwiseLoader(client, self.kv, group_size, use_mapped=use_mapped, method=method)
        self.counters = {"pool_to_host_bytes": 0, "host_to_device_bytes": 0, "exchange_bytes": 0,
                         "scatter_bytes": 0, "host_to_pool_bytes": 0, "device_to_host_bytes": 0,
                         "pages_stored": 0, "pages_existing": 0, "pages_loaded": 0}
        self._send = None
        self._flat: LayerwiseLoader | None = None

    def keys_for(self, keys: Sequence[str]) -> list[str]:
        """The pool keys of this rank's pages: shared for replicated KV, ``{key}_{rank}`` for sharded KV."""
        return [rank_key(k, None if self.replicated else self.rank) for k in keys]

    # ---- offload

    def store(self, keys: Sequence[str], slots: Sequence[int], parents: Sequence[Any] | None = None, *,
              split: bool = True) -> list[bool]:
        """Offload slots as pages; True where this rank stored the page. See the module docstring for ``split``."""
        keys = list(keys)
        slots_a = self.kv.check_slots(slots)
        if len(keys) != slots_a.size:
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys but {slots_a.size} slots")
        pk = self.keys_for(keys)
        pp = None if parents is None else [None if p is None else self.keys_for([p])[0] for p in parents]
        idx = list(range(len(keys)))
        if self.replicated and split:
            idx = split_for_ranks(keys, self.size, self.rank)
        before = dict(self.loader.counters)
        res = self.loader.store([pk[i] for i in idx], slots_a[idx],
                                None if pp is None else [pp[i] for i in idx])
        self._add(before, ("host_to_pool_bytes", "device_to_host_bytes", "pages_stored", "pages_existing"))
        out = [False] * len(keys)
        for i, r in zip(idx, res):
            out[i] = r
        return out

    # ---- loads

    def load(self, keys: Sequence[str], slots: Sequence[int]):
        """Start a load: an iterator of ``ReadyGroup`` (a context manager). Replicated: split + exchange; sharded:
        this rank's own pages."""
        keys = list(keys)
        slots_a = self.kv.check_slots(slots)
        if len(keys) != slots_a.size:
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys but {slots_a.size} slots")
        if not self.replicated:
            before = dict(self.loader.counters)  # before the load's thread starts counting
            return _Counted(self, self.loader, self.loader.load(self.keys_for(keys), slots_a), before)
        return TPLoad(self, keys, slots_a)

    def load_all(self, keys: Sequence[str], slots: Sequence[int]) -> int:
        """Load every group (collective for replicated KV) and wait; returns the pages loaded on every rank."""
        with self.load(keys, slots) as ld:
            last = None
            for g in ld:
                last = g
            if last is not None:
                last.synchronize()
            return ld.pages

    def _add(self, before: dict, names: Sequence[str], source: LayerwiseLoader | None = None) -> None:
        src = (source or self.loader).counters
        for n in names:
            self.counters[n] += src[n] - before[n]

    def _flat_loader(self, rows: int):
        """The exchange buffer [rows, page_bytes] on the KV's device, seen as a PagedKV with the same layers (each
        layer a column block of the rows), and a loader filling it."""
        import torch

        pb = self.layout.page_bytes
        if self._send is None or self._send.shape[0] < rows:
            grown = max(rows, 1, 2 * (0 if self._send is None else self._send.shape[0]))
            if self._flat is not None:
                self._flat.close()  # its arena registrations; the new loader takes its own
            self._send = torch.zeros(grown, pb, dtype=torch.uint8, device=self.kv.device)
            cols, off = [], 0
            for lb in self.layout.layer_bytes:
                cols.append(self._send[:, off:off + lb])
                off += lb
            self._flat = LayerwiseLoader(self.client, PagedKV(cols), self.layout.group_size,
                                         use_mapped=self.use_mapped, method=self.method)
        return self._send, self._flat

    def close(self) -> None:
        self.loader.close()
        if self._flat is not None:
            self._flat.close()


class _Counted:
    """A sharded load: a plain ``LayerLoad`` whose byte counters are added to the group's on the way."""

    def __init__(self, tp: TPGroup, loader: LayerwiseLoader, load: LayerLoad, before: dict):
        self._tp, self._loader, self._load = tp, loader, load
        self._before: dict | None = before

    @property
    def pages(self) -> int:
        return self._load.pages

    def __iter__(self):
        return self

    def __next__(self) -> ReadyGroup:
        try:
            return next(self._load)
        except StopIteration:
            self._settle()
            raise

    def _settle(self) -> None:
        if self._before is not None:
            self._tp._add(self._before, ("pool_to_host_bytes", "host_to_device_bytes", "pages_loaded"), self._loader)
            self._before = None

    def close(self) -> None:
        self._load.close()
        self._settle()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def keys_digest(keys: Sequence[Any]) -> int:
    """A 62-bit hash of a key list (str or bytes keys, order included): small enough that ``h`` and ``-h`` both fit
    an int64 for an ``all_reduce`` MIN."""
    h = hashlib.blake2b(digest_size=8)
    for k in keys:
        b = k.encode() if isinstance(k, str) else bytes(k)
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


class TPLoad:
    """A replicated load in progress: this rank's share streams in on a background thread (``LayerLoad``); each
    ``next()`` exchanges one layer group with the other ranks (collective) and scatters it into the KV slots.
    Construction is collective too: it checks that every rank loads the same key list (``_check_same_keys``)."""

    def __init__(self, tp: TPGroup, keys: list, slots: np.ndarray):
        import torch
        import torch.distributed as dist

        self._tp = tp
        self._dist = dist
        n, size, rank = len(keys), tp.size, tp.rank
        self._n = n
        backend = dist.get_backend(tp.group)
        self._cdev = torch.device("cpu") if backend == "gloo" else tp.kv.device
        self._check_same_keys(keys)
        self._mine = split_for_ranks(keys, size, rank)
        self._rows = -(-n // size) if n else 0
        self._send, flat = tp._flat_loader(self._rows)
        self._flat = flat
        self._before = dict(flat.counters)
        self._slots = torch.as_tensor(slots, dtype=torch.int64, device=tp.kv.device)
        # page i sits in row (i % size) * rows + i // size of the gathered buffer
        ids = np.arange(n, dtype=np.int64)
        self._src_rows = torch.as_tensor((ids % size) * self._rows + ids // size, device=tp.kv.device)
        self._not_mine = (ids % size) != rank
        self._inner = flat.load([keys[i] for i in self._mine], list(range(len(self._mine))))
        self.pages = n
        self._done = False

    def __iter__(self) -> "TPLoad":
        return self

    def _check_same_keys(self, keys: list) -> None:
        """Collective: raise ``InvalidArgument`` on every rank unless every rank of the group loads the same key
        list. One all_reduce MIN of ``[n, -n, h, -h]``: the ranks agree exactly when both pairs cancel. A rank whose
        own lookup saw fewer pages (an eviction between two ranks' lookups) or whose batch holds other requests
        would otherwise exchange rows of other pages and scatter wrong bytes."""
        import torch

        n, h = len(keys), keys_digest(keys)
        t = torch.tensor([n, -n, h, -h], dtype=torch.int64, device=self._cdev)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._tp.group)
        lo_n, hi_n, lo_h, hi_h = (int(x) for x in t.tolist())
        if lo_n != -hi_n or lo_h != -hi_h:
            raise InvalidArgument(COMPONENT, f"rank {self._tp.rank}: the ranks of the TP group load different key "
                                             f"lists ({n} pages here, {lo_n}..{-hi_n} across ranks, key hashes "
                                             f"{'differ' if lo_h != -hi_h else 'agree'}); nothing was loaded")

    def _agree(self, own_pages: int, failed: bool) -> tuple[int, bool]:
        """One collective round: the common prefix across ranks (MIN over ranks of the first page, global index,
        each one misses) and whether any rank failed. Every rank takes part in it on every ``next()``, the last
        (StopIteration) and a failing one included, so a rank whose share raised never leaves the others waiting."""
        import torch

        first_miss = self._mine[own_pages] if own_pages < len(self._mine) else self._n
        t = torch.tensor([first_miss, -int(failed)], dtype=torch.int64, device=self._cdev)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._tp.group)
        return int(t[0].item()), bool(t[1].item() < 0)

    def __next__(self) -> ReadyGroup:
        import torch

        if self._done:
            raise StopIteration
        grp, err, ended = None, None, False
        try:
            grp = next(self._inner)
        except StopIteration:
            ended = True
        except Exception as e:  # this rank's share failed: tell the others before raising it
            err = e
        agreed, any_failed = self._agree(grp.pages if grp is not None else 0, err is not None)
        if any_failed:
            self._done = True  # the others raise too: no later round
            if err is not None:
                raise err
            raise TransportError(COMPONENT, f"rank {self._tp.rank}: another rank of the TP group failed to load its "
                                            f"share; the load is abandoned on every rank")
        if ended:
            self._finish()
            raise StopIteration
        # the KV device's stream waits for the copies of our share (named: a linker's load thread, whose current
        # device is 0 whatever GPU this rank uses, would otherwise make device 0's stream wait)
        grp.wait(torch.cuda.current_stream(self._tp.kv.device) if self._tp.kv.is_cuda else None)
        tp = self._tp
        pages = min(self.pages, agreed)
        self.pages = pages
        goff, glen = tp.layout.group_range(grp.index)
        chunk = self._send[: self._rows, goff:goff + glen].contiguous()
        recv = torch.empty(tp.size, self._rows, glen, dtype=torch.uint8, device=chunk.device)
        if self._cdev.type == "cpu" and chunk.device.type != "cpu":
            raise InvalidArgument(COMPONENT, "gloo exchange of CUDA KV is not supported; use the nccl backend")
        self._dist.all_gather(list(recv.unbind(0)), chunk, group=tp.group)
        flat = recv.view(tp.size * self._rows, glen)
        rows = self._src_rows[:pages]
        dst = self._slots[:pages]
        picked = flat.index_select(0, rows)  # [pages, group bytes] in page order
        rel = 0
        for li in grp.layers:
            for t, row in zip(tp.kv.parts[li], tp.kv.part_rows[li]):
                part = t.view(t.shape[0], -1).view(torch.uint8)
                part.index_copy_(0, dst, picked[:, rel:rel + row])
                rel += row
        tp.counters["exchange_bytes"] += int(self._not_mine[:pages].sum()) * glen
        tp.counters["scatter_bytes"] += pages * glen
        ev = None
        if tp.kv.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(tp.kv.device))
        return ReadyGroup(grp.index, grp.layers, pages, ev)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._tp._add(self._before, ("pool_to_host_bytes", "host_to_device_bytes"), self._flat)
            self._tp.counters["pages_loaded"] += self.pages

    def close(self) -> None:
        """Run the remaining groups' exchanges (every rank must take part), then settle the counters."""
        try:
            for _ in range(self._tp.layout.num_groups + 1):  # bounded: one exchange per remaining group
                if self._done:
                    break
                try:
                    next(self)
                except StopIteration:
                    break
        finally:
            self._inner.close()

    def __enter__(self) -> "TPLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
