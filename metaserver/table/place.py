"""ALLOC on the page table (``metaserver.table.columns.PageTable.alloc``, whose docstring states the rules): which keys
are new, where each new page goes, what is evicted for it, and the rows filed. No I/O.

The answer is columns: each key's ``AllocState`` (int8; ``entry.OVER_QUOTA`` too) and its row (int64, -1 unless
NEW), so the service packs it without a Python object per key (``TableDirectory.alloc_granted``); ``items_of``
gives the list of tuples that list callers read.

Two paths, one outcome. Where a page goes near its parent is decided for the whole request first (``homes``), and
both paths place by it. The array path (``_bulk``) takes a request whose keys are each new or READY, none given
twice, every size fitting every placeable node's arena: the READY keys are stamped (a use) and pinned while the
request places (so no placement evicts a key this request answers EXISTS); the new keys go to their homes, the
others in turn over the placeable nodes as the per-key path would send them (the ``j``-th of them to
``placing[(rr + j) % nodes]``);
each (node, layout) group then asks its node's allocator for runs of same-size extents (``Allocator.alloc_runs``),
takes victims that hand over their extent and row in one pass over the eviction queue (``evict.handover``:
exact size, old generation; plain LRU without reservations) and, for what is left, victims one at a time
(``evict.make_room``: another size, a young generation, prefix-lru's order, a quota group's reservation); rows come in
bulk (``take_rows``) and each column is written with one assignment. Anything else (a key given twice, a PENDING
key, a size some node cannot hold) takes the per-key path (``_each``), in key order as before.

Costs (2-core VM, 300k pages on 32 nodes, a full pool: every new key evicts): the array path is numpy work per
request and per (node, layout) group plus O(1) Python per allocator run; the per-key path O(keys) Python.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from metaserver.table.entry import (EXISTS, EXISTS_ITEM, GONE, IN_FLIGHT, IN_FLIGHT_ITEM, NEW, NO_SPACE, NO_SPACE_ITEM,
                              OVER_QUOTA, OVER_QUOTA_ITEM, PENDING, READY, extent_size)
from metaserver.table.evict import handover, make_room
from metaserver.table.nodes import FREE, UNIT_SHIFT
from transport.keyform import PackedKeys, digests, joined_keys
# operands as 0-d arrays: a Python int operand costs a small request's ufunc twice its work (NumPy 2's promotion)
_NO_ROW0, _READY0, _PENDING0 = np.array(0, np.int64), np.array(READY, np.uint8), np.array(PENDING, np.uint8)
_UNIT_SHIFT0 = np.array(UNIT_SHIFT, np.uint64)
ARRAYS = True  # False: every request takes the per-key path (tests compare the two paths' outcomes)
_ITEM = {EXISTS: EXISTS_ITEM, IN_FLIGHT: IN_FLIGHT_ITEM, NO_SPACE: NO_SPACE_ITEM, OVER_QUOTA: OVER_QUOTA_ITEM}


def take_rows(t, node, m: int) -> np.ndarray:
    """``m`` free rows of ``node`` (int64) in the order ``m`` calls of ``PageTable._take_row`` pop them (blocks added
    as it adds them; the columns may grow: read ``t.cols`` again after)."""
    free = node.free
    while len(free) < m:
        t._add_block(node)
    out = free[len(free) - m:]
    del free[len(free) - m:]
    out.reverse()
    return np.array(out, np.int64)


def items_of(t, state: np.ndarray, rows: np.ndarray) -> list:
    """The list form of ``alloc_rows``' answer: ``(NEW, node_id, offset, payload_len, gen)`` for a NEW key (from its
    row's columns), the state's fixed item otherwise."""
    new = (state == NEW).nonzero()[0]
    if not len(new):
        return [_ITEM[s] for s in state.tolist()]
    r = rows.take(new)
    c = t.cols
    got = list(zip(repeat(NEW), t.node_names.take(c["node"].take(r)).tolist(), t.offsets_of(r),
                   t.code_arr.take(c["size"].take(r)).tolist(), c["gen"].take(r).tolist()))
    if len(got) == len(state):  # every key NEW (a full pool's puts): the items as they are
        return got
    items = list(map(_ITEM.get, state.tolist()))
    for i, it in zip(new.tolist(), got):
        items[i] = it
    return items


def alloc_rows(t, ns: str, keys: list, sizes: list, gen_base: int, tags, now: float, token, owner, parents, at,
               whole: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``PageTable.alloc`` as columns: (each key's state, int8; each key's row, int64, -1 unless NEW). ``whole``:
    on the array path only (every key READY, or ``_bulk``), else None with nothing done."""
    n = len(keys)
    if whole and (t.dying or t.quota is not None or len(set(keys)) != n):  # (no key twice: checked once, here)
        return None
    nsix = t._ns(ns)
    c = t.cols
    dig, longs = digests(keys)
    # (one namespace interned: every filed row is of it, and the key index need not read the rows' namespaces)
    found = t.ix.find(nsix, dig, c["ns"] if len(t.ns_names) > 1 else None) if n else np.zeros(0, np.int64)
    absent = found < _NO_ROW0
    found_st = c["state"].take(found)  # (-1 reads the last row: set FREE next)
    found_st[absent] = FREE
    state = np.empty(n, np.int8)
    state.fill(EXISTS)
    none = np.empty(n, np.int64)
    none.fill(-1)
    if n and not t.dying and np.count_nonzero(found_st == _READY0) == n:
        # every key READY (an engine re-offering pages it holds, a TP rank after the first of a replicated page):
        # all EXISTS, each a use, stamped in key order; a repeated key stamps at its first occurrence as the per-key
        # path would: its second is EXISTS without a use
        _, first = np.unique(found, return_index=True)
        t._stamp(found.take(np.sort(first)))
        if t.links.linking:
            t.links.requeue(np.unique(found))
        return state, none
    if t.quota is not None and not t.quota.fit(nsix, keys, sizes, found):
        state[:] = OVER_QUOTA  # past its group's quota even after its own evictions: nothing done
        return state, none
    evicted = t._evicted_now
    evicted.clear()
    if t.dying and n:  # a page of a node being dropped is gone for writers too: drop it now, place anew
        gone = found[found >= 0]
        gone = np.unique(gone[t.dead.take(c["node"].take(gone))])  # a key given twice: its row once
        for r in gone.tolist():
            evicted[r] = nsix  # unfiled with the request's victims
            node = t.nodes[c["node"][r]]
            if c["pins"][r]:
                c["state"][r] = GONE
            else:
                t._free_row(r, node)
        if len(gone):
            hit = np.isin(found, gone)
            found = np.where(hit, -1, found)
            found_st = np.where(hit, FREE, found_st)
    hit = found >= _NO_ROW0
    nh = np.count_nonzero(hit)
    simple = ARRAYS and not np.count_nonzero(found_st == _PENDING0) and (whole or len(set(keys)) == n) \
        and (not nh or nh == n or int(np.argmin(hit)) > int(hit.nonzero()[0][-1]))
    if simple and t.placing and n:
        top = extent_size(sizes[0] if _one_size(sizes) else max(sizes))
        simple = t.placing_min >= top
    if whole and not simple:
        return None
    home = homes(t, nsix, keys, sizes, parents, found, found_st) if parents is not None else None
    if simple:
        rows, new, used = _bulk(t, sizes, found, state, home)
    else:
        rows, new, used = _each(t, keys, sizes, found, found_st.tolist(), state, none, token, owner, home)
    _file(t, nsix, dig, longs, tags, now, token, owner, parents, at, gen_base, rows, new, state, none)
    if len(used) and t.links.linking:
        t.links.requeue(np.unique(used))
    return state, none


