"""Layer-wise loading of a prefix's KV pages from the pool into an engine's paged KV buffer, and the reverse (offload).

``LayerwiseLoader.load(keys, slots)`` returns a ``LayerLoad``: an iterator of ``ReadyGroup``s, one per layer group
(``group_size`` layers). A background thread moves group g+1 while the caller computes with group g, so the first
layers can start long before the whole prefix has arrived. Per group:

- pages on a same-host node (``Client.mapped``: one LOOKUP and one read lease for the whole load) are gathered
  straight out of the mapped arena: on CPU by memmove, on CUDA by the gather kernel reading the arena, which is
  ``cudaHostRegister``-ed once per loader (a process-wide reference count: ``gather.HostRegistry``) (zero-copy: no
  pool->host copy at all);
- other pages come by one ranged read per page per group (``batch_get_ranges_into``) into host staging (on CUDA
  pinned, two buffers used alternately), from which the gather moves them into the KV slots (one request per
  page and group: a range per layer part straight into the rows would cost a transport request each).
On CUDA each group's copies run on the loader's copy stream and a ``torch.cuda.Event`` is recorded after them;
``ReadyGroup.wait()`` makes the caller's stream wait for it. On CPU a group is yielded once its bytes are in place.

Contracts:
- Pages are a prefix: once page p is missing from any group, pages from p on are not loaded in later groups;
  ``ReadyGroup.pages`` (and ``LayerLoad.pages`` at the end) is the leading run of pages whose layers so far are all
  in the buffer. The caller recomputes the rest.
- The load is valid only if iteration ends normally: a slot rewritten under the mapped lease raises
  ``CorruptionError`` from the iterator after the last group (the bytes already yielded are garbage then).
- One load at a time per loader (its staging buffers and copy stream are shared). ``close()`` on a load (or leaving
  its ``with``) stops the thread after the group in flight; that wait is bounded by one client call's deadline.
- ``counters`` (cumulative): ``pool_to_host_bytes`` (bytes copied out of the pool into host memory: staging, or a
  CPU KV buffer), ``host_to_device_bytes`` (bytes written into the KV buffer by a gather or a direct read; a CPU KV
  buffer counts as the device so CPU runs can check splits), ``zero_copy_bytes`` (of those, read by the GPU
  straight from a mapped arena), ``device_to_host_bytes`` and ``host_to_pool_bytes`` (offload staged through
  pinned host memory), ``device_to_pool_bytes`` (offload written by the kernel straight into a same-host arena),
  pages and groups.

Cost: per group, at most one client call (one LOOKUP + ranged reads) plus one gather; the mapped LOOKUP is once per
load. Threads: one per active load.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from umbp.devcopy import DeviceBatch
from umbp.engine import gather
from umbp.engine.layout import PagedKV, PageLayout
from umbp.errors import DeadlineExceeded, InvalidArgument, UmbpError

COMPONENT = "engine loader"
_DONE = object()


@dataclass
class ReadyGroup:
    """Layer group ``index`` (``layers``) is in the KV buffer for the first ``pages`` pages (CUDA: once ``event``
    has passed on the copy stream)."""

    index: int
    layers: range
    pages: int
    event: Any = None

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for this group's copies; no-op on CPU."""
        if self.event is not None:
            import torch

            (stream or torch.cuda.current_stream()).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the calling thread until this group's copies are done; no-op on CPU."""
        if self.event is not None:
            self.event.synchronize()


def leading_run(present: np.ndarray) -> int:
    missing = np.flatnonzero(~present)
    return int(missing[0]) if missing.size else int(present.size)


