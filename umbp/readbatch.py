"""The array read path of ``Client.batch_get_into`` (issue 45): a batch carried as arrays from the packed LOOKUP
answer (``umbp/lookup.py``), not as a Python object a page.

Taken when the outs are one 2-D C-contiguous numpy array or CPU torch tensor (a row a page), or a list of contiguous
CPU torch tensors, numpy arrays or writable memoryviews (``out_addresses``: addresses by ``map``, no view a page;
memoryviews are what SGLang's HiCache backend passes), or a list of ``Rows`` of one shape (``rows_outs``: a
layer_first host pool's objects; shm copies them a row a piece, ``ShmTransport.read_rows``' ``geom``), and the LOOKUP
answer has rows. Other outs (bytearrays, mixed ``Rows``, CUDA tensors, empty views) and ranged reads keep the
per-page path of ``Client._get``.

Per batch: the read ahead of remembered rows (``Speculation.plan_rows``: one join, one compare to settle, as
``umbp/speculate.py`` argues), then the answer's rows: pages grouped by node (argsort, skipped for the usual single
node), bounds by min/max, and for shm nodes ``ShmTransport.read_rows``: the headers compared as one array before and
one after the copy, the copy one ``memmove`` a page by ``map`` (or copy threads for big batches). Results are one
``tolist()``.

Semantics stay those of the per-page path, page by page: a page the arrays do not settle (outside the arena, a header
that does not match or has a payload checksum) goes to the transport's ``start_read`` as today's ``ReadOp``, so its
CorruptionError or miss is exactly today's; a page whose header changed during the copy is a CorruptionError ("torn
read"); tcp and rdma nodes get ReadOps (the tcp transport receives them with one scatter receive a frame). Misses,
late reads past the lease, node failures, counters and the RELEASE are as in ``Client._get``.
"""

from __future__ import annotations

import sys
import time
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from transport import answerrows, objformat, wire
from transport.base import Pending, ReadOp
from umbp.buffers import Rows, views_at
from umbp.copies import address_of_view
from umbp.errors import (CorruptionError, DeadlineExceeded, InvalidArgument, NotFound, RemoteError, TransportError,
                         TransportUnavailable)
from umbp.lookup import rows_of
from umbp.speculate import read_deadline

DISK = "\0disk"  # a node id + this: the transport of its disk tier (READV_DISK over TCP; node ids hold no NUL)
DISK_KEYS = 1 << 40  # a node key + this: the node's disk tier, in ``read``'s grouping

_nbytes = attrgetter("nbytes")
_address, _shape = attrgetter("address"), attrgetter("row", "stride", "count")
_readonly, _contiguous = attrgetter("readonly"), attrgetter("c_contiguous")
_iface = attrgetter("__array_interface__")