def alloc_rows_many(t, ns: str, asks: list, gen_base: int, now: float) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """``alloc_rows`` of several ALLOCs of namespace ``ns`` at once (``asks``: (keys, sizes, parents, token, owner)
    each, a turn's: ``metaserver/handlers/turns.py``), in order, their generations ``gen_base`` on: (state, rows)
    each, as ``alloc_rows`` answers it. One digest, index, placement and filing pass over all their keys, so each
    ALLOC's fixed cost is paid once: their keys are placed as one ALLOC of them all would place them (in turn over
    the nodes, near their parents: ``homes``), and each PENDING row is its own ALLOC's (token and owner).

    Only on the array path for them all together, else None with nothing done: every key READY, or new keys after
    READY ones; no PENDING key, none given twice over them all, no quota groups, no node being dropped. Each key is
    then answered as if its ALLOC came alone after the others: no key of one is another's, so none is IN_FLIGHT
    for a sibling, and each READY key is stamped (a use) before any page is placed, as alone."""
    keys = joined_keys([a[0] for a in asks])
    sizes = [s for a in asks for s in a[1]]
    parents = None
    if any(a[2] is not None for a in asks):
        parents = [p for a in asks for p in (a[2] if a[2] is not None else repeat(None, len(a[0])))]
    got = alloc_rows(t, ns, keys, sizes, gen_base, None, now, None, None, parents, None, True)
    if got is None:
        return None
    state, rows = got
    out, lo, pending = [], 0, t._pending
    for keys_, _, _, token, owner in asks:
        hi = lo + len(keys_)
        st, r = state[lo:hi], rows[lo:hi]
        pending.update(dict.fromkeys(r[r >= _NO_ROW0].tolist(), (token, owner)))
        out.append((st, r))
        lo = hi
    return out