class LayerLoad:
    """A running layer-wise load: iterate for ``ReadyGroup``s in layer order; a context manager."""

    def __init__(self, loader: "LayerwiseLoader", keys: list, slots: np.ndarray):
        self._loader = loader
        self._keys = keys
        self._slots = slots
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._finished = False
        self.pages = 0
        self.groups: list[ReadyGroup] = []
        # perf_counter() marks for diagnosis (benchmarks print them): start, lookup (the mapped LOOKUP and header
        # checks done), and when each group was queued (its copies launched, on CUDA; done, on CPU)
        self.marks: dict[str, Any] = {"start": time.perf_counter(), "lookup": None, "queued": []}
        self._start_event = None
        if loader.kv.is_cuda:
            import torch

            # the copies must not overwrite slots that work already queued on the caller's stream still reads
            self._start_event = torch.cuda.Event()
            self._start_event.record(torch.cuda.current_stream(loader.kv.device))
        self._thread = threading.Thread(target=self._run, name="umbp-layerwise", daemon=True)
        self._thread.start()

    # ---- caller side

    def __iter__(self) -> "LayerLoad":
        return self

    def __next__(self) -> ReadyGroup:
        if self._finished:
            raise StopIteration
        item = self._q.get()
        if item is _DONE:
            self._finished = True
            self._join()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            self._join()
            raise item
        self.groups.append(item)
        self.pages = item.pages
        return item

    def wait_all(self) -> int:
        """Consume every group and wait for the last copy; returns the pages fully loaded."""
        last = None
        for g in self:
            last = g
        if last is not None:
            last.synchronize()
        return self.pages

    def close(self) -> None:
        """Stop after the group in flight and wait for the thread (bounded by one client call's deadline)."""
        self._stop.set()
        while not self._finished:
            try:
                next(self)
            except StopIteration:
                break
            except UmbpError:
                break
        self._join()

    def __enter__(self) -> "LayerLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _join(self) -> None:
        limit = self._loader.client.config.timeout_s * 2 + 10
        self._thread.join(limit)
        if self._thread.is_alive():
            raise DeadlineExceeded(COMPONENT, f"load thread still running after {limit:.0f}s")

    # ---- worker thread

    def _run(self) -> None:
        try:
            self._load()
            self._q.put(_DONE)
        except BaseException as e:  # delivered to the caller's next()
            self._q.put(e)
        finally:
            # Shared state is safe to hand on now: the staging ring is guarded by its events, the stream is ordered.
            if self._loader._active is self:
                self._loader._active = None
            self._loader._busy.release()

    def _load(self) -> None:
        ld = self._loader
        kv, layout, client = ld.kv, ld.layout, ld.client
        keys, slots = self._keys, self._slots
        n = len(keys)
        present = np.ones(n, dtype=bool)
        stream = ld._copy_stream()
        if stream is not None:
            stream.wait_event(self._start_event)
        with contextlib.ExitStack() as stack:
            mapped_pages: list[int] = []
            arena_bufs: list[gather.HostBuffer] = []
            arena_index: dict[str, int] = {}
            payload_off = np.zeros(n, dtype=np.int64)
            arena_of = np.zeros(n, dtype=np.int64)
            if ld.use_mapped and n and hasattr(client, "mapped"):
                m = stack.enter_context(client.mapped(keys))
                self.marks["lookup"] = time.perf_counter()
                if stream is not None:
                    # the header re-check on exit must come after every kernel that read the arena
                    stack.callback(stream.synchronize)
                for p, loc in enumerate(m.locs):
                    if loc is None:
                        continue
                    node_id, off, size = loc
                    if size != layout.page_bytes:
                        raise InvalidArgument(COMPONENT, f"page {p} holds {size} bytes, the layout {layout.page_bytes}")
                    if node_id not in arena_index:
                        buf = ld._arena_buffer(m.arenas[node_id])
                        if buf is None:
                            continue  # the GPU cannot reach this arena: fetch its pages by ranged reads
                        arena_index[node_id] = len(arena_bufs)
                        arena_bufs.append(buf)
                    if node_id in arena_index:
                        mapped_pages.append(p)
                        payload_off[p] = off
                        arena_of[p] = arena_index[node_id]
            is_mapped = np.zeros(n, dtype=bool)
            is_mapped[mapped_pages] = True
            live = n
            for g in range(layout.num_groups):
                if self._stop.is_set():
                    break
                layers = layout.group_layers(g)
                goff, glen = layout.group_range(g)
                idx = np.arange(live)
                mi = idx[is_mapped[:live]]
                fi = idx[~is_mapped[:live]]
                if mi.size:
                    hp = gather.HostPages(arena_bufs, arena_of[mi], payload_off[mi] + goff)
                    moved = gather.to_kv(kv, slots[mi], hp, layers, method=ld.method, stream=stream)
                    ld.counters["host_to_device_bytes"] += moved
                    if kv.is_cuda:
                        ld.counters["zero_copy_bytes"] += moved
                    else:
                        ld.counters["pool_to_host_bytes"] += moved
                if fi.size:
                    got = ld._fetch(g, keys, slots, fi, layers, goff, glen, stream)
                    present[fi[got < 0]] = False
                live = min(live, leading_run(present))
                ev = None
                if stream is not None:
                    import torch

                    ev = torch.cuda.Event()
                    ev.record(stream)
                    ld._ring_events[g % 2] = ev
                ld.counters["groups_loaded"] += 1
                self.marks["queued"].append(time.perf_counter())
                self._q.put(ReadyGroup(g, layers, live, ev))
                # Let the consumer take the GIL now: otherwise this thread, busy with the next group's copies,
                # can keep it for a whole switch interval (5 ms) and the ready group waits for nothing.
                time.sleep(0)
            ld.counters["pages_loaded"] += live


