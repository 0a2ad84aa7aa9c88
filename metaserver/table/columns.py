"""The page table: the page directory's state in arrays, one row per page. The metaserver serves from it
(``metaserver/table/directory.py`` gives it the service's calls); ``bench/columns.py`` measures it and
``tests/unit/test_columns.py`` checks it.

Why columns: a page as a Python object (15 slots, 152 bytes with its header, plus its key, offset and generation
objects and a dict slot: the directory this table replaced) costs 355 bytes at 10 M pages and attribute work per
key on every request. Here a page is a row: ``ROW_BYTES`` of fixed-width columns plus its slot in the key index
(``metaserver/table/index.py``, probed a batch at a time), with no Python object per page; every batch operation (find
the keys, pin, unpin, touch, commit, gather the answer) is numpy work over the batch's rows, ALLOC's placement and
eviction included for plain requests (``metaserver/table/place.py``: runs of extents per node, victims for all nodes
in one pass). What stays per key in Python: ALLOC's per-key path (parents, a key twice, a PENDING key), the
pending set at COMMIT, and REMOVE.

Columns (``ROW_BYTES`` = 43 a row): ``node`` (u16, the node's index), ``unit`` (u32: the offset in 4 KiB units, so
16 TiB per arena), ``size`` (u16: the index of its layout code, the payload length or a shared entry's
``entry.layout``, in ``codes``; pages of a namespace share one), ``gen`` (u64), ``pins`` (u32), ``stamp`` (u64: the
access clock), ``state`` (u8: ``entry.PENDING``, ``READY``, ``GONE`` or ``FREE``), ``ns`` (u16, the namespace's
index), ``tag`` (u64: the object tag ALLOC handed out, kept so a LOOKUP need not compute it again), ``rec`` (u32:
its commit record, ``metaserver/table/commits.py``). The key index holds each live row's key digest and finds rows
by (namespace, key).

Rows come in blocks of ``BLOCK`` per node, so one node's rows are its blocks and an eviction scan reads only them.

The table keeps the shared state (the columns, the key index, the node rows and lists, leases, the clock) and the
requests; the rest are parts it holds, each keeping a reference to it, or functions that take it:

- ``links`` (``TableLinks``, ``metaserver/table/links.py``): parents, prefix-lru's links and KV events;
- ``commits`` (``CommitRecords``, ``metaserver/table/commits.py``): commit records and dead lists, their own state;
- ``tiers`` (``Tiers``, ``metaserver/table/tiers.py``): nodes' disk tiers; ``quarantine`` (``Quarantine``); ``quota``
  (``TableQuotas``, set by a ``TableDirectory`` that has quota groups); ``qcopy`` (``evict.QueueCopy``);
- functions of the table: ``metaserver/table/evict.py`` (victims), ``nodes.py`` (the node side), ``place.py``
  (ALLOC's placement), ``leases.py`` (read leases: taken, disowned, released, in slices), ``queries.py`` (totals,
  listings), ``invariants.py`` (``check``), ``load.py`` (the full load).

``TableDirectory`` (``metaserver/table/directory.py``) adds the service's calls and holds ``shared``
(``SharedEntries``, ``metaserver/table/shared.py``: TP-sharded pages).

Eviction (``metaserver/table/evict.py``) is exact LRU by ``stamp`` per node: every access stamps its rows with the
next values of one clock, and victims leave each node in exact stamp order. Under ``prefix-lru`` the order is
(tier, stamp) over prefix links kept in two more columns, ``up`` and ``kids`` (8 bytes a row), and a map of the
orphans (``metaserver/table/links.py``, which also tells ``kv_sink`` of rows that become READY and that leave it).

Nodes (``metaserver/table/nodes.py``): added and drained, and a lost one detached at once and dropped in budgeted
slices (its blocks and index reused once nothing of it is in use). Commit records (``commits``): a COMMIT's rows
filed under one etcd record, rewritten (or named by a dead list) as rows leave.

Placement is in turn over the placeable nodes that can hold the page (a child near its parent unless the parent's
node is much fuller), eviction makes room on the chosen node: per node exact, not one order across nodes. Shared
entries, parking and the service's calls are ``table/directory.py``'s and ``table/shared.py``'s. Read leases have owners and
a budgeted expiry (``expire_leases``), PENDING rows a budgeted expiry (``expire_pending``) and their writer's token
(a retried ALLOC gets its place back), extents freed young wait in the write quarantine
(``metaserver/table/quarantine.py``), and the key index resizes a slice at a time (``step``, and each insert's share), so
no request waits for a whole rebuild.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from metaserver.table.entry import GONE, PENDING, READY, SHARD_SHIFT, expire_queue, extent_size
from metaserver.table.index import KeyIndex, zeros
from transport.keyform import digests, pick
from metaserver.table.quarantine import Quarantine
from metaserver.table.evict import QueueCopy
from metaserver.table import invariants, leases, queries
from metaserver.table.links import TableLinks
from metaserver.table.nodes import FREE, UNIT_SHIFT, NodeRows
from metaserver.table.place import alloc_rows, items_of
from metaserver.table.commits import CommitRecords
from metaserver.table.tiers import Tiers
from transport import objformat

BLOCK = 1 << 12  # rows a node takes at a time
COLUMNS = (("node", np.uint16), ("unit", np.uint32), ("size", np.uint16), ("gen", np.uint64), ("pins", np.uint32),
           ("stamp", np.uint64), ("state", np.uint8), ("ns", np.uint16), ("tag", np.uint64), ("rec", np.uint32))
MAX_CODES = 1 << 16  # distinct layout codes a table holds (pages of a namespace share one)
ROW_BYTES = sum(np.dtype(t).itemsize for _, t in COLUMNS)
# LOOKUP and RELEASE operands as 0-d arrays: a Python int operand costs a small batch's ufunc twice its work
_READY0, _NO_ROW0, _PIN0 = np.array(READY, np.uint8), np.array(0, np.int64), np.array(1, np.uint32)


def by_key(hit: np.ndarray, found: list) -> list:
    """One entry per key: ``found``'s items (the hits, in key order) where ``hit`` is set, None elsewhere."""
    if len(found) == len(hit):
        return found
    out: list = [None] * len(hit)
    for i, item in zip(np.flatnonzero(hit).tolist(), found):
        out[i] = item
    return out