def _file(t, nsix, dig, longs, tags, now, token, owner, parents, at, gen_base, rows, new, state, none) -> None:
    """The request's victims unfiled, then its placements' columns written (one assignment each) and filed."""
    evicted, bulk = t._evicted_now, t._evicted_rows
    if evicted or bulk:
        er = [np.fromiter(evicted.keys(), np.int64, len(evicted))] + bulk
        er = er[0] if len(er) == 1 else np.concatenate(er)
        t.commits.leaving(er)
        # (a victim's row keeps its namespace until now; a table of one namespace: every row's is 0)
        t.ix.delete(er, t.cols["ns"].take(er).astype(np.uint64) if len(t.ns_names) > 1 else 0)
        evicted.clear()
        bulk.clear()
    if not len(rows):
        return
    c = t.cols
    ra = rows
    newa = np.asarray(new, np.int64)
    none[newa] = ra
    state[newa] = NEW
    c["gen"][ra] = (newa if at is None else np.asarray(at, np.int64).take(newa)).astype(np.uint64) + np.uint64(gen_base)
    c["pins"][ra] = 0
    c["ns"][ra] = nsix
    c["tag"][ra] = np.asarray(tags, np.uint64).take(newa) if tags is not None else 0
    c["rec"][ra] = 0  # a commit files it under a record (``table/commits.py``)
    c["stamp"][ra] = int((now + t.pending_ttl_s) * 1000)
    rl = ra.tolist()
    t._pending.update(dict.fromkeys(rl, (token, owner)))
    if parents is not None or t.links.pending:
        t.links.placed(rl, newa.tolist(), parents)
    if longs and len(newa) != len(state):  # not every key new: the new ones' long keys, by position among them
        inv = np.full(len(state), -1, np.int64)
        inv[newa] = np.arange(len(newa))
        pos, ks = zip(*longs)
        longs = [(j, k) for j, k in zip(inv.take(pos).tolist(), ks) if j >= 0]
    t.ix.insert(ra, dig[newa], c["ns"], longs, rl)


def _one_size(sizes) -> bool:
    """Whether a non-empty list of sizes holds one value (a namespace's pages share one: the usual), by a C-level
    count (0.1-1 us at 128 sizes, where a dict of them or their max cost 1.6-2.3)."""
    return type(sizes) is list and sizes.count(sizes[0]) == len(sizes)


