"""The full load of the page table (``metaserver/table/columns.py``): a node's READY pages filed from its etcd records in
commit order, and ``fingerprint``, the table's canonical summary (tests compare a warm copy's table with a full
load's by it). The metaserver's full load (``TableDirectory.load``) and a returning node's parked pages
(``TableDirectory.unpark``) file through it. No I/O.

``load_pages`` takes an empty node (no page, nothing held in the quarantine: the load rebuilds its allocator). A
page is rejected up front when its offset is not a multiple of 4 KiB (the ``unit`` column holds offset >> 12; an
arena's data start is 4 KiB aligned), its layout code is negative (``PageRecords`` never passes one) or its code
finds no room in the table's ``MAX_CODES`` (the ``size`` column indexes ``codes``; a rejected page's code may stay
interned). Then, in this order:

1. a page whose key is already in the table (PENDING, or READY on any node, a detached node's included until its
   drop reaches it) takes no extent and is rejected;
2. the other pages' extents go to the node's allocator in offset order (equal offsets in commit order), and one
   that starts before the end of the last one taken, or lies outside the arena, is rejected
   (``Allocator.rebuild_columns``'s rule: of two overlapping pages the lower offset stays, whatever their commit
   order);
3. of a key given twice among the pages left, the first in commit order is filed; a later one is rejected and its
   extent freed again.

The pages filed get fresh clock stamps in commit order (oldest first), or the stamps given (a takeover passes the
records' revisions, so recency across nodes is commit order too), so the node's LRU order is its commit order.
Parents (``parents``) are linked only under ``prefix-lru`` (``metaserver/table/links.py``); loaded rows are filed
under the commit records they came from only when their names are given (``records``; else ``rec`` 0, and evicting
one rewrites nothing); tags are 0 as for an ALLOC given none (records do not carry them: a closed pool's service
computes a loaded row's tag at its first LOOKUP); quota use counts them as they are filed
(``metaserver/table/quotas.py``). The rejected pages come back as their positions (sorted): the caller deletes their
own records, and a commit record is rewritten without its rejected pages.

Costs (n pages): O(n log n) numpy work at C speed: key digests, one lookup of the keys already filed (per
namespace), one sort by offset, one sort of a 64-bit hash of the keys to find those given twice, the key index
insert (``table/index.py``, its resize included). Python steps: per distinct layout code and namespace, per free
extent left between the extents (the allocator files each: none in a pool filled in order), per key that is not
32 bytes (its blake2b digest and its bytes kept), and, only where something is wrong, per page: a rejected extent
makes the allocator rebuild walk every page; a hash collision (a key given twice, or the rare or crafted
collision) walks the colliding pages. Measured on the 2-core VM: 10 M pages of 32-byte keys over 32 nodes, offsets
shuffled, room reserved first (``reserve``; without it every node's load copies every column): 6.5 CPU-seconds,
0.65 us a page; a key that is not 32 bytes costs about 1.5 us more. ``load_nodes`` (the full load's many nodes)
files every node's keys with one key index insert, whose one sort (``indexbulk.bulk_order``: the keys by first
bucket, for the duplicates check) also files them (``indexbulk.insert_staged``: a bucket's run with one scatter).
``fingerprint`` is for tests: O(rows) Python.
"""

from __future__ import annotations

import os

import numpy as np

from metaserver.table.columns import BLOCK, PageTable
from metaserver.table.entry import PENDING, READY, extent_size
from metaserver.table import indexbulk
from metaserver.table.indexbulk import NO_ROW
from metaserver.table.longkeys import LongCol
from transport.keyform import digests
from metaserver.table.nodes import UNIT_SHIFT, NodeRows
from umbp.errors import ConfigError

UNIT = 1 << UNIT_SHIFT
_MULT = np.frombuffer(os.urandom(40), np.uint64) | np.uint64(1)  # odd multipliers, random per process: hash below