class LayerwiseLoader:
    """Loads prefixes layer group by layer group into ``kv`` and offloads slots back to the pool.

    ``client``: an ``umbp.Client``; ``kv``: a ``PagedKV`` (or anything ``PagedKV`` accepts); ``group_size``: layers
    per group; ``use_mapped``: read same-host pages straight from the mapped arena; ``method``: the CUDA gather
    method (``auto``, ``kernel``, ``staged``; see ``umbp.engine.gather``)."""

    def __init__(self, client: Any, kv: Any, group_size: int = 1, *, use_mapped: bool = True,
                 method: str = "auto"):
        self.client = client
        self.kv = kv if isinstance(kv, PagedKV) else PagedKV(kv)
        self.layout: PageLayout = self.kv.layout(group_size)
        self.use_mapped = use_mapped
        self.method = method
        self.counters = {"pool_to_host_bytes": 0, "host_to_device_bytes": 0, "zero_copy_bytes": 0,
                         "device_to_host_bytes": 0, "host_to_pool_bytes": 0, "pages_loaded": 0,
                         "groups_loaded": 0, "pages_stored": 0, "pages_existing": 0,
                         "device_to_pool_bytes": 0}
        self._busy = threading.Semaphore(1)
        self._active: LayerLoad | None = None
        self._stream = None
        self._staging: list[Any] = [None, None]
        self._ring_events: list[Any] = [None, None]
        self._store_staging = None
        self._cpu_staging: np.ndarray | None = None
        self._registered: dict[int, gather.HostBuffer | None] = {}

    # ---- loads

    def load(self, keys: Sequence[Any], slots: Sequence[int]) -> LayerLoad:
        """Start loading page ``keys[p]`` into slot ``slots[p]``; iterate the result for ready groups."""
        keys = list(keys)
        slots_a = self.kv.check_slots(slots)
        if len(keys) != slots_a.size:
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys but {slots_a.size} slots")
        if np.unique(slots_a).size != slots_a.size:
            raise InvalidArgument(COMPONENT, "two pages map to the same slot")
        if not self._busy.acquire(blocking=False):
            raise InvalidArgument(COMPONENT, "a load is already running on this loader (one at a time)")
        try:
            self._active = LayerLoad(self, keys, slots_a)
        except BaseException:
            self._busy.release()
            raise
        return self._active

    def load_all(self, keys: Sequence[Any], slots: Sequence[int]) -> int:
        """Load every group and wait; returns the number of leading pages now in the buffer."""
        with self.load(keys, slots) as ld:
            return ld.wait_all()

    def _copy_stream(self):
        if not self.kv.is_cuda:
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(self.kv.device)
        return self._stream

    def _arena_buffer(self, arena: memoryview) -> gather.HostBuffer | None:
        """The arena as a gather source; on CUDA registered once (None if the GPU cannot reach it)."""
        buf = gather.host_buffer(arena, writable=False)
        if not self.kv.is_cuda:
            return buf
        if buf.addr not in self._registered:
            try:
                self._registered[buf.addr] = gather.register_host(arena)
            except gather.GatherUnavailable:
                self._registered[buf.addr] = None
        return None if self._registered[buf.addr] is None else gather.host_buffer(arena, writable=False)

    def _fetch(self, g: int, keys: list, slots: np.ndarray, fi: np.ndarray, layers: range, goff: int, glen: int,
               stream: Any) -> np.ndarray:
        """Ranged reads of group ``g`` for pages ``fi``; returns bytes got per page (-1 = miss)."""
        kv = self.kv
        sub_keys = [keys[p] for p in fi.tolist()]
        need = len(sub_keys) * glen
        # One ranged read per page per group into host staging, then the gather into the KV slots: a range per
        # layer part straight into the rows would cost a transport request each on tcp/rdma.
        if kv.is_cuda:
            import torch

            k = g % 2
            if self._ring_events[k] is not None:
                self._ring_events[k].synchronize()  # the kernel that read this buffer two groups ago is done
            if self._staging[k] is None or self._staging[k].numel() < need:
                self._staging[k] = torch.empty(max(need, 1 << 20), dtype=torch.uint8, pin_memory=True)
            st = self._staging[k]
            view = memoryview(st.numpy())
        else:
            if self._cpu_staging is None or self._cpu_staging.size < need:
                self._cpu_staging = np.empty(max(need, 1 << 20), dtype=np.uint8)
            st = self._cpu_staging
            view = memoryview(st)
        outs = [[view[i * glen:(i + 1) * glen]] for i in range(len(sub_keys))]
        got = np.asarray(self.client.batch_get_ranges_into(sub_keys, [[(goff, glen)]] * len(sub_keys), outs),
                         dtype=np.int64)
        hit = np.flatnonzero(got >= 0)
        self.counters["pool_to_host_bytes"] += int(got[hit].sum())
        if hit.size:
            hp = gather.HostPages([gather.host_buffer(st)], np.zeros(hit.size, np.int64), hit * glen)
            self.counters["host_to_device_bytes"] += gather.to_kv(kv, slots[fi[hit]], hp, layers,
                                                                  method=self.method, stream=stream)
        return got

    # ---- offload

    def store(self, keys: Sequence[Any], slots: Sequence[int], parents: Sequence[Any] | None = None, *,
              skip_existing: bool = False) -> list[bool]:
        """Write KV slot ``slots[p]`` (all layers) as page object ``keys[p]``; returns ``batch_put``'s list (True:
        stored now, False: it already existed). ``skip_existing`` asks the metaserver first (no lease) and moves
        only missing pages off the device. CPU: the slot rows are handed to ``batch_put_ranges`` as they are
        (one buffer per layer part, nothing concatenated); CUDA: ``client.put_device`` of the slot rows, which the
        kernel writes straight into same-host arenas (``device_to_pool_bytes``), the other pages packed into pinned
        memory by the gather first (``device_to_host_bytes``, then ``host_to_pool_bytes``)."""
        keys = list(keys)
        slots_a = self.kv.check_slots(slots)
        if len(keys) != slots_a.size:
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys but {slots_a.size} slots")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys but {len(parents)} parents")
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        if skip_existing and keys:
            todo = [i for i, e in enumerate(self.client.batch_exists(keys)) if not e]
            self.counters["pages_existing"] += len(keys) - len(todo)
        if not todo:
            return out
        kv, pb = self.kv, self.layout.page_bytes
        sub_keys = [keys[i] for i in todo]
        sub_parents = None if parents is None else [parents[i] for i in todo]
        sub_slots = slots_a[todo]
        if not kv.is_cuda:
            parts = [[row for li in range(kv.num_layers) for row in kv.rows(li, s)] for s in sub_slots.tolist()]
            res = self.client.batch_put_ranges(sub_keys, parts, sub_parents)
            direct = 0
        else:
            batch = self._device_batch(sub_slots)
            res = self.client.put_device(sub_keys, batch, sub_parents)
            direct = int(np.count_nonzero(np.asarray(res, dtype=bool) & (batch.via == DeviceBatch.VIA_KERNEL)))
        for i, r in zip(todo, res):
            out[i] = r
        stored = sum(1 for r in res if r)
        self.counters["pages_stored"] += stored
        self.counters["pages_existing"] += len(res) - stored
        self.counters["device_to_pool_bytes"] += direct * pb
        self.counters["host_to_pool_bytes"] += (stored - direct) * pb
        return out

    def _device_batch(self, slots: np.ndarray) -> DeviceBatch:
        """Slots ``slots`` of the CUDA KV buffer as a put's device pages: one segment per layer part (a slot row),
        in page-byte order. Pages the kernel cannot place are staged by ``_stage_slots``."""
        src, _rel, lens = gather.slot_rows(self.kv, slots)
        m, per = src.shape
        return DeviceBatch(m, np.arange(m), np.full(m, per), src, np.tile(lens, m), np.zeros(m, np.int64),
                           [self.kv.device], lambda idxs: self._stage_slots(slots[idxs]), keep=self.kv)

    def _stage_slots(self, slots: np.ndarray) -> tuple[list, Any]:
        """The staged offload: the gather packs the slots into this loader's pinned staging (reused by the next
        call: the put path releases one staging before the next). Returns (one view per page, release)."""
        import torch

        kv, pb, n = self.kv, self.layout.page_bytes, len(slots)
        if self._store_staging is None or self._store_staging.numel() < n * pb:
            self._store_staging = torch.empty(max(n * pb, 1 << 20), dtype=torch.uint8, pin_memory=True)
        st = self._store_staging
        stream = self._copy_stream()
        stream.wait_stream(torch.cuda.current_stream(kv.device))  # the model's writes to these slots first
        hp = gather.HostPages.rows(st, n, pb, writable=True)
        self.counters["device_to_host_bytes"] += gather.from_kv(kv, slots, hp, method=self.method, stream=stream)
        stream.synchronize()
        view = memoryview(st.numpy())
        return [[view[i * pb:(i + 1) * pb]] for i in range(n)], lambda: None

    def prepare(self) -> int:
        """Register every same-host node arena with CUDA now (a one-time cost of ~50 ms per GiB pinned), so the
        first load does not pay it before its first group. No-op on CPU or without mapped loads; returns the
        arenas the GPU can read."""
        if not (self.kv.is_cuda and self.use_mapped and hasattr(self.client, "local_arenas")):
            return 0
        return sum(self._arena_buffer(a) is not None for a in self.client.local_arenas().values())

    def close(self) -> None:
        """Stop a running load and give back this loader's references on the arenas it registered with CUDA (the
        registrations are counted process-wide: an arena another loader still uses stays registered). Every
        reference is given back even if one fails; the first failure (``HostRegistrationError``) is raised."""
        if self._active is not None:
            self._active.close()
        bufs = [b for b in self._registered.values() if b is not None]
        self._registered.clear()
        first: UmbpError | None = None
        for buf in bufs:
            try:
                gather.unregister_host(buf)
            except UmbpError as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "LayerwiseLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