def _codes(t, sizes: list) -> tuple[list[int], list[int], list[int | None]]:
    """(the distinct sizes, their extent sizes, their code indexes: None when the table has no room for another
    code) of ``sizes``, interned as the per-key path interns them."""
    osize = t._osize
    out_s, out_e, out_c = [], [], []
    for plen in (sizes[0],) if _one_size(sizes) else dict.fromkeys(sizes):
        got = osize.get(plen)
        if got is None:
            cix = t._code(plen)
            if cix is not None:
                got = osize[plen] = (extent_size(plen), cix)
        out_s.append(plen)
        out_e.append(got[0] if got is not None else 0)
        out_c.append(got[1] if got is not None else None)
    return out_s, out_e, out_c


def homes(t, nsix: int, keys, sizes: list, parents: list, found: np.ndarray, found_st: np.ndarray
          ) -> np.ndarray | None:
    """Where each new page goes near its parent: the index in ``t.placing`` of its node, -1 for in turn (a page
    without a known parent, or one that no node has room for); None when no page can go near a parent. Both paths place
    by it, decided for the request at once from the nodes' free bytes when it came:

    - a key's home is the node of its parent when that is READY or PENDING on a placeable node (a key of this
      request too), or the home of its parent when the parent is an earlier new key of this request (a chain
      followed to its first page); a chain's first page whose parent is named nowhere (or none) is homed in turn,
      and a page that is no chain's first and names no known parent has none;
    - a node takes the pages homed on it, in key order, while it has room for each besides those before it and
      keeps at least half the free bytes of the emptiest placeable node;
    - the pages their homes refuse go, in key order, to the node with the most room left after this request's
      pages, as many as fit there, then the next such node; what none has room for goes in turn (a full node
      makes room on itself).

    A chain of one request so stays on one node and spills to the emptiest, not piling every chain of a shared
    prefix onto one node. Costs: a dict of the request's keys, a map over the parents, a few dozen numpy calls and
    a table look-up of the parents that are not keys of the request (usually one, a chain's first)."""
    nodes = t.placing
    n = len(parents)
    if not nodes or parents.count(None) == n:
        return None
    kl = keys.tolist() if type(keys) is PackedKeys else keys
    first = dict(zip(reversed(kl), range(n - 1, -1, -1)))  # a key's first position
    ppos = np.array(list(map(first.get, parents, repeat(-1))), np.int64)  # the parent's position, -1: not a key here
    idx = np.arange(n)
    c = t.cols
    live = (found_st == _READY0) | (found_st == _PENDING0)
    pix = np.full(len(t.nodes), -1, np.int64)  # node index -> its place in ``nodes`` (-1: not placeable)
    pix[[nd.ix for nd in nodes]] = np.arange(len(nodes))
    at = np.where(live, pix.take(c["node"].take(np.where(live, found, 0))), -1)  # a live key's node, in ``nodes``
    inb = ppos >= 0
    pp = np.where(inb, ppos, 0)
    base = np.where(inb, at.take(pp), -1)  # the node of a parent that is a live key of this request
    outside = [i for i in (~inb).nonzero()[0].tolist() if parents[i] is not None]
    if outside:  # parents that are no key of this request: found in the table
        named = [parents[i] for i in outside]
        near = t._parents_near(nsix, named)
        if near:
            base[outside] = [pix[near[p].ix] if p in near else -1 for p in named]
    chain = inb & ~live.take(pp) & (ppos < idx)  # a new parent placed earlier in this request: its home
    link = np.where(chain, ppos, idx)
    if chain.any():  # pointer jumping to each chain's first page: a round doubles the distance, and none is n
        for _ in range((n - 1).bit_length()):
            link = link.take(link)
    placed = ~live  # not a use, not a repeat
    if len(first) < n:
        placed &= np.fromiter(map(first.__getitem__, kl), np.int64, n) == idx
    roots = np.zeros(n, bool)
    roots[link[chain]] = True
    roots = (roots & (base < 0) & placed).nonzero()[0]
    if len(roots):  # a chain's first page with no known parent goes in turn, and its chain with it
        base[roots] = np.arange(t._rr, t._rr + len(roots)) % len(nodes)
        t._rr += len(roots)
    home = base.take(link)
    home[~placed] = -1
    sel = (home >= 0).nonzero()[0]
    if not len(sel):
        return home
    ext = np.array([extent_size(x) for x in sizes], np.int64) if not _one_size(sizes) else \
        np.full(n, extent_size(sizes[0]), np.int64)
    free = np.array([nd.alloc.free_bytes for nd in nodes], np.int64)
    left, e = _left(home, sel, ext, free)
    ok = (left >= e) & (2 * left >= int(free.max()))
    taken = np.zeros(len(nodes), np.int64)  # the bytes this request sends to each node so far
    np.add.at(taken, home.take(sel[ok]), e[ok])
    rest = sel[~ok]  # refused by their homes, in key order: to the node with the most room left, while they fit
    home[rest] = -1
    for _ in range(len(nodes)):
        if not len(rest):
            break
        room = free - taken
        most = int(room.argmax())
        er = ext.take(rest)
        k = int(np.count_nonzero(np.cumsum(er) <= room[most]))  # a prefix of them: a chain goes on together
        if not k:
            break  # no node has room for the next: in turn (a full node makes room on itself)
        home[rest[:k]] = most
        taken[most] += int(er[:k].sum())
        rest = rest[k:]
    return home