class PageTable:
    """Pages as rows of columns: the requests (``alloc``, ``commit``, ``abort``, ``lookup``, ``release``, ``exists``,
    ``remove``), the budgeted expiries (``expire_leases``, ``expire_pending``) and the totals (functions over the
    table in ``table/queries.py``, the listings too); the parts it holds and the functions that take it are in the
    module docstring. ``check()`` verifies the invariants below (``table/invariants.py``).

    Invariants: the key index files exactly the PENDING and READY rows, each once, under its namespace and key
    (``keyindex.KeyIndex.check``); a GONE row is pinned (a zombie: its extent stays allocated until its last pin
    goes); every FREE row is on its node's free list once; each node's allocator holds exactly
    the extents of its PENDING, READY and GONE rows (a detached node's allocator is not kept current: its arena is
    gone); ``pins`` equals the number of open leases naming each row (of a lease in slices, its slices held);
    ``_pending`` holds exactly the PENDING rows; every block belongs to one node or to ``free_blocks`` (all FREE); a
    detached node holds no PENDING row and, once its drop is done, no READY row; a READY row's ``rec`` (when not 0)
    names a live record whose rows include it."""

    def __init__(self, read_lease_s: float = 10.0, pending_ttl_s: float = 30.0):
        self.cols: dict[str, np.ndarray] = {name: np.zeros(0, t) for name, t in COLUMNS}
        self.ix = KeyIndex()
        self.rows = 0  # rows the columns have room for
        self._grow(BLOCK)
        self.node_names = np.zeros(0, object)  # node index -> node id, for gathering an answer's names
        self.ns_names: list[str] = []
        self.ns_ix: dict[str, int] = {}
        self.nodes: list[NodeRows | None] = []  # by node index; None: a retired index, free for the next node
        self.node_by_id: dict[str, NodeRows] = {}  # the live node of each id
        self.placing: list[NodeRows] = []  # placeable live nodes, in index order
        self.placing_min = 0  # the smallest arena of ``placing`` (nodes.py ``_placeable``)
        self._rr = 0  # round-robin placement cursor
        self.dead = np.zeros(0, bool)  # by node index: detached (LOOKUP masks its rows while it is dying)
        self.dying: dict[str, NodeRows] = {}  # detached nodes whose READY rows are being dropped
        self.free_node_ix: list[int] = []
        self.block = BLOCK
        self.blocks_used = 0
        self.free_blocks: list[int] = []  # blocks of retired nodes, taken before the columns grow
        self.leases: dict[int, tuple[np.ndarray, bool]] = {}  # lease -> (its rows, whether a row may repeat)
        self.sliced: dict[int, leases.Slices] = {}  # the leases in slices (``new_lease``'s ``ends``) -> their slices
        self.read_lease_s = read_lease_s
        self.pending_ttl_s = pending_ttl_s
        # PENDING rows in allocation order (their deadline: the stamp column) -> their writer (token, owner)
        self._pending: dict[int, tuple] = {}
        self._lease_owner: dict[int, object] = {}  # lease -> the connection that took it (absent: none given)
        self._lease_q: deque[tuple[float, int]] = deque()  # (expiry, lease) in the order they were granted
        self.clock = 1
        self._osize: dict[int, tuple[int, int]] = {}  # payload length -> (object size, its code's index)
        self.codes: list[int] = []  # the layout codes the ``size`` column indexes
        self.code_ix: dict[int, int] = {}
        self.code_arr = np.zeros(0, np.uint64)
        self.code_parts = np.zeros(0, np.uint64)  # by code index: a shared entry's part count (0: a plain page)
        self.any_shared = False
        self.hits = self.misses = self.evictions = 0
        self._evicted_now: dict[int, int] = {}  # row -> namespace of the pages an ``alloc`` call evicted so far
        self._evicted_rows: list[np.ndarray] = []  # and rows of its victims taken in bulk (``evict.handover``)
        self.qcopy = QueueCopy()  # the eviction queues as numpy, for ALLOC's victims in bulk (``table/evict.py``)
        self.commits = CommitRecords(self)  # COMMITs' pages as etcd records (metaserver/table/commits.py)
        self.quarantine = Quarantine()  # closed pools: extents freed young wait out their write capabilities
        self.leases_orphaned = 0  # leases left to expire by connections that closed (ownership.drop_leases)
        self.links = TableLinks(self)  # parents, prefix-lru's links and KV events (metaserver/table/links.py)
        self.kv_sink = None  # KV events (metaserver/handlers/kvevents.py): told of rows that become READY and that leave it
        self.quota = None  # quota groups (metaserver/table/quotas.py), set by a TableDirectory that has any
        self.tiers = Tiers(self)  # nodes' disk tiers and moves between tiers (metaserver/table/tiers.py)

    # -- rows and columns -------------------------------------------------------------------------------------
    # -- totals (table/queries.py) and the invariant check (table/invariants.py): read by many callers ----------
    @property
    def capacity(self) -> int:
        return queries.capacity(self)

    @property
    def used(self) -> int:
        return queries.used(self)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def objects(self) -> int:
        return queries.objects(self)

    def check(self) -> None:
        invariants.check(self)

    def _grow(self, rows: int) -> None:
        """Make room for ``rows`` rows: an eighth more than there are (or 64 blocks), so copies are amortised and the
        slack stays under an eighth of the table."""
        have = self.rows
        if rows <= have:
            return
        rows = max(rows, have + max(have // 8, 64 * BLOCK))
        for name, arr in list(self.cols.items()):
            grown = zeros(rows, arr.dtype)
            grown[:have] = arr
            self.cols[name] = grown
        self.ix.grow(rows)
        self.cols["state"][have:] = FREE
        self.rows = rows

    def node_region(self, capacity: int) -> tuple[int, int]:
        """(base, size) of the part of a node's arena of ``capacity`` bytes that this table places in and loads
        from: the whole data region; a slot's table in a partitioned pool its slot's region (``slots.SlotTable``)."""
        return objformat.ARENA_DATA_START, capacity

    def _rows_of(self, node) -> np.ndarray:
        """Every row of ``node``'s blocks (int64), in block order."""
        b = self.block
        return (np.asarray(node.blocks, np.int64)[:, None] * b + np.arange(b)).ravel() if node.blocks \
            else np.zeros(0, np.int64)

    def _take_row(self, node: NodeRows) -> int:
        if not node.free:
            self._add_block(node)
        return node.free.pop()

    def _add_block(self, node: NodeRows) -> None:
        """A block of FREE rows for ``node`` (a retired node's, else a new one: the columns may grow), lowest row
        popped first."""
        if self.free_blocks:  # a retired node's block: every row FREE
            b = self.free_blocks.pop()
        else:
            b = self.blocks_used
            self.blocks_used += 1
            self._grow((b + 1) * BLOCK)
        node.blocks.append(b)
        node.free.extend(range((b + 1) * BLOCK - 1, b * BLOCK - 1, -1))

    def _free_row(self, row: int, node: NodeRows) -> None:
        self.cols["state"][row] = FREE
        node.free.append(row)

    def _free_extent(self, row: int, node: NodeRows) -> None:
        """Give a row's extent back to its node: now, or after the quarantine's hold when its generation is young
        (a write capability for it may still be alive: ``metaserver/table/quarantine.py``)."""
        c = self.cols
        size = extent_size(self.codes[c["size"][row]])
        until = self.quarantine.free(node, int(c["unit"][row]) << UNIT_SHIFT, size, int(c["gen"][row]))
        if until and self.quota is not None:  # its group counts the held extent until then
            self.quota.held(int(c["ns"][row]), size, until)

    def _code(self, code: int) -> int | None:
        """The index of layout code ``code`` in ``codes`` (interned on first use); None when the table is full."""
        ix = self.code_ix.get(code)
        if ix is None:
            if len(self.codes) >= MAX_CODES:
                return None
            ix = self.code_ix[code] = len(self.codes)
            self.codes.append(code)
            self.code_arr = np.array(self.codes, np.uint64)
            self.code_parts = self.code_arr >> np.uint64(SHARD_SHIFT)
            self.any_shared = bool(self.code_parts.any())
        return ix

    def _stamp(self, rows: np.ndarray) -> None:
        """Stamp ``rows`` with the next clock values, in order (the last is the most recent)."""
        n = len(rows)
        self.cols["stamp"][rows] = np.arange(self.clock, self.clock + n, dtype=np.uint64)
        self.clock += n

    def _find(self, ns: str, keys: list[bytes]) -> np.ndarray:
        """Rows of ``keys`` in ``ns`` (int64; -1: absent), PENDING or READY."""
        nsix = self.ns_ix.get(ns)
        if nsix is None or not keys:
            return np.full(len(keys), -1, np.int64)
        # one namespace interned: every filed row is of it, so the key index need not read the rows' namespaces
        return self.ix.find(nsix, digests(keys)[0], self.cols["ns"] if len(self.ns_names) > 1 else None)

    def offsets_of(self, rows: np.ndarray) -> list[int]:
        """The byte offsets of ``rows`` (their ``unit`` column in 4 KiB units)."""
        return (self.cols["unit"].take(rows).astype(np.uint64) << UNIT_SHIFT).tolist()

    def code_extents(self) -> np.ndarray:
        """The extent size of each interned layout code, by code index (int64): an extent of the ``size`` column."""
        return np.array([extent_size(code) for code in self.codes], np.int64)

    def key_of(self, row: int) -> bytes:
        """A live row's key, as the client sent it."""
        return self.ix.key_of(row)

    # -- nodes ------------------------------------------------------------------------------------------------
    def _ns(self, ns: str) -> int:
        ix = self.ns_ix.get(ns)
        if ix is None:
            ix = self.ns_ix[ns] = len(self.ns_names)
            self.ns_names.append(ns)
        return ix

    # -- requests ---------------------------------------------------------------------------------------------
    def alloc(self, ns: str, keys: list[bytes], sizes: list[int], gen_base: int,
              tags: list[int] | None = None, now: float = 0.0, token: int | None = None, owner: object = None,
              parents: list | None = None, at: list[int] | None = None) -> list:
        """Place each new key (PENDING, generation ``gen_base + i``), evicting the placed node's least recently
        used pages when it is full. Items: ``(NEW, node_id, offset, payload_len, gen)`` or
        ``(EXISTS | IN_FLIGHT | NO_SPACE, None, None, None, None)``; keys are taken in order, so a key that an earlier
        key of the same request evicted is placed again, and a key given twice is EXISTS the second time (the first
        is the one stored). A READY key answers EXISTS and counts as a use (its stamp moves to now): an engine
        re-offers pages it holds in a live context. A key PENDING under the same writer ``token`` with the same
        length gets its place again (an ALLOC retried after a lost answer), and from then on belongs to ``owner``
        (``writer_of``); under another token it is IN_FLIGHT. ``parents[i]``: the key of key i's parent page (None:
        none), READY, PENDING or placed earlier in this request: key i goes to its parent's node
        when that node has room for it and at least half the free bytes of the emptiest placeable node (so a chain
        stays on one node without piling every chain of a shared prefix onto it), to the emptiest placeable node
        when that one is much fuller, and otherwise to the next placeable node in turn whose arena can hold it at
        all, evicting there when it is full. (Why in turn and per node: placing on the node with the most free
        bytes and evicting where the next victim is oldest across nodes needs per-request next-victim stamps, which
        cost this ALLOC 0.67x at 10 M pages.)
        ``tags``: each key's object tag (``umbp.auth.Tokens.tags``, a closed pool), kept in the ``tag`` column so a
        LOOKUP answers it without computing it again (0 when not given). A PENDING row not committed within
        ``pending_ttl_s`` of ``now`` is dropped by ``expire_pending``; until its commit its ``stamp`` holds that
        deadline in milliseconds. Sizes come validated (``metaserver/validate.py``): nothing in the loop raises, so
        a request's evictions and placements always reach the key index together. ``at``: the keys' positions in a
        larger request (their generations are ``gen_base + at[i]``; shared entries place the keys they do not answer
        otherwise through here: ``metaserver/table/shared.py``)."""
        return items_of(self, *self.alloc_rows(ns, keys, sizes, gen_base, tags, now, token, owner, parents, at))

    def alloc_rows(self, ns: str, keys: list[bytes], sizes: list[int], gen_base: int, tags: list[int] | None = None,
                   now: float = 0.0, token: int | None = None, owner: object = None, parents: list | None = None,
                   at: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``alloc`` as columns (``metaserver/table/place.py``): each key's state (int8: ``AllocState`` or
        ``OVER_QUOTA``) and its row (int64; -1 unless NEW), whose columns hold the place."""
        return alloc_rows(self, ns, keys, sizes, gen_base, tags, now, token, owner, parents, at)

    def _parents_near(self, nsix: int, parents: list) -> dict:
        """Parent key -> the live node of its PENDING or READY row, for the parents of an ALLOC found in the table."""
        named = list({p for p in parents if p is not None})
        if not named:
            return {}
        rows = self.ix.find(nsix, digests(named)[0], self.cols["ns"])
        c = self.cols
        out = {}
        for p, r in zip(named, rows.tolist()):
            if r >= 0 and c["state"][r] in (PENDING, READY):
                node = self.nodes[c["node"][r]]
                if not node.dead:
                    out[p] = node
        return out

    def commit(self, ns: str, keys: list[bytes], gens: list[int], rows: list[int] | None = None) -> list[bool]:
        """PENDING -> READY for each (key, gen) still pending with that generation; a key already READY with that
        generation reports True again (idempotent), anything else False (a shared entry's row too: its ranks
        commit it).

        ``rows``: where the writer's connection says each key is (its ALLOC's rows, -1: not known), so a COMMIT
        from the connection that allocated needs no key digest and no index probe (0.26 us a key of 66 bytes for
        the digest alone). A generation names one allocation of this table (unique and never 0: ``GenCounter``),
        so a row that is PENDING or READY with the key's generation holds that key; any other is found by key."""
        g = np.fromiter(gens, np.uint64, len(gens))  # (a list of ints: a third cheaper than np.array)
        c = self.cols
        if rows is None:
            rows = self._find(ns, keys)
        else:
            rows = np.fromiter(rows, np.int64, len(g))
            live = (rows >= _NO_ROW0) & (rows < len(c["gen"]))
            at = np.where(live, rows, 0)
            live &= (c["gen"].take(at) == g) & (c["state"].take(at) <= _READY0)
            if np.count_nonzero(live) != len(live):
                stale = np.flatnonzero(~live)
                rows[stale] = self._find(ns, pick(keys, stale.tolist()))
        found = rows >= _NO_ROW0
        nf = np.count_nonzero(found)
        ok = np.zeros(len(keys), bool)
        if nf:
            every = nf == len(keys)  # (every key found, the usual: no masks)
            fr = rows if every else rows[found]
            st = c["state"].take(fr)
            same = c["gen"].take(fr) == (g if every else g[found])
            if self.any_shared:  # never a shared entry's row: its ranks' COMMITs complete it (table/shared.py)
                same &= self.code_parts.take(c["size"].take(fr)) == 0
            if every:
                ok = same
            else:
                ok[found] = same
            new = fr[same & (st == PENDING)]
            if len(new):
                pending = self._pending
                held = len(pending)
                for r in new.tolist():
                    pending.pop(r, None)
                if held - len(pending) < len(new):  # a key given twice (fewer rows left the set): once, in key order
                    new = new[np.sort(np.unique(new, return_index=True)[1])]
                c["state"][new] = READY
                self._stamp(new)
                self.commits.committed(ns, new)
        return ok.tolist()

    def abort(self, ns: str, keys: list[bytes], gens: list[int]) -> int:
        """Give back the PENDING allocations of (key, gen) (a writer that will not write them, or whose connection
        closed); returns how many. Anything else is left as it is."""
        rows = self._find(ns, keys)
        c = self.cols
        ok = rows >= 0
        fr = rows[ok]
        hit = np.unique(fr[(c["state"][fr] == PENDING) & (c["gen"][fr] == np.array(gens, np.uint64)[ok])])
        for r in hit.tolist():
            del self._pending[r]
            node = self.nodes[c["node"][r]]
            self._free_extent(r, node)
            self._free_row(r, node)
        if len(hit):
            self.ix.delete(hit, c["ns"].take(hit).astype(np.uint64))
        return len(hit)

    def writer_of(self, row: int) -> object:
        """The owner of a PENDING row's allocation (the last ALLOC that named it with its token), or None."""
        w = self._pending.get(row)
        return w[1] if w is not None else None

    def lookup(self, ns: str, keys: list[bytes], now: float = 0.0, owner: object = None) -> tuple[int, list]:
        """Locations ``(node_id, offset, payload_len, gen)`` of READY keys (None for the others), pinned under one
        read lease (0 when nothing was found) that belongs to ``owner`` and expires ``read_lease_s`` after ``now``
        (``expire_leases``)."""
        lease, hit, hr = self.lookup_rows(ns, keys, now, owner)
        if not lease:
            return 0, [None] * len(keys)
        c = self.cols
        return lease, by_key(hit, list(zip(self.node_names[c["node"][hr]].tolist(),
                                           self.offsets_of(hr),
                                           self.code_arr[c["size"][hr]].tolist(), c["gen"][hr].tolist())))

    def lookup_rows(self, ns: str, keys: list[bytes], now: float = 0.0, owner: object = None, parts: int = 0
                    ) -> tuple[int, np.ndarray, np.ndarray]:
        """``lookup`` as columns: (lease, which keys were found, their rows in key order), the rows pinned under
        the lease (0, and no rows, when nothing was found). ``parts``: the rows of shared entries of that many
        parts (``metaserver/table/shared.py``); 0, plain pages only."""
        hit, hr = self.pin_hits(ns, keys, parts)
        n = len(hr)
        return (self.new_lease(hr, n > 1, now, owner) if n else 0), hit, hr

    def pin_hits(self, ns: str, keys: list[bytes], parts: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``lookup_rows``' table pass without the lease: (which keys were found, their rows in key order), the rows
        stamped and pinned once a naming. The caller puts them under leases (``new_lease``: one, or one per request
        of a turn's LOOKUPs, ``TableDirectory.lookup_columns_many``) before anything else runs."""
        rows = self._find(ns, keys)
        c = self.cols
        st = c["state"]
        hit = st.take(rows) == _READY0
        if st[-1] == READY:  # rows of -1 (absent keys) read the last row: masked when that one is READY
            hit &= rows >= _NO_ROW0
        if self.dying:  # a detached node's pages miss at once, before their slice drops them
            hit &= ~self.dead.take(c["node"].take(rows))
        if self.any_shared:  # only pages of the layout asked for: never another layout's bytes
            hit &= self.code_parts.take(c["size"].take(rows)) == parts
        elif parts:  # no shared entry at all
            hit[:] = False
        n = int(np.count_nonzero(hit))  # (a Python int: the counts below are answered in STATS)
        hr = rows if n == len(rows) else rows[hit]  # (every key found, the usual: no copy by the mask)
        self.hits += n
        self.misses += len(keys) - n
        if not n:
            return hit, hr
        self._stamp(hr)  # (a row given twice keeps its later stamp)
        # A repeated row is pinned once per time it is named, as the lease names it: ``add.at`` counts repeats, and
        # with a 0-d operand costs about a fancy ``+=`` (1.0 vs 0.8 us at 128 rows, 2.3 vs 3.0 at 1,024), less than
        # telling whether any row repeats (a set, or the stamps' sum: 1.5-2.4 us)
        np.add.at(c["pins"], hr, _PIN0)
        return hit, hr

    # -- read leases (metaserver/table/leases.py) ----------------------------------------------------------------
    def new_lease(self, rows: np.ndarray, repeats: bool, now: float, owner: object, ends: list | None = None) -> int:
        return leases.new_lease(self, rows, repeats, now, owner, ends)

    def slice_open(self, lease: int, j: int) -> bool:
        sl = self.sliced.get(lease)
        return sl is not None and sl.held[j]

    def release(self, lease: int, owner: object = None) -> bool:
        """``release_many`` of one lease: False, changing nothing, when it is unknown, already expired, or (``owner``
        given) another owner's. ``owner`` None: expiry, tests."""
        return leases.release_many(self, ((lease, owner),)) == 1

    def disown(self, lease: int, owner: object) -> bool:
        return leases.disown(self, lease, owner)

    def release_many(self, asks, slices=()) -> int:
        return leases.release_many(self, asks, slices)

    def expire_leases(self, now: float, budget: int) -> int:
        """Release leases whose ``read_lease_s`` ran out by ``now``, at most ``budget`` of the oldest; returns how
        many were still held (the others were released by their owners already)."""
        return expire_queue(self._lease_q, now, budget, self.release)

    def expire_pending(self, now: float, budget: int) -> int:
        """Drop PENDING rows whose writer did not commit within ``pending_ttl_s``, oldest first, at most ``budget``;
        returns how many."""
        c = self.cols
        due = []
        limit = now * 1000
        for r in self._pending:
            if len(due) >= budget or c["stamp"][r] > limit:
                break
            due.append(r)
        for r in due:
            del self._pending[r]
            self._free_extent(r, self.nodes[c["node"][r]])
            self._free_row(r, self.nodes[c["node"][r]])
        if due:
            rows = np.array(due, np.int64)
            self.ix.delete(rows, c["ns"].take(rows).astype(np.uint64))
        return len(due)

    def step(self, budget: int) -> int:
        """Background work (the owner's tick): drain at most ``budget`` slots of a key index resize under way
        (``table/index.py``); returns how many. Inserts drain by their own share too, so this only speeds it up."""
        return self.ix.step(budget, self.cols["ns"])

    def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        rows = self._find(ns, keys)
        ok = self.cols["state"].take(rows) == READY  # rows of -1 read the last row: masked next
        ok &= rows >= 0
        return ok.tolist()

    def remove(self, ns: str, keys: list[bytes]) -> list[bool]:
        """Remove keys (READY or PENDING). A pinned row stays GONE, its extent allocated, until its last pin."""
        rows = self._find(ns, keys).tolist()
        c = self.cols
        out = []
        gone = []
        ready = []
        for r in rows:
            if r < 0 or c["state"][r] not in (PENDING, READY):  # absent, or given twice and removed already
                out.append(False)
                continue
            out.append(True)
            gone.append(r)
            if c["state"][r] == READY:
                ready.append(r)
            self._pending.pop(r, None)
            node = self.nodes[c["node"][r]]
            if c["pins"][r]:
                c["state"][r] = GONE
            else:
                self._free_extent(r, node)
                self._free_row(r, node)
        if gone:
            self.commits.leaving(np.array(ready, np.int64))
            self.ix.delete(np.array(gone, np.int64), np.full(len(gone), self.ns_ix[ns], np.uint64))
        return out
