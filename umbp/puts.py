"""The put path of ``umbp.Client``: ``Puts``, the part behind ``batch_put``, ``batch_put_ranges``, ``put_device`` and
``direct_device_puts`` (held as ``client.puts``; it reads the client's metaserver connection, transports, lock and
counters through its client): ALLOC, write, COMMIT, in chunks pipelined on the metaserver connection.

A batch_put of more than one chunk (CHUNK_MAX_PAGES pages or about CHUNK_BYTES) has the next chunks' ALLOCs
(ALLOC_AHEAD of them) and the previous chunks' COMMITs in flight while a chunk is written; the call returns only once
every COMMIT is durable. Keys another writer holds PENDING (IN_FLIGHT) are asked again with a short backoff
(IN_FLIGHT_WAIT_S, slept without the client lock: other threads' calls on the client go on meanwhile) until they are
READY (False: someone else stored them) or free (this call writes them); a commit that finds its allocation lost (a
failover, an expiry) is written again once. Keys whose write failed are aborted, never committed. Bounded by the
call's one deadline.

Payloads in device memory (``put_device``; ``batch_put`` / ``batch_put_ranges`` with CUDA tensors, through
``_put_cuda``) come as a ``umbp.devcopy.DeviceBatch``. The same ALLOC / write / COMMIT runs; in each chunk the NEW
places on nodes reachable over shm whose arena CUDA registered are written by the gather kernel straight from the
device (``DeviceCopier.write``: old header invalidated, payload, header last), the others are staged to pinned host
memory (the batch's stager) and written by their transport. Where the kernel cannot run at all (no CUDA or CuPy,
payload checksums on: the checksum needs host bytes) every device page is staged once, up front. Counters:
``kernel_put_bytes`` / ``staged_put_bytes`` (device payloads stored by this client through either path).

The part refers to its client weakly (as ``umbp.mapped.Mapped`` does): the client holds the part, and a strong
reference back would make a cycle, so a client dropped without ``close()`` would wait for the cyclic collector
instead of closing at once. A call holds its client strongly for as long as it runs.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Sequence

import numpy as np

from transport import objformat, wire
from transport.base import WriteOp, late_write
from umbp import copies, putbatch
from umbp.auth import with_caps
from umbp.buffers import PINNED, Rows, as_bytes_view, stage_cuda
from umbp.devcopy import DeviceBatch
from umbp.errors import DeadlineExceeded, InvalidArgument, PoolFull, TransportError, UmbpError
from umbp.keys import normalize_key, normalize_keys

NEW, EXISTS, NO_SPACE, IN_FLIGHT = (wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NO_SPACE,
                                    wire.AllocState.IN_FLIGHT)
IN_FLIGHT_WAIT_S = (0.005, 0.01, 0.02, 0.05, 0.1)  # backoff while another writer holds a key PENDING
# A batch_put of more than one chunk is pipelined: ALLOC of the next chunk and COMMIT of the previous ones overlap
# the writes (every page still acknowledged only once its COMMIT is durable). A chunk is at most CHUNK_MAX_PAGES
# pages (etcd's default transaction cap: one COMMIT fits a transaction of any etcd; the metaserver's writer takes up
# to 1,024 operations, so the COMMITs of several chunks and clients share one) and about CHUNK_BYTES (at least
# CHUNK_MIN_PAGES pages): big pages are bandwidth-bound, one metaserver round trip per few MiB would only cost.
# CHUNK_BYTES was 64 MiB; a 4 MiB x64 put (256 MiB) then ran as four chunks, each its own copy job set, and measured
# (put over get of the same pages, scratch phase timing, means over 10-20 rounds) 0.58-0.67 on the 16-core H100 host
# and 0.74-0.76 on the 2-core VM, against 0.77-0.78 and 0.85-0.91 as one chunk of 256 MiB; tcp the same either way
# (0.89-0.94). Pages of 512 KiB and less are bounded by CHUNK_MAX_PAGES before this.
CHUNK_BYTES = 256 << 20
CHUNK_MIN_PAGES = 2
CHUNK_MAX_PAGES = 128
ALLOC_AHEAD = 2  # ALLOCs in flight beyond the chunk being written
# While a pipelined chunk is written the metaserver serves the other chunks' ALLOCs and COMMITs, work per page. A
# chunk of pages smaller than this on average leaves it a core (``copies.sharing_cores``); bigger pages are copy
# bound and take every core. Measured on 2 cores (shm, put/get of the same size, rounds alternating in one process,
# medians of 20): 4 MiB x64 0.62 sharing, 0.80 not; 1 MiB x256 0.72 and 0.85; 64 KiB x1024 0.97 sharing.
SHARE_BELOW_PAGE_BYTES = 256 << 10


def _metaserver_bound(batches: dict[str, list[WriteOp]]) -> bool:
    """Whether a pipelined chunk's pages are small enough (SHARE_BELOW_PAGE_BYTES) to leave the metaserver a core."""
    n = sum(len(ops) for ops in batches.values())
    return sum(op.nbytes for ops in batches.values() for op in ops) < SHARE_BELOW_PAGE_BYTES * n