def _left(home: np.ndarray, sel: np.ndarray, ext: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the keys ``sel`` (key order), each homed on ``home[sel]``: the free bytes its node has left before it
    (``free`` less the extents ``ext`` of the keys before it on that node) and its own extent."""
    e = ext.take(sel)
    h = home.take(sel)
    if h.min() == h.max():  # one node (a chain): no grouping
        return free.take(h) - (np.cumsum(e) - e), e
    order = np.argsort(h, kind="stable")
    hs, es = h.take(order), e.take(order)
    cum = np.cumsum(es) - es  # bytes before each key, over all nodes in order
    first = np.empty(len(hs), bool)  # a node's first key
    first[0] = True
    np.not_equal(hs[1:], hs[:-1], out=first[1:])
    left = np.empty(len(sel), np.int64)
    left[order] = free.take(hs) - (cum - np.maximum.accumulate(np.where(first, cum, 0)))  # (cum never falls)
    return left, e


def _bulk(t, sizes, found, state, home) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The array path (module docstring): the new keys placed per (node, layout) group. Returns (rows, positions)
    of the NEW keys in key order and the READY rows used; ``state`` says NO_SPACE for the keys that found none
    (EXISTS stays for the READY ones). ``home``: ``homes``' answer, or None."""
    hit = found >= _NO_ROW0
    used = found[hit]
    newpos = (~hit).nonzero()[0]
    if len(used):
        t._stamp(used)  # a use, in key order (all before the new keys): newer than every queued victim
    nodes = t.placing
    z = np.zeros(0, np.int64)
    m = len(newpos)
    state[newpos] = NO_SPACE  # until placed
    if not m or not nodes:
        return z, z, used
    new_sizes = sizes if m == len(sizes) else [sizes[i] for i in newpos.tolist()]
    us, ext, cix = _codes(t, new_sizes)
    u = len(us)
    if home is None:
        group = np.arange(t._rr, t._rr + m)  # in turn: the j-th new key to placing[(rr + j) % nodes]
        group %= len(nodes)
        t._rr += m
    else:  # near its parent where it has a home, the others in turn
        group = home.take(newpos)
        turn = (group < _NO_ROW0).nonzero()[0]
        group[turn] = np.arange(t._rr, t._rr + len(turn)) % len(nodes)
        t._rr += len(turn)
    if u > 1:
        q_of = {s: q for q, s in enumerate(us)}
        group = group * u + np.array([q_of[s] for s in new_sizes], np.int64)
    # (the same stable order from 16-bit groups, which numpy sorts by radix: 1,024 keys 3 vs 10 us)
    order = (group.astype(np.uint16) if len(nodes) * u <= 1 << 16 else group).argsort(kind="stable")
    per = np.bincount(group)
    gs = per.nonzero()[0]
    counts = per.take(gs)
    groups = list(zip(gs.tolist(), repeat(0))) if u == 1 else [divmod(g, u) for g in gs.tolist()]
    # what each group gets, in order: free extents (runs), victims handing over, victims one at a time
    sup_rows: list[np.ndarray] = []
    sup_offs: list[np.ndarray] = []
    sup_grp: list[np.ndarray] = []
    need = counts.tolist()
    for x, (p, q) in enumerate(groups):
        node, size = nodes[p], ext[q]
        if cix[q] is None:  # no layout code left for this length: NO_SPACE
            need[x] = 0
        elif node.alloc.free_bytes >= size:
            runs = node.alloc.alloc_runs(size, need[x])
            k = sum(r[1] for r in runs)
            if k:
                step = np.uint64(size)
                sup_offs.append(np.concatenate([np.uint64(o) + np.arange(n, dtype=np.uint64) * step for o, n in runs]))
                sup_rows.append(take_rows(t, node, k))
                sup_grp.append(np.full(k, x, np.int64))
                need[x] -= k
    if not t.links.linking and not (t.quota is not None and t.quota.reserving) and not t.quarantine.leasing():
        todo = [x for x in range(len(groups)) if need[x]]
        if u == 1:  # one layout: a group a node
            hand = todo
        else:
            first: dict[int, int] = {}  # a node's first group needing victims (another layout on it: one at a time)
            for x in todo:
                first.setdefault(groups[x][0], x)
            hand = list(first.values())
        if hand:
            ks = [need[x] for x in hand]
            vr, vo, vj = handover(t, [nodes[groups[x][0]] for x in hand],
                                     [ext[groups[x][1]] for x in hand] if u > 1 else [ext[0]] * len(hand), ks)
            if len(vr):
                sup_rows.append(vr)
                sup_offs.append(vo)
                sup_grp.append(np.array(hand, np.int64).take(vj))
            for x, k in zip(hand, ks):
                need[x] = k
    for x, (p, q) in enumerate(groups):
        if need[x]:  # another size, a young generation, prefix-lru's order, a reservation: one victim at a time
            r1, o1 = _one_by_one(t, nodes[p], ext[q], need[x])
            if len(r1):
                sup_rows.append(r1)
                sup_offs.append(o1)
                sup_grp.append(np.full(len(r1), x, np.int64))
    if not sup_rows:
        return z, z, used
    grp = sup_grp[0] if len(sup_rows) == 1 else None
    if grp is not None and (len(grp) < 2 or bool((grp[1:] >= grp[:-1]).all())):  # in group order already (a full
        rows, offs = sup_rows[0], sup_offs[0]  # pool's one round of victims that hand over)
    else:
        grp = np.concatenate(sup_grp)
        by = np.argsort(grp, kind="stable")
        rows, offs, grp = np.concatenate(sup_rows).take(by), np.concatenate(sup_offs).take(by), grp.take(by)
    every = len(rows) == m  # every key placed: the supplies line up with the keys sorted by group
    gk = None  # (every: a group's rows are its count of supplies, none is given more than it needs)
    if not every:  # the k-th key of a group (key order) takes the group's k-th supply, when it has one
        have = np.bincount(grp, minlength=len(groups))
        gk = np.repeat(np.arange(len(groups)), counts)
        rank = np.arange(m) - (np.cumsum(counts) - counts).take(gk)
        ok = rank < have.take(gk)
        pick = (np.cumsum(have) - have).take(gk[ok]) + rank[ok]
        rows, offs, gk = rows.take(pick), offs.take(pick), gk[ok]
    c = t.cols
    c["state"][rows] = PENDING
    node_ix = np.array([nodes[p].ix for p, _ in groups], np.uint16)
    c["node"][rows] = node_ix.repeat(counts) if gk is None else node_ix.take(gk)
    c["unit"][rows] = offs >> _UNIT_SHIFT0
    if u > 1:
        code_ix = np.array([cix[q] or 0 for _, q in groups], np.uint16)
        c["size"][rows] = code_ix.repeat(counts) if gk is None else code_ix.take(gk)
    else:
        c["size"][rows] = cix[0]
    # key order: records and links read the rows as the keys came
    if every:
        out = np.empty(m, np.int64)
        out[order] = rows
        return out, newpos, used
    pos = newpos.take(order[ok])
    by = np.argsort(pos, kind="stable")
    return rows.take(by), pos.take(by), used


def _one_by_one(t, node, size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``k`` places of ``size`` bytes on ``node`` a victim at a time (``make_room``; free space it leaves
    taken first), each row PENDING at once as the per-key path takes it: (rows, offsets as uint64)."""
    rows: list[int] = []
    offs: list[int] = []
    alloc = node.alloc
    for _ in range(k):
        off = alloc.alloc(size) if alloc.free_bytes >= size else None
        r = -1
        if off is None:
            off, r = make_room(t, node, size)
            if off is None:
                break
        if r < 0:
            r = t._take_row(node)
        t.cols["state"][r] = PENDING
        rows.append(r)
        offs.append(off)
    return np.array(rows, np.int64), np.array(offs, np.uint64)


def _each(t, keys, sizes, found, found_state, state, none, token, owner, home
          ) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The per-key path (module docstring): keys in order, placement and eviction a key at a time. Returns (rows,
    positions) of the NEW keys placed here and the READY rows used; a retried allocation's own row is answered in
    ``none`` directly. ``home``: ``homes``' answer, or None."""
    c = t.cols
    found = found.tolist()
    evicted = t._evicted_now
    nodes = t.placing
    osize = t._osize
    new: list[int] = []  # positions in ``keys`` of the new places
    rows: list[int] = []
    offs: list[int] = []
    codes: list[int] = []
    node_ix: list[int] = []
    seen: set = set()
    used: list[int] = []  # READY rows of keys answered EXISTS (a use)
    pending = t._pending
    writer = (token, owner)
    st: list[int] = [EXISTS] * len(keys)
    homes_of = home.tolist() if home is not None else repeat(-1)
    for i, (k, plen, hi) in enumerate(zip(keys, sizes, homes_of)):
        if k in seen:
            continue  # EXISTS
        seen.add(k)
        r = found[i]
        if r >= 0 and r not in evicted:
            if found_state[i] == READY:
                c["stamp"][r] = t.clock  # a use: newer than every queued victim's stamp
                t.clock += 1
                used.append(r)
            elif token is not None and pending[r][0] == token and t.codes[c["size"][r]] == plen:
                pending[r] = writer
                st[i] = NEW
                none[i] = r
            else:
                st[i] = IN_FLIGHT
            continue
        if not nodes:
            st[i] = NO_SPACE
            continue
        got = osize.get(plen)
        if got is None:
            cix = t._code(plen)
            if cix is None:  # MAX_CODES distinct lengths already: this one has no column value
                st[i] = NO_SPACE
                continue
            got = osize[plen] = (extent_size(plen), cix)  # a shared entry's layout: its n sub-slots
        size, cix = got
        if hi >= 0:
            node = nodes[hi]
        else:
            node = nodes[t._rr % len(nodes)]
            t._rr += 1
            if node.alloc.capacity < size:  # never fits there, whatever it evicts: in turn over those it fits
                fit = [n for n in nodes if n.alloc.capacity >= size]
                if not fit:
                    st[i] = NO_SPACE
                    continue
                node = fit[t._rr % len(fit)]
        r = -1
        off = node.alloc.alloc(size) if node.alloc.free_bytes >= size else None
        if off is None:
            off, r = make_room(t, node, size)
            if off is None:
                st[i] = NO_SPACE
                continue
        if r < 0:
            r = t._take_row(node)
        c = t.cols  # a new block may have grown (replaced) the columns
        c["state"][r] = PENDING  # taken now: a later victim scan of this request must not see it FREE
        new.append(i)
        rows.append(r)
        offs.append(off)
        codes.append(cix)
        node_ix.append(node.ix)
    state[:] = st
    ra = np.array(rows, np.int64)
    if rows:
        c = t.cols
        c["node"][ra] = node_ix
        c["unit"][ra] = np.array(offs, np.uint64) >> np.uint64(UNIT_SHIFT)
        c["size"][ra] = codes
    return ra, new, np.array(used, np.int64)
