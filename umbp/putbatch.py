"""The array write path of ``batch_put`` (issue 45): one chunk's ALLOC answer carried as arrays, not a Python object
a page.

Taken for a chunk (``umbp/puts.py``'s ``_write_answer``) when its ALLOC answer has packed rows
(``answerrows.unpack_allocs`` keeps them as ``alloc_rows``, ``answerrows.ALLOC_ROW``), the batch has no device pages, payload
checksums are off, and every page of the chunk is one flat host view of the length the answer allocated. Anything
else (``umbp.buffers.Rows`` parts, several parts a page, an answer without rows: VERSION 11, or a multi-slot one with
such a part) keeps the per-page path of ``Puts._write_chunk``. A partitioned pool's answer, merged as rows
(``umbp.lookup.merge_allocs``), names a node once a slot, each with its slot's capability: its pages are one group,
each ``WriteOp`` with its own page's capability.

Per chunk: the states sorted into the put's lists with a few masks, the NEW pages grouped by node (one group without a
sort for the usual single node; several by one stable argsort, in the order their first page comes, as the per-page
path meets them), their object headers packed as one (n, 64) array (``objformat.pack_object_headers``). A shm node is
written by ``transport.base.write_rows_to_arena``: old headers invalidated with one fancy assignment, one
``memmove`` a page (``map``; copy threads for big batches), the headers last with one fancy assignment; a tcp or
rdma node gets ``WriteOp``s built by one ``map``, written through ``Client._run`` as the per-page path's are (tcp
sends the WRITEV frames with ``sendmsg`` over all views).

Semantics are the per-page path's, page by page: a page outside the arena (or not 4 KiB aligned) goes to the shm
transport's ``start_write`` and gets its CorruptionError there; a transport that fails fails its node's pages (node
failure counted, transport dropped, as ``Client._run``); results come back by node in the order the per-page path
builds them, so the same first error is reported, the same keys aborted and committed.

Costs (2-core VM, 64 pages): a fixed ~40 numpy calls a chunk plus three C-level ``map``s over its pages.
"""

from __future__ import annotations

import weakref
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from transport import objformat, wire
from transport.base import WriteOp, write_rows_to_arena
from umbp import copies
from umbp.errors import TransportError, TransportUnavailable

NEW, EXISTS, NO_SPACE, IN_FLIGHT = (wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NO_SPACE,
                                    wire.AllocState.IN_FLIGHT)
_first = itemgetter(0)
_format, _ndim, _contiguous = attrgetter("format"), attrgetter("ndim"), attrgetter("c_contiguous")
# shm transport -> (the mapping's address, its size, a writable (slots, 64) view every 4 KiB made from that address:
# made from the address, not the arena's buffer, so the transport's close can release its memoryview)
_ROWS: "weakref.WeakKeyDictionary[Any, tuple[int, int, np.ndarray]]" = weakref.WeakKeyDictionary()


def host_views(values: Any) -> list | None:
    """``batch_put``'s values as the put path's views (``[flat byte view]`` a page) when they are all numpy arrays of
    bytes (1-D, C-contiguous; or one 2-D array, a row a page) or all bytes/bytearrays: views made by ``map``, no
    per-value checks. None for anything else (``as_bytes_view`` a value checks and casts it)."""
    if type(values) is np.ndarray:
        if values.ndim != 2 or values.dtype != np.uint8 or not values.flags.c_contiguous:
            return None
        values = list(values)
    kinds = set(map(type, values))
    if kinds == {np.ndarray}:
        mvs = list(map(memoryview, values))
        if set(map(_format, mvs)) != {"B"} or set(map(_ndim, mvs)) != {1} or not all(map(_contiguous, mvs)):
            return None
    elif kinds and kinds <= {bytes, bytearray}:
        mvs = list(map(memoryview, values))
    else:
        return None
    return [[v] for v in mvs]


def sizes_of(views: list) -> list[int] | None:
    """Each page's bytes when every page is one view (None otherwise)."""
    if None in views or set(map(len, views)) != {1}:
        return None
    return list(map(len, map(_first, views)))