def _hash(nsix: np.ndarray, dig: np.ndarray) -> np.ndarray:
    """A 64-bit hash (uint64) of each (namespace, digest): equal keys hash equal; two different keys rarely do, and
    a client that picks raw keys cannot aim them at one value without the per-process multipliers."""
    m = _MULT
    return ((dig[:, 0] * m[0]) ^ (dig[:, 1] * m[1]) ^ (dig[:, 2] * m[2]) ^ (dig[:, 3] * m[3])
            ^ (nsix.astype(np.uint64) * m[4]))


def fill_ready(c: dict, at, node_ix: int, unit, code, gen, nsix) -> None:
    """Columns ``c`` of new READY rows ``at`` (an index or a slice): unpinned, no tag, no record yet."""
    c["node"][at] = node_ix
    c["unit"][at] = unit
    c["size"][at] = code
    c["gen"][at] = gen
    c["pins"][at] = 0
    c["state"][at] = READY
    c["ns"][at] = nsix
    c["tag"][at] = 0
    c["rec"][at] = 0


def _take_rows(t: PageTable, node: NodeRows, m: int) -> np.ndarray:
    """``m`` rows of ``node`` (int64), as ``m`` calls of ``PageTable._take_row`` take them: its free rows first (from
    the end of its free list), then whole blocks (a retired node's first, then new ones: the columns grown once),
    lowest row first; the rows of the last block left over go on its free list."""
    free = node.free
    k = min(m, len(free))
    parts = []
    if k:
        parts.append(np.array(free[len(free) - k:][::-1], np.int64))
        del free[len(free) - k:]
    need = m - k
    if need:
        nb = -(-need // BLOCK)
        blocks = []
        while len(blocks) < nb and t.free_blocks:
            blocks.append(t.free_blocks.pop())
        new = nb - len(blocks)
        if new:
            blocks.extend(range(t.blocks_used, t.blocks_used + new))
            t.blocks_used += new
            t._grow(t.blocks_used * BLOCK)
        node.blocks.extend(blocks)
        fresh = (np.array(blocks, np.int64)[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        parts.append(fresh[:need])
        free.extend(fresh[need:][::-1].tolist())
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _namespaces(t: PageTable, ns: list[str] | str, n: int) -> tuple[np.ndarray, list[int]]:
    """(each page's namespace index (uint16), the distinct indexes): the names interned as ``alloc`` interns them.
    ``ns``: one name, a name a page, or (names, an index in them a page: ``snapshot.NodePages``)."""
    if isinstance(ns, tuple):
        names, ix = ns
        tab = np.array([t._ns(name) for name in names], np.uint16)
        if len(ix) != n:
            raise ConfigError("columns", f"load: {len(ix)} namespaces for {n} keys")
        used = np.flatnonzero(np.bincount(ix, minlength=len(tab))) if len(tab) > 1 else np.arange(min(n, 1))
        return tab.take(ix), sorted(set(tab.take(used).tolist()))  # (a count, where np.unique sorted: 20 ms at 2 M)
    if isinstance(ns, str):
        ix = t._ns(ns)
        return np.full(n, ix, np.uint16), [ix]
    if len(ns) != n:
        raise ConfigError("columns", f"load: {len(ns)} namespaces for {n} keys")
    ixs = {name: t._ns(name) for name in dict.fromkeys(ns)}  # distinct names at C speed, then one step each
    if len(ixs) == 1:
        return np.full(n, next(iter(ixs.values())), np.uint16), list(ixs.values())
    return np.fromiter(map(ixs.__getitem__, ns), np.uint16, n), sorted(set(ixs.values()))


def _few(code: np.ndarray, most: int = 8) -> dict | None:
    """Each distinct value of ``code`` -> the mask of where it is, when there are at most ``most`` (None: more)."""
    masks = {}
    left = None
    while len(masks) < most:
        v = int(code[0] if left is None else code[left[0]])
        m = code == v
        masks[v] = m
        left = np.flatnonzero(~m) if left is None else left[code.take(left) != v]
        if not len(left):
            return masks
    return None


def reserve(t: PageTable, pages: int, nodes: int) -> None:
    """Make room for a load of ``pages`` rows over ``nodes`` nodes at once (the full load knows its record count):
    the columns grown once, where a load node by node would grow them (a copy of every column) at each node that
    does not fit, and an empty key index started at the size the load needs instead of resizing, and draining each
    resize, as it fills. Optional: ``load_pages`` grows what it needs without it. O(rows) (the copy)."""
    t._grow((t.blocks_used + -(-pages // BLOCK) + nodes) * BLOCK)
    t.ix.reserve(pages)


def load_pages(t: PageTable, node_id: str, ns: list[str] | str, keys: list[bytes], offsets, payload_lens,
               gens, records: list | None = None, stamps=None, parents: list | None = None,
               staged: list | None = None, distinct: bool = False) -> list[int]:
    """File one node's READY pages (``keys[i]`` of namespace ``ns[i]``, or all of ``ns`` when it is a string, at
    ``offsets[i]`` with layout code ``payload_lens[i]`` and generation ``gens[i]``), given in commit order, oldest
    first; the node's LRU order becomes that order. Returns the positions rejected, ascending (module docstring:
    the rules). ``offsets``, ``payload_lens`` and ``gens`` are sequences of ints or numpy arrays. Raises
    ConfigError when the node was not added (``add_node``) or holds anything, or when the columns' lengths
    differ; nothing has changed then. ``records[i]``: the etcd key of page i's commit record (None: none); the rows
    filed go under records of those names (``CommitRecords.adopt``), and a record with a page rejected here is
    rewritten without it. ``stamps``: each page's recency (non-decreasing in the given order; a full load passes the
    records' revisions, so that recency across nodes is commit order too); by default fresh clock values in the given
    order (recency across nodes then follows the order of the loads). Column forms (a full load's
    ``snapshot.NodePages``): ``keys`` as (digests, longs) (``longkeys.digests``), ``ns`` as (names, index a page),
    ``records`` an object array. ``staged`` (``load_nodes``): the key index's part of the filing is appended to it
    (the positions filed, None: all, and ``KeyIndex.stage``'s rows and long keys) for one insert of every node's; ``distinct``: the caller found no two of these pages
    with one ``_hash`` (rule 3 has nothing to do)."""
    node = t.node_by_id.get(node_id)
    if node is None:
        raise ConfigError("columns", f"load of node {node_id!r}: no such node (add_node first)")
    if node.alloc.used:
        raise ConfigError("columns", f"load of node {node_id!r}: it holds {node.alloc.used} bytes already; a load "
                                     "rebuilds its allocator")
    n = len(keys[0]) if isinstance(keys, tuple) else len(keys)
    off = np.asarray(offsets, np.int64)
    code = np.asarray(payload_lens, np.int64)
    gen = np.asarray(gens, np.uint64)
    if not len(off) == len(code) == len(gen) == n:
        raise ConfigError("columns", f"load of node {node_id!r}: {n} keys, {len(off)} offsets, {len(code)} "
                                     f"payload lengths, {len(gen)} generations")
    if stamps is not None:
        st = np.asarray(stamps, np.int64)
        if len(st) != n or (n and (st[0] < 0 or (st[1:] < st[:-1]).any())):
            raise ConfigError("columns", f"load of node {node_id!r}: stamps must be {n} non-decreasing naturals")
    nsix, ns_seen = _namespaces(t, ns, n)
    if not n:
        return []
    # layout codes: the table's index and the extent size of each distinct one (pages of a namespace share one)
    masks = _few(code)
    if masks is None:
        uniq, inv = np.unique(code, return_inverse=True)
    else:
        uniq = np.array(sorted(masks), np.int64)
    cix = np.full(len(uniq), -1, np.int64)
    ext = np.zeros(len(uniq), np.int64)
    for j, lc in enumerate(uniq.tolist()):
        if lc >= 0:
            ix = t._code(lc)
            cix[j] = -1 if ix is None else ix
            ext[j] = extent_size(lc)
    if masks is None:
        size = ext[inv]
        ccode = cix[inv]
    else:  # (a few codes, the usual: a mask each, where np.unique's argsort cost 2 us a page at 31k pages)
        size = np.empty(n, np.int64)
        ccode = np.empty(n, np.int64)
        for j, lc in enumerate(uniq.tolist()):
            size[masks[lc]] = ext[j]
            ccode[masks[lc]] = cix[j]
    ok = (ccode >= 0) & (size > 0) & ((off & (UNIT - 1)) == 0)
    dig, longs = keys if isinstance(keys, tuple) else digests(keys)
    c = t.cols
    # rule 1: keys the table holds already
    if t.ix.live:
        for k in ns_seen:
            at = np.flatnonzero(ok if len(ns_seen) == 1 else ok & (nsix == k))
            if len(at):
                ok[at[t.ix.find(k, dig if len(at) == n else dig[at], c["ns"]) >= 0]] = False
    # rule 2: extents in offset order. When none is rejected (checked here at C speed), each run of adjacent
    # extents goes to the allocator as one (an untracked allocator keeps only the free extents between them);
    # otherwise every extent, for the allocator's own rule.
    # (at, by_off None: every page, in its order; the usual, where the index copies were 5 passes a page)
    at = None if ok.all() else np.flatnonzero(ok)
    o = off if at is None else off[at]
    if (o[1:] >= o[:-1]).all():  # (sorted already: a pool filled once)
        by_off = at
        s = size if at is None else size[at]
    else:
        by_off = np.argsort(o) if at is None else at[np.argsort(o)]
        o, s = off[by_off], size[by_off]
    e = o + s
    alloc = node.alloc
    if (alloc._allocated is None and len(o) and o[0] >= alloc.base and e[-1] <= alloc.base + alloc.capacity
            and (e[:-1] <= o[1:]).all()):  # (so no two offsets are equal: the sort's order of ties did not matter)
        gap = np.flatnonzero(e[:-1] < o[1:])
        first = np.concatenate(([0], gap + 1))
        last = np.concatenate((gap, [len(o) - 1]))
        rej = alloc.rebuild_columns(o[first].tolist(), (e[last] - o[first]).tolist())
        assert not rej, f"columns: load of node {node_id!r}: the allocator refused checked extents {rej[:4]}"
    else:  # equal offsets in commit order, as the allocator takes them
        by_off = np.argsort(off, kind="stable") if at is None else at[np.argsort(off[at], kind="stable")]
        o, s = off[by_off], size[by_off]
        rej = alloc.rebuild_columns(o.tolist(), s.tolist())
        ok[by_off[rej]] = False
    # rule 3: a key given twice among those left: the first in commit order stays
    if not distinct:
        at = np.flatnonzero(ok)
        h = _hash(nsix if len(at) == n else nsix[at], dig if len(at) == n else dig[at])
        hs = np.sort(h)
        same = hs[1:] == hs[:-1]
    if not distinct and same.any():
        seen: set = set()
        for i in at[np.isin(h, hs[1:][same])].tolist():
            k = (int(nsix[i]), dig[i].tobytes())
            if k in seen:
                ok[i] = False
                alloc.free(int(off[i]), int(size[i]))
            else:
                seen.add(k)
    # file the rows: every column, stamps in commit order, then the keys
    every = bool(ok.all())
    keep = None if every else np.flatnonzero(ok)
    rows = _take_rows(t, node, n if every else len(keep))
    m = len(rows)
    c = t.cols  # a new block may have grown (replaced) the columns
    at = rows
    if m and rows[-1] - rows[0] == m - 1 and (rows[1:] > rows[:-1]).all():  # a fresh node's: one range
        at = slice(int(rows[0]), int(rows[0]) + m)  # (a slice writes a column at memcpy speed, an index does not)
    fill_ready(c, at, node.ix, (off if every else off[keep]) >> UNIT_SHIFT, ccode if every else ccode[keep],
               gen if every else gen[keep], nsix if every else nsix[keep])
    if stamps is None:
        c["stamp"][at] = np.arange(t.clock, t.clock + m, dtype=np.uint64)  # ``_stamp``: commit order is LRU order
        t.clock += m
    elif m:
        st = np.asarray(stamps, np.uint64)
        st = st if every else st[keep]
        c["stamp"][at] = st
        t.clock = max(t.clock, int(st.max()) + 1)
    if longs and not every and isinstance(longs, LongCol):
        longs = longs.keep(ok)
    elif longs and not every:  # their positions in ``keep``
        pos = np.fromiter((i for i, _ in longs), np.int64, len(longs))
        kept = ok[pos]
        longs = list(zip((np.cumsum(ok)[pos[kept]] - 1).tolist(),
                         (k for (_, k), y in zip(longs, kept.tolist()) if y)))
    if staged is not None:
        staged.append((None if every else keep, indexbulk.stage(
            t.ix, rows, dig if every else dig.take(keep, axis=0), longs, at if type(at) is slice else None)))
    else:
        t.ix.insert(rows, dig if every else dig[keep], c["ns"], longs)
    if t.links.linking or t.kv_sink is not None:  # ``parents[i]``: page i's parent key (metaserver/table/links.py)
        t.links.loaded(nsix if every else nsix[keep], rows,
                       None if parents is None else parents if every else [parents[i] for i in keep.tolist()])
    rejected = np.flatnonzero(~ok).tolist()
    if records is not None:
        kept = records if every else records[keep] if isinstance(records, np.ndarray) else [
            records[i] for i in keep.tolist()]
        t.commits.adopt(kept, rows, [records[i] for i in rejected])
    return rejected


def load_nodes(t: PageTable, loads: list[tuple[str, object]], file) -> list:
    """``load_pages`` of many nodes, one node after another (``loads``: (node id, its pages, a ``snapshot.NodePages``);
    ``file(node_id, pages, staged, distinct)`` calls ``load_pages`` and returns what it wants kept), the same
    result as one call a node in that order, with the key index filled by one insert (``indexbulk.insert_staged``)
    instead of one a node. That is exact only when no node's page can meet another node's key (rule 1 between
    nodes), so the keys are checked first: the key index's hash of every page and one sort of them all
    (``indexbulk.bulk_order``: the same sort files them by bucket; it also lets rule 3 skip the nodes without an
    equal pair). When two nodes share a hash (a key on two nodes: never in a pool that placed its pages itself),
    or when loaded rows are linked or reported as filed (``links.loaded`` finds parents in the index), every node
    is filed on its own, as before. Returns the ``file`` results, in order."""
    if t.links.linking or t.kv_sink is not None or len(loads) < 2:
        return [file(node_id, p, None, False) for node_id, p in loads]
    ix = t.ix
    sizes = [len(p) for _, p in loads]
    bases = np.cumsum([0] + sizes)
    h = np.empty(int(bases[-1]), np.uint64)  # (each node's hashes written in: no part of them all kept to join)
    for i, (node_id, p) in enumerate(loads):  # (names interned in the order ``_namespaces`` interns them)
        rev = p.rev
        if len(rev) > 1 and (rev[1:] < rev[:-1]).any():  # in commit order first, as ``file`` would put them (the
            p = p.take(np.argsort(rev, kind="stable"))  # positions below are those it files)
            loads[i] = (node_id, p)
        tab = np.array([t._ns(name) for name in p.ns_names], np.uint16)
        h[bases[i]:bases[i + 1]] = ix._hash(tab.take(p.nsix), p.dig)
    order = indexbulk.bulk_order(ix, h, t.cols["ns"])
    at = indexbulk.same_high(order)
    twins = set()  # the loads with two pages of one hash: rule 3's walk for them
    if len(at):  # (a few: keys sharing the sort's 32 bits; equal keys among them)
        pos = (order.take(np.union1d(at, at + 1)) & np.uint64(0xFFFFFFFF)).astype(np.int64)
        hp = h.take(pos)
        srt = np.sort(hp)
        dup = srt[1:][srt[1:] == srt[:-1]]
        if len(dup):
            mine = np.isin(hp, dup)
            node = np.searchsorted(bases, pos[mine], side="right") - 1
            pairs = set(zip(hp[mine].tolist(), node.tolist()))
            if len({v for v, _ in pairs}) < len(pairs):  # a hash on two nodes: each node's rule 1 must see those
                return [file(node_id, p, None, False) for node_id, p in loads]
            twins = {i for _, i in pairs}
    staged: list = []
    out = []
    rows_at = np.full(len(h), NO_ROW, np.uint32)  # each page's row (NO_ROW: not filed; u32, as the index's slots)
    for i in range(len(loads)):
        (node_id, p), loads[i] = loads[i], None  # (each node's columns freed once filed, as a load a node frees them)
        part: list = []
        out.append(file(node_id, p, part, i not in twins))
        del p
        if part:
            keep, got = part[0]
            lo = int(bases[i])
            if keep is None:
                rows_at[lo:lo + len(got[0])] = got[0]
            else:
                rows_at[lo + keep] = got[0]
            staged.append(got)
    indexbulk.insert_staged(ix, staged, t.cols["ns"], order, h, rows_at)
    return out


def fingerprint(t: PageTable) -> dict:
    """A canonical summary of a table, equal for two tables that hold the same things (tests; O(rows) Python):
    every live (PENDING or READY) row as (namespace, key, node, offset, layout code, generation, state), sorted;
    each live node's (capacity, bytes used, live rows); each live node's eviction order, the (namespace, key) of its
    READY unpinned rows oldest first (rows of one stamp by (namespace, key)); and the counts of PENDING rows, pinned
    rows (live or GONE) and READY rows.
    What it leaves out: row numbers, stamps' values (only their order), leases' ids, the allocators' free-list
    order (a load cannot restore it: it decides which hole the next ALLOC takes)."""
    c = t.cols
    top = t.blocks_used * BLOCK
    state = c["state"][:top]
    live = np.flatnonzero((state == PENDING) | (state == READY))
    names = t.ns_names
    entries = sorted(zip([names[i] for i in c["ns"].take(live).tolist()], [t.key_of(r) for r in live.tolist()],
                         t.node_names.take(c["node"].take(live)).tolist(),
                         t.offsets_of(live),
                         t.code_arr.take(c["size"].take(live)).tolist(), c["gen"].take(live).tolist(),
                         state.take(live).tolist()))
    nodes = {}
    order = {}
    for node_id, node in t.node_by_id.items():
        rows = t._rows_of(node)
        st = c["state"].take(rows)
        live_rows = int(np.count_nonzero((st == PENDING) | (st == READY)))
        nodes[node_id] = (node.alloc.capacity, node.alloc.used, live_rows)
        lru = rows[(st == READY) & (c["pins"].take(rows) == 0)]
        # rows of one stamp (a load stamps one etcd transaction's pages with its revision) by name: their order
        # among themselves is not defined
        order[node_id] = [(ns, k) for _, ns, k in sorted(zip(c["stamp"].take(lru).tolist(),
                                                            [names[i] for i in c["ns"].take(lru).tolist()],
                                                            [t.key_of(r) for r in lru.tolist()]))]
    return {"entries": entries, "nodes": nodes, "order": order, "pending": len(t._pending),
            "pinned": int(np.count_nonzero(c["pins"][:top])), "objects": t.objects}