def out_addresses(outs: Any, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(address, bytes it holds) of each of the ``n`` outs as int64 arrays, when the array path takes them; None
    otherwise (the per-page path checks and reports them). A single page (``get_into``) keeps the per-page path:
    the arrays' fixed cost buys nothing there."""
    if n < 2:
        return None
    t = type(outs)
    if t is np.ndarray:
        if outs.ndim < 2 or not outs.flags.c_contiguous or not outs.flags.writeable or outs.shape[0] != n:
            return None
        row = outs.strides[0]
        at, caps = _rows_at(n, row)
        return at + outs.ctypes.data, caps
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(outs, torch.Tensor):
        if (outs.dim() < 2 or outs.device.type != "cpu" or not outs.is_contiguous() or outs.requires_grad
                or outs.shape[0] != n):
            return None
        row = outs.stride(0) * outs.element_size()
        at, caps = _rows_at(n, row)
        return at + outs.data_ptr(), caps
    if (t is not list and t is not tuple) or len(outs) != n or not n:
        return None
    kinds = set(map(type, outs))
    if torch is not None and kinds == {torch.Tensor}:
        T = torch.Tensor
        if (not all(map(T.is_contiguous, outs)) or not all(map(attrgetter("is_cpu"), outs))
                or any(map(attrgetter("requires_grad"), outs))):
            return None
        return (np.fromiter(map(T.data_ptr, outs), np.int64, n), np.fromiter(map(_nbytes, outs), np.int64, n))
    if kinds == {np.ndarray}:
        faces = list(map(_iface, outs))
        if any(f["strides"] is not None or f["data"][1] for f in faces):  # strided, or read-only
            return None
        return (np.fromiter((f["data"][0] for f in faces), np.int64, n), np.fromiter(map(_nbytes, outs), np.int64, n))
    if kinds == {memoryview}:  # SGLang's HiCache backend: views of its host pool (umbp/integrations/sglang/hostmem.py)
        if any(map(_readonly, outs)) or not all(map(_contiguous, outs)):
            return None
        caps = np.fromiter(map(_nbytes, outs), np.int64, n)
        if not caps.all():  # an empty view has no address: the per-page path reads (and refuses) those
            return None
        return np.fromiter(map(address_of_view, outs), np.int64, n), caps
    return None


def rows_outs(outs: Any, n: int) -> tuple[np.ndarray, np.ndarray, list] | None:
    """``out_addresses`` for a list of ``umbp.buffers.Rows`` outs of one shape (a layer_first host pool's objects:
    ``count`` rows of ``row`` bytes every ``stride``): (each one's first row's address, the bytes it takes, the list);
    None for anything else. shm nodes copy each page as its rows (``ShmTransport.read_rows``' ``geom``), the others
    get ReadOps with the Rows themselves."""
    if n < 2 or type(outs) not in (list, tuple) or len(outs) != n or set(map(type, outs)) != {Rows}:
        return None
    first = outs[0]
    if set(map(_shape, outs)) != {_shape(first)}:
        return None
    addr = np.fromiter(map(_address, outs), np.int64, n)
    return addr, np.full(n, first.nbytes, np.int64), list(outs)


_ROWS_AT: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (n, row bytes) -> ``_rows_at``; a few shapes


def _rows_at(n: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(each row's byte offset, each row's bytes) of ``n`` rows ``row`` bytes apart, read-only and kept: a 2-D out of
    a shape seen before costs one add, not two arrays made."""
    got = _ROWS_AT.get((n, row))
    if got is None:
        if len(_ROWS_AT) >= 64:
            _ROWS_AT.clear()
        at, caps = np.arange(n, dtype=np.int64) * row, np.full(n, row, np.int64)
        at.flags.writeable = caps.flags.writeable = False
        got = _ROWS_AT[(n, row)] = (at, caps)
    return got


def _groups(node: np.ndarray, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The page indices ``idx`` grouped by ``node[idx]``: one group without a sort when they share one node."""
    nd = node[idx]
    if not len(idx) or (nd == nd[0]).all():
        return [(int(nd[0]), idx)] if len(idx) else []
    order = np.argsort(nd, kind="stable")
    nd, idx = nd[order], idx[order]
    cuts = np.flatnonzero(nd[1:] != nd[:-1]) + 1
    return [(int(g[0]), i) for g, i in zip(np.split(nd, cuts), np.split(idx, cuts))]


def read(client: Any, rows: np.ndarray, node: np.ndarray, name_of, caps_of, idx: np.ndarray, addr: np.ndarray,
         deadline: float, routs: list | None = None) -> tuple[list[tuple[int, Exception]], set[str]]:
    """Read pages ``idx`` of ``rows`` (whole payloads) into ``addr``: ``node[i]`` a node key, ``name_of(key)`` its
    node id, ``caps_of(ids)`` the read capability of each page of ``ids``. Transports other than shm are started first (tcp sends its
    requests), then the shm copies run, then the others are finished. Returns (failed pages with their error, in
    node order). A node whose transport failed (a TransportError for any of its pages) is counted and dropped, as
    ``Client._run`` does; returns its node id among the second item."""
    errs: list[tuple[int, Exception]] = []
    started: list[tuple[str, Any, Any, np.ndarray]] = []
    shm: list[tuple[str, Any, np.ndarray]] = []
    disk = (rows["off"] & np.uint64(objformat.DISK_BIT)) != 0  # pages on a node's disk tier: read over its own transport
    if disk.any():
        node = np.where(disk, node + DISK_KEYS, node)
    for key, ids in _groups(node, idx):
        node_id = name_of(key) if key < DISK_KEYS else name_of(key - DISK_KEYS) + DISK
        try:
            t = client._transport_for(node_id, deadline)
        except TransportUnavailable:
            raise
        except TransportError as e:
            started.append((node_id, None, e, ids))
            continue
        if t.name == "shm" and hasattr(t, "read_rows"):
            shm.append((node_id, t, ids))
        else:
            started.append((node_id, t, _start(t, rows, ids, addr, caps_of, deadline, routs), ids))
    for node_id, t, ids in shm:
        # ids: sorted page indices (flatnonzero, kept in order by _groups): all of them are the rows as they are
        r, at = (rows, addr) if len(ids) == len(rows) else (rows[ids], addr[ids])
        try:
            status = t.read_rows(r["off"], r["len"], r["tag"], r["gen"], at, deadline, r.tobytes(),
                                 None if routs is None else (routs[0].row, routs[0].stride))
        except DeadlineExceeded as e:
            errs.extend((i, e) for i in ids.tolist())
            continue
        if status.any():
            for i in ids[status == 2].tolist():
                errs.append((i, CorruptionError(t.component, "slot rewritten during the read (torn read)")))
            rest = ids[status == 1]
            if len(rest):
                started.append((node_id, t, _start(t, rows, rest, addr, caps_of, deadline, routs), rest))
    failed: set[str] = set()
    for node_id, t, p, ids in started:
        res = [p] * len(ids) if t is None else _finish(t, p, deadline)
        if any(res):  # all None: the usual case
            errs.extend((i, r) for i, r in zip(ids.tolist(), res) if r is not None)
            if any(isinstance(r, TransportError) for r in res) and node_id not in failed:
                failed.add(node_id)
                client.count(node_failures=1)
                client._drop_transport(node_id)
    return errs, failed


def _start(t: Any, rows: np.ndarray, ids: np.ndarray, addr: np.ndarray, caps_of, deadline: float,
           routs: list | None = None) -> Any:
    """Today's per-page ReadOps of pages ``ids`` started on transport ``t`` (a TransportError fails them all); outs
    the views at ``addr``, or the ``Rows`` outs ``routs``."""
    r = rows[ids]
    n = r["len"].tolist()
    counts = None
    if routs is None:
        ops = list(map(ReadOp, r["off"].tolist(), repeat(0), n, r["tag"].tolist(), r["gen"].tolist(), n,
                       views_at(addr[ids].tolist(), n), caps_of(ids)))
    elif t.reads_rows:
        ops = list(map(ReadOp, r["off"].tolist(), repeat(0), n, r["tag"].tolist(), r["gen"].tolist(), n,
                       list(map(routs.__getitem__, ids.tolist())), caps_of(ids)))
    else:  # a transport that reads no Rows: a ReadOp a row, as the per-page path makes them (umbp/pagereads.py)
        ops, counts = [], []
        for i, o, tg, g, ln, cap in zip(ids.tolist(), r["off"].tolist(), r["tag"].tolist(), r["gen"].tolist(), n,
                                        caps_of(ids)):
            got = row_ops(o, 0, routs[i], ln, tg, g, ln, cap)
            ops.extend(got)
            counts.append(len(got))
    try:
        p = t.start_read(ops, deadline)
    except TransportUnavailable:
        raise
    except TransportError as e:
        p = Pending(ops, "read")
        p.results = [e] * len(ops)
    return p if counts is None else _RowOps(p, counts)


def row_ops(off: int, start: int, out: Rows, length: int, tag: int, gen: int, plen: int, cap: bytes) -> list:
    """``length`` payload bytes from ``start`` of the object at ``off`` into the ``Rows`` out ``out`` as a ReadOp a
    row, for a transport that reads no ``Rows`` (tcp, rdma)."""
    row = out.row
    return [ReadOp(off, start + r * row, len(v), tag, gen, plen, v, cap) for r, v in enumerate(out.views(length))]


class _RowOps:
    """A started batch whose pages went out as a ReadOp a row (``_start``): ``counts[j]`` ops of page j."""

    __slots__ = ("pending", "counts")

    def __init__(self, pending: Any, counts: list[int]):
        self.pending, self.counts = pending, counts


def _finish(t: Any, p: Any, deadline: float) -> list:
    """``t.finish`` of a ``_start``ed batch: a result a page (a page of several ops: its first error, or None)."""
    if type(p) is not _RowOps:
        return t.finish(p, deadline)
    res, out, i = t.finish(p.pending, deadline), [], 0
    for k in p.counts:
        out.append(next((x for x in res[i:i + k] if x is not None), None))
        i += k
    return out


def get_into(client: Any, kb: list[bytes], addr: np.ndarray, cap: np.ndarray, routs: list | None = None
             ) -> list[int] | None:
    """``batch_get_into`` of the normalised keys ``kb`` into the outs at ``addr`` (``cap`` bytes each; ``routs``:
    those outs are these ``Rows``, ``rows_outs``); the bytes written per key or -1 for a miss."""
    c = client
    spec = c._spec
    cache = spec.cache
    with c._lock:
        deadline = c._deadline()
        sent = time.monotonic()
        # the LOOKUP goes out first: the remembered rows are looked up (and read) while it is in flight; a batch
        # with nothing remembered waits for it as ``call`` would (``result`` keeps ``call``'s contract)
        ticket = c._meta.submit(wire.Op.LOOKUP, {"ns": c.namespace, "keys": kb}, deadline)
        early = guess = None
        try:
            guess = spec.plan_rows(kb)
            if guess is not None:
                early = _read_ahead(c, guess, addr, cap, deadline, routs)
            reply = c._meta.result(ticket, deadline)
        except BaseException:
            c._meta.forget([ticket])
            raise
        lease = reply.get("lease", 0)
        try:
            rows, nodes, caps = rows_of(reply)
            same = cache.learn_rows(kb, rows, nodes, caps, None if guess is None else guess[0])
            plen = rows["len"].astype(np.int64)
            if same and early.all():
                # the answer's rows are the rows read ahead, byte for byte (every key hit; same node, offset, size,
                # generation), and every page of them was read: settle_rows' verdict (all served) without its compares
                spec.settle_all(len(early))
                hit, every, node, idx = early, True, guess[1], ()
            else:
                hit = rows["node"] != answerrows.NO_NODE
                every = bool(hit.all())
                numbers = np.array([cache.node_number(n) for n in nodes] or [0], np.int64)
                node = numbers[rows["node"]] if every else np.where(hit, numbers[np.where(hit, rows["node"], 0)], -1)
                todo = hit
                if early is not None:
                    todo = hit & ~spec.settle_rows(guess, early, rows, node)
                idx = np.flatnonzero(todo)  # empty when the read ahead served every page: no bound to check
            if len(idx):
                over = plen[idx] > cap[idx]
                if over.any():
                    i = int(idx[over.argmax()])  # the first such key, as a scan in key order finds it
                    raise InvalidArgument(c.component, f"out 0 of key {i} holds {int(cap[i])} bytes but "
                                                       f"{int(plen[i])} are to be read")
            errs, _failed = read(c, rows, node, cache.node_name,
                                (lambda ids: list(map(caps.__getitem__, rows["node"][ids].tolist()))) if caps else
                                (lambda ids: [b""] * len(ids)), idx, addr, deadline, routs) if len(idx) else ([], set())
            late = time.monotonic() > sent + reply.get("lease_ms", wire.DEFAULT_LEASE_MS) / 1000
        finally:
            if lease:
                c._meta.send_noreply(wire.Op.RELEASE, {"lease": lease}, deadline)
    got = plen if every else np.where(hit, plen, -1)  # plen: this call's own copy
    corrupt: Exception | None = None
    for i, r in errs:
        got[i] = -1
        if isinstance(r, (CorruptionError, DeadlineExceeded)) or (
                isinstance(r, RemoteError) and not isinstance(r, NotFound)):
            corrupt = corrupt or r  # raised: a timeout is not a miss, a refusal is not a miss
    if late:  # Client._late_reads_missed: tcp/rdma pages read past the lease are misses
        shm = [cache.node_number(n) for n, t in c._transports.items() if t.name == "shm"]
        gone = hit & (got >= 0) & ~np.isin(node, shm)
        got[gone] = -1
        c.count(late_reads=int(gone.sum()))
    if corrupt is not None:
        raise corrupt
    out = got.tolist()
    hits = len(out) - out.count(-1)
    c.count(gets=hits, misses=len(out) - hits, bytes_got=sum(out) + (len(out) - hits))
    return out


def late_reads_missed(client: Any, locs: list, got: list[int]) -> None:
    """``Client._late_reads_missed``: the batch's reads finished after its read lease ran out: pages read over tcp or
    rdma become misses. Past the lease an object may have been evicted, its extent given to another page and
    rewritten while the node was still sending it (tcp queues views of the arena; rdma reads them one-sided), and
    the header those transports checked before the payload proves nothing about the payload after it. shm checks
    the header again after its copy, so its pages stand. The outs of those pages hold whatever arrived: a miss,
    not data. (``get_into`` does the same over its arrays.)"""
    shm = {n for n, t in client._transports.items() if t.name == "shm"}
    n = 0
    for i, loc in enumerate(locs):
        if loc is not None and got[i] >= 0 and loc[0] not in shm:
            got[i] = -1
            n += 1
    client.count(late_reads=n)


def _read_ahead(c: Any, guess: tuple[np.ndarray, np.ndarray], addr: np.ndarray, cap: np.ndarray,
                deadline: float, routs: list | None = None) -> np.ndarray:
    """Read the remembered rows into the outs while the LOOKUP is in flight; True per page read without error.
    A node whose read failed at the transport is forgotten (``LocationCache.forget_node``)."""
    rows, node = guess
    ok = (node >= 0) & (rows["len"].astype(np.int64) <= cap)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return ok
    cache = c._spec.cache
    nbytes = int(rows["len"][idx].sum())
    try:
        errs, failed = read(c, rows, node, cache.node_name,
                            lambda ids: list(map(cache.place_cap, rows["node"][ids].tolist())), idx, addr,
                            read_deadline(deadline, time.monotonic(), nbytes), routs)
    except TransportError:
        return np.zeros(len(rows), bool)
    for i, _e in errs:
        ok[i] = False
    for node_id in failed:
        cache.forget_node(node_id)
    return ok