def answer_rows(reply: Any, n: int) -> np.ndarray | None:
    """The ALLOC answer's packed rows when they describe this chunk's ``n`` keys; None otherwise (an answer of
    VERSION 11, a multi-slot one merged as items because a part had no rows)."""
    rows = reply.get("alloc_rows") if isinstance(reply, dict) else None  # (an AllocAnswer: a dict subclass)
    return rows if rows is not None and len(rows) == n else None


def takes(views: list, idxs: list[int], sizes: list[int], rows: np.ndarray) -> bool:
    """Whether the array path takes this chunk: each page one flat memoryview, the NEW ones of the allocated
    length (a page the answer sizes otherwise keeps the per-page path and its error)."""
    parts = views if len(idxs) == len(views) else [views[i] for i in idxs]
    if set(map(len, parts)) != {1} or set(map(type, map(_first, parts))) != {memoryview}:
        return False
    want = np.array(sizes if parts is views else [sizes[i] for i in idxs], np.uint64)
    if parts is views and idxs != list(range(len(idxs))):
        want = want[np.asarray(idxs, np.int64)]
    lens = rows["len"]
    return bool((lens == want).all() or ((lens == want) | (rows["state"] != NEW)).all())


def _groups(node: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Positions 0..n-1 grouped by ``node``, each group's positions in order, groups in the order of their first
    position (the per-page path's dict order)."""
    n = len(node)
    if not n:
        return []
    if (node == node[0]).all():
        return [(int(node[0]), np.arange(n))]
    order = np.argsort(node, kind="stable")
    nd = node[order]
    cuts = np.flatnonzero(nd[1:] != nd[:-1]) + 1
    groups = [(int(g[0]), i) for g, i in zip(np.split(nd, cuts), np.split(order, cuts))]
    groups.sort(key=lambda g: int(g[1][0]))
    return groups


def arena_rows(t: Any) -> np.ndarray:
    """The writable 4 KiB-stride header rows of an open shm transport's arena, kept per transport."""
    base = copies.address(t.arena)
    got = _ROWS.get(t)
    if got is not None and got[0] == base and got[1] == t.size:
        return got[2]
    face = {"data": (base, False), "shape": ((t.size - objformat.OBJ_HEADER_SIZE) // objformat.ALIGN + 1,
                                             objformat.OBJ_HEADER_SIZE),
            "strides": (objformat.ALIGN, 1), "typestr": "|u1", "version": 3}
    view = np.asarray(type("ArenaRows", (), {"__array_interface__": face})())
    _ROWS[t] = (base, t.size, view)
    return view


def plan(rows: np.ndarray, idxs: list[int], acc: Any) -> tuple[np.ndarray, dict[int, int]]:
    """Sort the chunk's states into ``acc`` (dedup, full, waiting, in key order) and record its NEW pages'
    generations (``acc.chunks_done``). Returns (positions of the NEW pages in the chunk, page -> generation)."""
    state = rows["state"]
    new = state == NEW
    if new.all():
        pos = np.arange(len(idxs))
        page = idxs
    else:
        ids = np.asarray(idxs, np.int64)
        other, s = ids[~new], state[~new]
        acc.dedup += int((s == EXISTS).sum())
        acc.full.extend(other[s == NO_SPACE].tolist())
        acc.waiting.extend(other[s == IN_FLIGHT].tolist())
        pos = np.flatnonzero(new)
        page = ids[pos].tolist()
    gens = dict(zip(page, rows["gen"][pos].tolist()))
    acc.chunks_done.append(gens)
    return pos, gens


def write(client: Any, views: list, idxs: list[int], rows: np.ndarray, pos: np.ndarray, nodes: list, caps: list,
          deadline: float, until_ms: int = 0) -> tuple[dict[str, list], dict[str, list[int]]]:
    """Write the NEW pages at ``pos`` of the chunk (``idxs[p]`` the page, ``rows[p]`` its place). Returns (results
    by node id, each node's pages), node ids in the per-page path's order; a result None or that page's error.
    ``until_ms``: the ALLOC answer's ``write_until_ms`` (0: none), on every WriteOp; shm copies nothing past it.
    The shm nodes' copies run first, then the other nodes' WriteOps go through ``Client._run`` as the per-page
    path's do. TransportUnavailable is raised (as ``Client._run`` does); other errors come back as results."""
    r = rows[pos]
    heads = objformat.pack_object_headers(r["tag"], r["gen"], r["len"])
    hb = heads.tobytes()
    ids = np.asarray(idxs, np.int64)[pos]
    index: dict[str, list[int]] = {}
    out: dict[str, list] = {}
    batches: dict[str, list[WriteOp]] = {}
    node = r["node"]
    names, key = nodes, node
    if len(set(nodes)) != len(nodes):  # a node under several indices (a partitioned pool's merged answer,
        names = list(dict.fromkeys(nodes))  # ``lookup.merge_allocs``: each slot's own capability): one group a node
        at = {n: i for i, n in enumerate(names)}
        key = np.array([at[n] for n in nodes], np.int64).take(node)
    for k, g in _groups(key):
        node_id = names[k]
        page = index[node_id] = ids[g].tolist()
        if not caps:
            cap: bytes | list = b""
        elif names is nodes:
            cap = caps[k]
        else:
            cap = [caps[j] for j in node[g].tolist()]  # each page its own slot's capability
        try:
            t = client._transport_for(node_id, deadline)
        except TransportUnavailable:
            raise
        except TransportError as e:
            out[node_id] = [e] * len(page)
        else:
            if t.name == "shm" and getattr(t, "arena", None) is not None:
                out[node_id] = _shm(t, views, page, r, g, heads, hb, deadline, until_ms)
            else:
                batches[node_id] = _ops(views, page, r, g, hb, cap, until_ms)
                continue
        res = out[node_id]
        if any(res) and any(isinstance(x, TransportError) for x in res):  # as Client._run
            client.count(node_failures=1)
            client._drop_transport(node_id)
    if batches:
        out.update(client._run(batches, "write", deadline))
    return {n: out[n] for n in index}, index


def _ops(views: list, page: list[int], r: np.ndarray, g: np.ndarray, hb: bytes, cap: bytes | list,
         until_ms: int = 0) -> list[WriteOp]:
    """Today's WriteOps of a node's pages (``g`` their positions among the NEW pages), built by one ``map``;
    ``cap``: the node's capability, or one a page."""
    hs = objformat.OBJ_HEADER_SIZE
    return list(map(WriteOp, r["off"][g].tolist(), [hb[k * hs:(k + 1) * hs] for k in g.tolist()],
                    [views[i] for i in page], r["len"][g].tolist(), r["gen"][g].tolist(),
                    cap if type(cap) is list else repeat(cap), repeat(until_ms)))


def _shm(t: Any, views: list, page: list[int], r: np.ndarray, g: np.ndarray, heads: np.ndarray, hb: bytes,
         deadline: float, until_ms: int = 0) -> list:
    """A shm node's pages by ``write_rows_to_arena``; the pages it leaves (outside the arena, unaligned, past
    ``until_ms``) by the transport's ``start_write``, with its own errors. A TransportError (the copy threads'
    deadline) fails them all."""
    src = [views[i][0] for i in page]
    try:
        status = write_rows_to_arena(arena_rows(t), t.arena, r["off"][g], r["len"][g], heads[g], src, deadline,
                                     until_ms / 1000, r["gen"][g])
        if not status.any():
            return [None] * len(page)
        res: list = [None] * len(page)
        left = np.flatnonzero(status).tolist()
        ops = _ops(views, [page[j] for j in left], r, g[left], hb, b"", until_ms)
        for j, x in zip(left, t.finish(t.start_write(ops, deadline), deadline)):
            res[j] = x
        return res
    except TransportUnavailable:
        raise
    except TransportError as e:
        return [e] * len(page)