class _PutResult:
    """What the chunks of one ``_put_once`` found, gathered as they are written and committed."""

    __slots__ = ("stored", "lost", "full", "waiting", "bad", "dedup", "first_err", "chunks_done")

    def __init__(self) -> None:
        self.stored: list[int] = []  # committed by this call
        self.lost: list[int] = []  # written, but COMMIT found the allocation gone: write again
        self.full: list[int] = []  # NO_SPACE
        self.waiting: list[int] = []  # IN_FLIGHT: another writer holds the key
        self.bad: list[int] = []  # write failed: aborted
        self.dedup = 0
        self.first_err: Exception | None = None
        self.chunks_done: list[dict] = []  # per chunk whose ALLOC answer was used: key index -> generation

    def committed(self, idxs: list[int], oks: list[bool]) -> None:
        if len(oks) == len(idxs) and all(oks):
            self.stored += idxs
            return
        for i, ok in zip(idxs, oks):
            (self.stored if ok else self.lost).append(i)


def _any_cuda(values: Sequence[Any]) -> bool:
    for v in values:
        dev = getattr(v, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            return True
    return False


class Puts:
    """ALLOC, write and COMMIT for ``umbp.Client`` (see the module docstring)."""

    def __init__(self, client: Any):
        self._client = weakref.ref(client)

    def batch_put(self, keys: Sequence[Any], values: Sequence[Any], parents: Sequence[Any] | None = None
                  ) -> list[bool]:
        if len(keys) != len(values):
            raise InvalidArgument(self._client().component, f"batch_put: {len(keys)} keys but {len(values)} values")
        views = putbatch.host_views(values)  # numpy byte arrays, bytes: views by map (umbp/putbatch.py)
        if views is not None:
            return self._put(keys, views, parents)
        if _any_cuda(values):  # the kernel writes them straight into same-host arenas
            return self._put_cuda(keys, [[v] for v in values], parents, "values")
        return self._put(keys, [[as_bytes_view(v, "values", i)] for i, v in enumerate(values)], parents)

    def batch_put_ranges(self, keys: Sequence[Any], parts: Sequence[Sequence[Any]],
                         parents: Sequence[Any] | None = None) -> list[bool]:
        """Store page i as the concatenation of the buffers ``parts[i]`` (one per layer, say), without joining
        them first: each transport writes the parts back to back into the page's slot. Same contract as
        ``batch_put``: True stored by this call, False already there."""
        c = self._client()
        if len(keys) != len(parts):
            raise InvalidArgument(c.component, f"batch_put_ranges: {len(keys)} keys but {len(parts)} part lists")
        cuda = False
        for i, ps in enumerate(parts):
            if isinstance(ps, (bytes, bytearray, memoryview)) or not isinstance(ps, Sequence):
                raise InvalidArgument(c.component, f"batch_put_ranges: parts[{i}] must be a list of buffers")
            cuda = cuda or _any_cuda(ps)
        if cuda:
            return self._put_cuda(keys, parts, parents, "parts")
        return self._put(keys, [[as_bytes_view(v, f"parts[{i}][{j}]") for j, v in enumerate(ps)]
                                for i, ps in enumerate(parts)], parents)

    def put_device(self, keys: Sequence[Any], batch: DeviceBatch, parents: Sequence[Any] | None = None
                   ) -> list[bool]:
        """``batch_put`` of pages that lie in device memory (every page of ``batch``; see the module docstring).
        Same contract: True stored by this call, False already there."""
        c = self._client()
        if batch.n != len(keys) or not batch.on_device.all():
            raise InvalidArgument(c.component, f"put_device: {len(keys)} keys but a device batch of {batch.n} "
                                               f"pages, {int(batch.on_device.sum())} on the device")
        return self._put(keys, [None] * len(keys), parents, batch)

    def _put_cuda(self, keys: Sequence[Any], parts: Sequence[Sequence[Any]], parents: Sequence[Any] | None,
                  what: str) -> list[bool]:
        """``batch_put`` / ``batch_put_ranges`` with CUDA tensors among the values: a page whose parts are all
        contiguous tensors of one device goes through the device path; a page mixing host and device parts is
        staged (``stage_cuda``) up front; host pages are viewed as usual."""
        tensors: dict[int, list[Any]] = {}
        views: list = [None] * len(parts)
        pinned: list = []
        try:
            for i, ps in enumerate(parts):
                devs = {getattr(getattr(v, "device", None), "type", "cpu") != "cpu" and v.device for v in ps}
                if len(devs) == 1 and next(iter(devs)) is not False and all(v.is_contiguous() for v in ps):
                    tensors[i] = list(ps)
                    continue
                if devs != {False}:
                    ps, taken = stage_cuda(ps)
                    pinned += taken
                views[i] = [as_bytes_view(v, what, i) if what == "values" else as_bytes_view(v, f"{what}[{i}][{j}]")
                            for j, v in enumerate(ps)]

            def stager(idxs: list[int]) -> tuple[list, Any]:
                hosts, taken = stage_cuda([t for i in idxs for t in tensors[i]])
                out, k = [], 0
                for i in idxs:
                    m = len(tensors[i])
                    out.append([as_bytes_view(h) for h in hosts[k:k + m]])
                    k += m
                return out, lambda: [PINNED.give(h) for h in taken]

            batch = DeviceBatch.from_tensors(len(parts), tensors, stager) if tensors else None
            return self._put(keys, views, parents, batch)
        finally:
            for h in pinned:
                PINNED.give(h)

    def direct_device_puts(self) -> bool:
        """Whether device payloads can go straight to an arena here: the kernel runs, no payload checksums, and
        at least one same-host node's arena is registered with CUDA. Blocks for one NODES request."""
        c = self._client()
        if c.config.checksum or not c._device.usable():
            return False
        arenas = c.local_arenas()
        with c._lock:
            return bool(c._kernel_nodes([(n,) for n in arenas], c._deadline()))

    def _put(self, keys: Sequence[Any], views: list, parents: Sequence[Any] | None, dev: DeviceBatch | None = None
             ) -> list[bool]:
        """``views[i]``: page i's flat byte views, or None for a page of ``dev`` (device memory)."""
        c = self._client()
        if not keys:
            return []
        release = None
        if dev is not None and (c.config.checksum or not c._device.usable()):
            # the kernel cannot run here (or the checksum needs host bytes): every device page staged once
            idxs = np.flatnonzero(dev.on_device).tolist()
            staged, release = dev.stager(idxs)
            views = list(views)
            for i, v in zip(idxs, staged):
                views[i] = v
            dev.via[idxs] = DeviceBatch.VIA_STAGED
        try:
            return self._put_views(keys, views, parents, dev)
        finally:
            if release is not None:
                release()

    def _put_views(self, keys: Sequence[Any], views: list, parents: Sequence[Any] | None, dev: DeviceBatch | None
                   ) -> list[bool]:
        c = self._client()
        kb = normalize_keys(keys)
        if parents is not None and len(parents) != len(kb):
            raise InvalidArgument(c.component, f"batch_put: {len(kb)} keys but {len(parents)} parents")
        pb = None if parents is None else [None if p is None else normalize_key(p) for p in parents]
        sizes = putbatch.sizes_of(views) or [int(dev.nbytes[i]) if v is None else len(v[0]) if len(v) == 1 else
                                             sum(len(x) for x in v) for i, v in enumerate(views)]
        out = [False] * len(kb)
        with c._lock:
            deadline = c._deadline()
        todo = list(range(len(kb)))
        # A commit can come back not-ok when its allocation was lost (the metaserver leader died between ALLOC and
        # COMMIT, or the allocation expired): the bytes were never visible, so allocate and write again, once,
        # within the same deadline. Keys another writer holds PENDING (IN_FLIGHT) are asked again with a short
        # backoff until they are READY (False: someone else stored them) or free (we write them), so a False from
        # put always means the page is there. Each attempt holds the client lock; the backoff does not, so other
        # threads' gets and puts on this client go on while this one waits.
        relost = 0
        for attempt in range(1 << 20):  # bounded by the deadline (IN_FLIGHT waits) and by relost < 2
            with c._lock:
                stored, lost, full, err, waiting = self._put_once(kb, views, sizes, pb, todo, deadline, dev)
            for i in stored:
                out[i] = True
            relost += bool(lost)
            if err is not None or full or (not lost and not waiting) or relost > 1:
                break
            if waiting:
                pause = IN_FLIGHT_WAIT_S[min(attempt, len(IN_FLIGHT_WAIT_S) - 1)]
                if time.monotonic() + pause >= deadline:
                    raise DeadlineExceeded(c.component, f"batch_put: {len(waiting)} keys still being "
                                                        f"written by another writer at the deadline")
                time.sleep(pause)  # not holding the client lock
            todo = lost + waiting
        if err is not None:
            raise err
        if full:
            raise PoolFull(c.component, f"pool full: {len(full)} of {len(kb)} pages found no space "
                                        f"(every evictable page is leased or pending); {sum(out)} stored")
        if lost:
            raise TransportError(c.component, f"batch_put: {len(lost)} pages lost their allocation before "
                                              f"commit twice and were not stored")
        return out

    @staticmethod
    def _chunks(idxs: list[int], sizes: list[int]) -> list[list[int]]:
        """Split a batch into chunks of about CHUNK_BYTES (CHUNK_MIN_PAGES..CHUNK_MAX_PAGES pages each)."""
        if len(idxs) <= CHUNK_MAX_PAGES and (len(idxs) <= CHUNK_MIN_PAGES or sum(sizes) < CHUNK_BYTES):
            return [idxs]  # what the loop below makes of it
        chunks, cur, nbytes = [], [], 0
        for i in idxs:
            cur.append(i)
            nbytes += sizes[i]
            if len(cur) >= CHUNK_MAX_PAGES or (nbytes >= CHUNK_BYTES and len(cur) >= CHUNK_MIN_PAGES):
                chunks.append(cur)
                cur, nbytes = [], 0
        if cur:
            chunks.append(cur)
        return chunks

    def _alloc_meta(self, kb: list[bytes], sizes: list[int], parents: list | None, idxs: list[int]) -> dict:
        c = self._client()
        meta: dict[str, Any] = {"ns": c.namespace, "keys": [kb[i] for i in idxs], "sizes": [sizes[i] for i in idxs],
                                "token": int.from_bytes(os.urandom(8), "little") >> 1 or 1}
        if parents is not None:
            meta["parents"] = [parents[i] for i in idxs]
        return meta

    def _put_once(self, kb: list[bytes], views: list, sizes: list[int], parents: list | None,
                  idxs: list[int], deadline: float, dev: DeviceBatch | None = None
                  ) -> tuple[list[int], list[int], list[int], Exception | None, list[int]]:
        """ALLOC, write, COMMIT the keys at ``idxs``. Returns (stored, lost, no_space, error, in_flight); keys that
        already existed are in none of the lists. Keys whose write failed are aborted and reported through
        ``error``. Each ALLOC carries a fresh token, so the metaclient's retry of it is answered with the same
        places.

        A batch of more than one chunk (``_chunks``) is pipelined on the metaserver connection: the ALLOCs of the
        next ALLOC_AHEAD chunks are in flight while chunk k is written, and the COMMITs of every chunk written so
        far; the call returns once every COMMIT is answered (durable in etcd). A single chunk is one ALLOC and one
        COMMIT call. An error unwinds: places allocated but not written are aborted, COMMITs in flight collected."""
        c = self._client()
        ns = c.namespace
        meta = c._meta
        chunks = self._chunks(idxs, sizes)
        acc = _PutResult()
        if len(chunks) == 1:
            reply = meta.call(wire.Op.ALLOC, self._alloc_meta(kb, sizes, parents, idxs), deadline)
            ok_idx, gens = self._write_answer(kb, views, sizes, idxs, reply, deadline, acc, dev)
            if ok_idx:
                committed = meta.call(wire.Op.COMMIT, {"ns": ns, "keys": [kb[i] for i in ok_idx],
                                                       "gens": [gens[i] for i in ok_idx]}, deadline)["ok"]
                acc.committed(ok_idx, committed)
        else:
            allocs: list = []
            commits: list[tuple[Any, list[int]]] = []
            try:
                for k, chunk in enumerate(chunks):
                    while len(allocs) < min(len(chunks), k + 1 + ALLOC_AHEAD):
                        allocs.append(meta.submit(wire.Op.ALLOC, self._alloc_meta(kb, sizes, parents,
                                                                                  chunks[len(allocs)]), deadline))
                    reply = meta.result(allocs[k], deadline)
                    ok_idx, gens = self._write_answer(kb, views, sizes, chunk, reply, deadline, acc, dev, True)
                    if ok_idx:
                        commits.append((meta.submit(wire.Op.COMMIT, {"ns": ns, "keys": [kb[i] for i in ok_idx],
                                                                     "gens": [gens[i] for i in ok_idx]}, deadline),
                                        ok_idx))
                for t, ok_idx in commits:
                    acc.committed(ok_idx, meta.result(t, deadline)["ok"])
                commits = []
            except BaseException:
                self._unwind(kb, allocs, commits, len(acc.chunks_done), deadline)
                raise
        c.count(puts=len(acc.stored), dedup=acc.dedup, bytes_put=sum(sizes) if len(acc.stored) == len(sizes) else
                sum(sizes[i] for i in acc.stored))
        if dev is not None:
            via = dev.via[acc.stored]
            c.count(kernel_put_bytes=int(dev.nbytes[acc.stored][via == DeviceBatch.VIA_KERNEL].sum()),
                    staged_put_bytes=int(dev.nbytes[acc.stored][via == DeviceBatch.VIA_STAGED].sum()))
        err = None
        if acc.first_err is not None:
            err = TransportError(c.component, f"batch_put: {len(acc.bad)} of {len(kb)} pages were not stored "
                                              f"(aborted): {acc.first_err}")
            err.__cause__ = acc.first_err
        return acc.stored, acc.lost, acc.full, err, acc.waiting

    def _write_answer(self, kb: list[bytes], views: list, sizes: list[int], idxs: list[int], reply: Any,
                      deadline: float, acc: "_PutResult", dev: DeviceBatch | None, pipelined: bool = False
                      ) -> tuple[list[int], dict[int, int]]:
        """Write one chunk given its ALLOC answer: as arrays (``umbp/putbatch.py``) where that path takes it, else
        page by page (``_write_chunk``). Same results, aborts and errors either way."""
        c = self._client()
        rows = putbatch.answer_rows(reply, len(idxs)) if dev is None and not c.config.checksum else None
        if rows is None or not putbatch.takes(views, idxs, sizes, rows):
            items = with_caps(reply["items"], reply.get("caps"), 6)
            return self._write_chunk(kb, views, idxs, items, deadline, acc, dev, pipelined,
                                     reply.get("write_until_ms") or 0)
        pos, gens = putbatch.plan(rows, idxs, acc)
        if not len(pos):
            return [], gens
        nodes, caps = reply.get("nodes") or [], reply.get("caps") or []
        until = reply.get("write_until_ms") or 0  # no byte of these places may land after it
        try:
            if pipelined and int(rows["len"][pos].sum()) < SHARE_BELOW_PAGE_BYTES * len(pos):
                with copies.sharing_cores(1):  # as _write_chunk: leave a core to the other chunks' requests
                    results, index = putbatch.write(c, views, idxs, rows, pos, nodes, caps, deadline, until)
            else:
                results, index = putbatch.write(c, views, idxs, rows, pos, nodes, caps, deadline, until)
        except Exception:
            acc.chunks_done[-1] = {}
            self._abort_written(kb, list(gens), gens, deadline)  # best effort: the write's error is the one raised
            raise
        return self._settle(kb, results, index, gens, acc, deadline)

    def _write_chunk(self, kb: list[bytes], views: list, idxs: list[int], items: list, deadline: float,
                     acc: "_PutResult", dev: DeviceBatch | None = None, pipelined: bool = False, until_ms: int = 0
                     ) -> tuple[list[int], dict[int, int]]:
        """Write one chunk's NEW places (every node's transfer in flight together; device pages on kernel nodes by
        the kernel, the other device pages staged first); abort the keys whose write failed. Returns (keys
        written, their generations). A transport (or stager) that raises aborts the whole chunk. ``pipelined``:
        other chunks' ALLOCs and COMMITs are in flight, so host copies leave a core to whoever serves them
        (``copies.sharing_cores``). ``until_ms``: the ALLOC answer's ``write_until_ms`` (0: none), on every WriteOp;
        the kernel is not started past it (its pages fail as late writes)."""
        c = self._client()
        batches: dict[str, list[WriteOp]] = {}
        index: dict[str, list[int]] = {}
        gens: dict[int, int] = {}
        checksum = c.config.checksum
        pack = objformat.pack_object_header
        kernel = c._kernel_nodes([(item[1],) for item in items if item[0] == NEW], deadline) if (
            dev is not None and any(views[i] is None for i in idxs)) else {}
        direct: list[tuple[int, memoryview, int, int, bytes]] = []  # device pages the kernel writes
        to_stage: list[tuple[int, Any]] = []  # device pages placed where the kernel cannot write

        def add(i: int, item: Any, parts: list[memoryview]) -> None:
            _, node_id, off, size, gen, tag, cap = item
            if (type(parts[0]) is Rows if len(parts) == 1 else any(type(p) is Rows for p in parts)) and (
                    checksum or not c._reads_rows(node_id, deadline)):
                parts = [v for p in parts for v in (p.views() if type(p) is Rows else (p,))]  # one view per row
            header = pack(tag, gen, size, objformat.payload_checksum(parts) if checksum else None)
            ops = batches.get(node_id)
            if ops is None:
                ops = batches[node_id] = []
                index[node_id] = []
            ops.append(WriteOp(off, header, parts, size, gen, cap, until_ms))
            index[node_id].append(i)

        for i, item in zip(idxs, items):
            state = item[0]
            if state != NEW:
                if state == EXISTS:
                    acc.dedup += 1
                elif state == NO_SPACE:
                    acc.full.append(i)
                elif state == IN_FLIGHT:
                    acc.waiting.append(i)
                continue
            gens[i] = item[4]
            if views[i] is not None:
                add(i, item, views[i])
            elif item[1] in kernel:
                arena, base = kernel[item[1]]
                direct.append((i, arena, base, item[2], pack(item[5], item[4], item[3], None)))
            else:
                to_stage.append((i, item))
        acc.chunks_done.append(gens)
        release = None
        try:
            if to_stage:
                staged, release = dev.stager([i for i, _ in to_stage])
                for (i, item), parts in zip(to_stage, staged):
                    add(i, item, parts)
                    dev.via[i] = DeviceBatch.VIA_STAGED
            if direct and until_ms and time.time() * 1000 > until_ms:  # the kernel copies a batch at once
                direct_res = [late_write(c.component, until_ms)] * len(direct)
            else:
                direct_res = c._device.write(dev, direct) if direct else []
            if not batches:
                results = {}
            elif pipelined and _metaserver_bound(batches):  # leave a core to the other chunks' ALLOCs and COMMITs
                with copies.sharing_cores(1):
                    results = c._run(batches, "write", deadline)
            else:
                results = c._run(batches, "write", deadline)
        except Exception:
            acc.chunks_done[-1] = {}
            self._abort_written(kb, list(gens), gens, deadline)  # best effort: the write's error is the one raised
            raise
        finally:
            if release is not None:
                release()
        if direct:
            index[""] = [d[0] for d in direct]  # node ids are never empty: the kernel's results as one more node
            results[""] = direct_res
        return self._settle(kb, results, index, gens, acc, deadline)

    def _settle(self, kb: list[bytes], results: dict[str, list], index: dict[str, list[int]], gens: dict[int, int],
                acc: "_PutResult", deadline: float) -> tuple[list[int], dict[int, int]]:
        """The keys written (in node order) and the first error; the keys whose write failed aborted."""
        ok_idx, bad_idx = [], []
        for node_id, res in results.items():
            if not any(res):
                ok_idx.extend(index[node_id])
                continue
            for i, r in zip(index[node_id], res):
                if r is None:
                    ok_idx.append(i)
                else:
                    bad_idx.append(i)
                    acc.first_err = acc.first_err or r
        if bad_idx:
            self._abort_written(kb, bad_idx, gens, deadline)
            acc.bad.extend(bad_idx)
        return ok_idx, gens

    def _abort_written(self, kb: list[bytes], idxs: list[int], gens: dict[int, int], deadline: float) -> None:
        """ABORT the places of ``idxs`` whose write failed (``written``: bytes may have landed there), best effort:
        it runs on the failed put's deadline, often past already, and a failed ABORT must not replace the write's
        error (review 4.6). An allocation not aborted expires at its pending TTL instead."""
        c = self._client()
        try:
            c._meta.call(wire.Op.ABORT, {"ns": c.namespace, "keys": [kb[i] for i in idxs],
                                         "gens": [gens[i] for i in idxs], "written": True}, deadline)
        except UmbpError:
            pass

    def _unwind(self, kb: list[bytes], allocs: list, commits: list, written: int, deadline: float) -> None:
        """A pipelined put is failing: give back the places of ALLOCs whose chunk was not written (so they do not
        wait out the pending TTL) and collect the COMMITs in flight; best effort, the original error is raised."""
        c = self._client()
        for t in allocs[written:]:
            try:
                items = c._meta.result(t, deadline)["items"]
                keys = [k for k, item in zip(t.meta["keys"], items) if item[0] == NEW]
                if keys:
                    c._meta.call(wire.Op.ABORT, {"ns": c.namespace, "keys": keys,
                                                 "gens": [item[4] for item in items if item[0] == NEW]}, deadline)
            except UmbpError:
                break
        try:
            for t, _ in commits:
                c._meta.result(t, deadline)
        except UmbpError:
            pass
        c._meta.forget([t for t in allocs] + [t for t, _ in commits])
