"""The metaserver's page directory: ``TableDirectory`` is the columnar page table (``metaserver.table.columns.PageTable``)
with the calls the service makes (``metaserver/ha/service.py``, ``dataplane.py``, ``ownership.py``, ``rejoin.py``,
``admin.py``, ``metrics.py``). It is the directory's one core (docs/design/directory-and-eviction.md).

What it answers (unit tests: ``tests/unit/test_directory*.py``, ``test_columns.py``, ``test_table*.py``): ALLOC,
COMMIT, ABORT, LOOKUP (with its closed-pool grants, ``lookup_granted``), RELEASE, EXISTS, PREFIX, REMOVE, LIST,
STATS, read leases and their owners, PENDING expiry and writers' tokens, the write quarantine, node loss in budgeted
slices with the lost node's pages parked for its return (``unpark``, ``forget_parked``), DRAIN, the watermark pass
and an operator's EVICT (each victim from the fullest node), shared entries of TP-sharded pages
(``metaserver/table/shared.py``), commit records in etcd (``metaserver/table/commits.py``) and the full load at a
takeover (``load``).

A partitioned pool's slot is a ``metaserver.ha.slots.SlotTable``: this table with each node's allocator the slot's
region of its arena (``PageTable.node_region``). ``prefix-lru``'s links and KV events: ``metaserver/table/links.py``.
Quota groups and reservations: ``metaserver/table/quotas.py`` (``quota``; the properties below answer what the
service reads of them). A standby keeps a warm copy of the table (``metaserver/ha/standby.py``: ``load``'s ``held``,
then ``metaserver/ha/warmrows.py``). Placement is in turn over the placeable nodes that can hold the page, a child near
its parent unless the parent's node is much fuller (then the emptiest), and eviction makes room on the chosen node.

A connection's PENDING allocations are ``(ns, key, gen)`` handles, each kept with its row: COMMIT and ABORT settle
them (a COMMIT starts from those rows, ``PageTable.commit``), and a closing connection aborts those still PENDING
with that generation and still its own (``abort_owned``: another connection's retry with the writer's token took
the allocation over).
"""

from __future__ import annotations

import heapq
from itertools import repeat

import numpy as np

from metaserver.table.columns import PageTable
from metaserver.table.entry import PENDING, READY, Effects, extent_size
from metaserver.table import grants
from metaserver.table.grants import Placed
from metaserver.table.snapshot import PageRecords
from metaserver.table.evict import bytes_to_low, over_high, victim
from metaserver.table.load import load_nodes, load_pages, reserve
from metaserver.table.nodes import NodeRows, add_node, detach_node, drain_rows, drop_rows, set_placeable
from metaserver.table.place import alloc_rows_many
from metaserver.table import queries
from metaserver.table.quotas import TableQuotas
from metaserver.table.shared import SharedEntries
from metaserver.table.tiers import SUFFIX, twin_id
from transport import objformat
from transport.keyform import pick
from umbp.errors import ConfigError
from umbp.quotarules import QuotaRules


SCAN_PER_DROP = 16  # rows a drop slice may visit per page of its budget (numpy work over the state column)


def _by_ns(recs: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in recs:
        out.setdefault(r[0], []).append(r)
    return out


class TableDirectory(PageTable):
    """The page table with the service's calls: see the module docstring."""

    def __init__(self, *, pending_ttl_s: float = 30.0, read_lease_s: float = 10.0, policy: str = "lru",
                 quotas: QuotaRules | dict[str, int] | None = None, namer=None):
        if policy not in ("lru", "prefix-lru"):
            raise ConfigError("metaserver", f"directory 'table' evicts by lru or prefix-lru, not {policy!r}")
        super().__init__(read_lease_s=read_lease_s, pending_ttl_s=pending_ttl_s)
        if policy == "prefix-lru":
            self.links.enable()  # prefix links and the (tier, stamp) victim order (metaserver/table/links.py)
        if namer is not None:
            self.commits.namer = namer  # a commit record's etcd key (EtcdStore.batch_name)
        self.quotas = QuotaRules.of(quotas)  # a slot's share already applied (QuotaRules.shared)
        if self.quotas:
            self.quota = TableQuotas(self, self.quotas)
            self.ix.watch = self.quota.filed  # use: the extents of the rows the key index files
        self.puts = 0
        self.shared = SharedEntries(self)  # shared entries of TP-sharded pages (metaserver/table/shared.py)

    # -- what the service reads -------------------------------------------------------------------------------
    @property
    def spaces(self) -> dict[str, NodeRows]:
        """Live nodes by id (the quarantine's ``release`` checks a held extent's node against it)."""
        return self.node_by_id

    @property
    def pinned(self) -> int:
        return int(np.count_nonzero(self.cols["pins"]))

    def space_use(self, node_id: str) -> tuple[int, int] | None:
        """(arena bytes held, pages PENDING or READY) of a live node, None when it has none. O(its rows) numpy."""
        node = self.node_by_id.get(node_id)
        if node is None:
            return None
        st = self.cols["state"].take(self._rows_of(node))
        return node.alloc.used, int(np.count_nonzero((st == READY) | (st == PENDING)))

    def effects(self, fx: Effects | None = None) -> Effects:
        """The etcd work of the requests since the last call (``CommitRecords.take``) as ``Effects``: new commit records
        to put (``recs``), records to rewrite without pages that left (``batches``)."""
        fx = Effects() if fx is None else fx
        puts, rewrites = self.commits.take()
        fx.recs.extend(puts)
        fx.batches.extend(rewrites)
        return fx

    # -- requests -----------------------------------------------------------------------------------------------
    def own_parents(self, ns: str, parents: list | None, keys=()) -> list | None:
        """The parents an ALLOC of ``keys`` links (a slot's table: those of its own slot, ``slots.SlotTable``)."""
        return parents

    def alloc(self, ns, keys, sizes, parents, gen_base, now, token=None, owner=None, shard=None):
        parents = self.own_parents(ns, parents, keys)
        if shard is not None:
            return self.shared.alloc(ns, keys, sizes, parents, gen_base, now, token, owner, shard), self.effects()
        items = PageTable.alloc(self, ns, keys, sizes, gen_base, None, now, token, owner, parents)
        return items, self.effects()

    def alloc_placed(self, ns, keys, sizes, parents, gen_base, now, token=None, owner=None, shard=None) -> Placed:
        """``alloc`` as columns (``grants.Placed``, its effects in ``fx``): what the service's ALLOC answers from
        (``grants.grant_alloc``). A plain page's tag is kept in its row's ``tag`` column once granted."""
        parents = self.own_parents(ns, parents, keys)
        if shard is not None:
            items = self.shared.alloc(ns, keys, sizes, parents, gen_base, now, token, owner, shard)
            return Placed.of_items(items, shard[0], self.effects())
        state, rows = self.alloc_rows(ns, keys, sizes, gen_base, None, now, token, owner, parents)
        return Placed.of_rows(self, state, rows, self.effects())

    def alloc_placed_many(self, ns: str, asks: list, gen_base: int, now: float) -> tuple[list[Placed], Effects] | None:
        """``alloc_placed`` of several ALLOCs at once (``place.alloc_rows_many``: ``asks`` of (keys, sizes, parents,
        token, owner), plain pages), each one's ``Placed`` and the effects of them all; None (nothing done) where
        one pass would not give what they would one after the other."""
        got = alloc_rows_many(self, ns, [(k, s, self.own_parents(ns, p, k), tok, own) for k, s, p, tok, own in asks],
                              gen_base, now)
        if got is None:
            return None
        return [Placed.of_rows(self, st, r) for st, r in got], self.effects()

    def commit(self, ns, keys, gens, now, shard=None, rows=None):
        """COMMIT (``PageTable.commit``; ``rows``: where the connection's handles say the keys are, from
        ``settle_handles``), or of a shared entry's rank (``shard``)."""
        before = self.commits.committed_pages
        ok = (PageTable.commit(self, ns, keys, gens, rows) if shard is None
              else self.shared.commit(ns, keys, gens, shard))
        fx = self.effects()
        self.puts += self.commits.committed_pages - before
        return ok, fx

    def lookup(self, ns, keys, now, owner=None, shard=None):
        if shard is not None:
            return self.shared.lookup(ns, keys, now, owner, shard)
        return PageTable.lookup(self, ns, keys, now, owner)

    def _free_row(self, row: int, node: NodeRows) -> None:
        states = self.shared.states
        if states:
            states.pop(row, None)  # a PENDING shared row ends whatever ends it
        PageTable._free_row(self, row, node)

    def check(self) -> None:
        PageTable.check(self)
        self.shared.check()
        if self.quota is not None:
            self.quota.check()

    # -- quota groups (metaserver/table/quotas.py), as the service and ownership.py read them -------------------
    @property
    def reserving(self) -> bool:
        return self.quota is not None and self.quota.reserving

    @property
    def group_used(self) -> dict[str, int]:
        """Bytes in use by group name (those with any)."""
        return self.quota.used_by_name() if self.quota is not None else {}

    @property
    def ns_used(self) -> dict[str, int]:
        """Bytes in use by namespace (those with any), counted while the table has quota groups."""
        return self.quota.ns_used_by_name() if self.quota is not None else {}

    def group_held(self, name: str, now: float | None = None) -> int:
        """Bytes of group ``name`` freed young and still held by the quarantine."""
        q = self.quota
        g = next((i for i, x in enumerate(q.groups) if x.name == name), -1) if q is not None else -1
        return q.group_held(g, now) if g >= 0 else 0

    def namespace_usage(self) -> dict[str, dict]:
        usage = queries.namespace_usage(self)
        return self.quota.usage(usage) if self.quota is not None else usage

    def lookup_granted(self, ns: str, keys: list, now: float, owner, tokens, member, shard=None, packed=False
                       ) -> dict:
        """LOOKUP with its closed-pool grants, from the columns (no Python step per key): the answer's ``lease``,
        ``caps`` (one read capability per node, covering that node's slots of the batch in key order) and, ``packed``,
        ``nodes`` and ``rows`` (``answerrows.pack_locs``: one row a key), else ``locs`` (wire VERSION 11: ``(node_id,
        offset, payload_len, gen, tag, cap_index)`` or None a key). Tags come from the ``tag`` column; a row that has
        none yet (0: never looked up since its ALLOC or the load) gets it computed once here (``Tokens.tags``) and
        kept; a shared row keeps its shard base there, and a rank's tags are one ``rank_tags`` step over them.
        ``member``: node id -> its member (``cap_key``) or None.

        Costs: about 80 numpy calls and one keyed blake2b a node, whatever the batch. Measured on the 2-core VM, 1 M
        pages on 32 nodes, a run of 128 listed keys of the build order (so on all 32 nodes), LOOKUP plus its RELEASE:
        about 100 us, of which the digests 6, the key index 32, the lease, pins and stamps of both 16, the tags and
        answer columns 12, ``by_node`` 6, the 32 capabilities 19, names, capability keys, grouped slots and packing 9;
        1,024 keys about 315 us (the digests 38, the key index 115, capabilities 49). Packed keys
        (``transport.keyform.PackedKeys``) cost no digest step: a view. docs/benchmarks/columns.md: where it goes and
        what is left."""
        return self.granted_answer(self.lookup_columns(ns, keys, now, owner, tokens, shard), member, packed)

    # -- a LOOKUP's table work and answer: metaserver/table/grants.py -------------------------------------------
    def lookup_columns_many(self, ns: str, asks: list[tuple[list, object]], now: float, tokens) -> list[tuple]:
        return grants.lookup_columns_many(self, ns, asks, now, tokens)

    def granted_answer(self, cols: tuple, member, packed: bool) -> dict:
        return grants.granted_answer(self, cols, member, packed)

    def lookup_columns(self, ns: str, keys: list, now: float, owner, tokens, shard=None) -> tuple:
        return grants.lookup_columns(self, ns, keys, now, owner, tokens, shard)

    def remove(self, ns, keys):
        return PageTable.remove(self, ns, keys), self.effects()

    # -- a connection's PENDING allocations -------------------------------------------------------------------
    @staticmethod
    def pending_of(ns: str, keys: list, p: Placed):
        """``((ns, key, gen), row)`` of placement ``p``'s NEW keys: a connection's handles and where they are (-1:
        a shared entry's sub-slot, found by key)."""
        rows = repeat(-1) if p.rows is None else p.rows.tolist()
        return zip(zip(repeat(ns), pick(keys, p.new.tolist()), p.gens.tolist()), rows)

    @staticmethod
    def settle_handles(held: dict, ns: str, keys: list, gens: list) -> list[int]:
        """Take the handles ``(ns, key, gen)`` of a COMMIT or ABORT out of a connection's ``held`` ones; each one's
        row, -1 for one it did not hold (a COMMIT finds those by key)."""
        return list(map(held.pop, zip(repeat(ns), keys, gens), repeat(-1)))

    def abort_owned(self, handles, owner) -> int:
        """Abort the allocations of ``handles`` still PENDING with their generation and still ``owner``'s."""
        by_ns: dict[str, tuple[list, list]] = {}
        for ns, key, gen in handles:
            ks, gs = by_ns.setdefault(ns, ([], []))
            ks.append(key)
            gs.append(gen)
        n = 0
        for ns, (ks, gs) in by_ns.items():
            rows = self._find(ns, ks).tolist()
            mine = [i for i, r in enumerate(rows) if r >= 0 and self.shared.owned_by_row(r, owner)]
            if mine:
                n += PageTable.abort(self, ns, [ks[i] for i in mine], [gs[i] for i in mine])
        return n

    # -- nodes ------------------------------------------------------------------------------------------------
    def add_space(self, node_id: str, capacity: int) -> NodeRows:
        """A registered node's space; with a disk (``tiers.disks``) its disk tier's twin too."""
        add_node(self, node_id, capacity)
        self.tiers.add(node_id)
        return self.node_by_id[node_id]

    def drop_space(self, node_id: str, disk: bool = True) -> tuple[int, Effects]:
        """Drop a node and every page of it at once (it re-registered with another arena); ``disk`` False: its
        disk tier's pages stay (the same disk came back with a new DRAM arena)."""
        n = 0
        for nid in (node_id, twin_id(node_id)) if disk else (node_id,):  # and its disk tier's pages
            if nid in self.node_by_id or nid in self.dying:
                n += self._detach(nid) + drop_rows(self, nid, 1 << 62)[0]
        return n, self.effects()

    def detach_space(self, node_id: str, park: bool = False) -> tuple[int, Effects]:
        n = self._detach(node_id, park)
        if twin_id(node_id) in self.node_by_id:  # its disk tier goes with it (parked alike: ``drop_slice``)
            n += self._detach(twin_id(node_id), park)
        return n, self.effects()

    def _detach(self, node_id: str, park: bool = False) -> int:
        """``nodes.detach_node``, a drop of the same node id still under way finished first through ``drop_slice``
        (so the disk tier's parked DRAM records are taken as any finished drop's are)."""
        n = self.drop_slice(node_id, 1 << 62)[0] if node_id in self.dying else 0
        return n + detach_node(self, node_id, park)

    def drop_slice(self, node_id: str, budget: int, fx: Effects | None = None) -> tuple[int, list | None]:
        """Drop at most ``budget`` READY pages of a detached node (``nodes.drop_rows``, its effects into
        ``fx``). Returns (pages dropped, None while pages are left, else the node's parked records as the service
        keeps them, ``rejoin.py``: ``(ns, key, offset, payload_len, gen, parent | None, stamp, record name | None)``)."""
        if node_id not in self.dying and twin_id(node_id) in self.dying:  # the node's DRAM pages done: its disk's
            node_id = twin_id(node_id)
        n, recs = drop_rows(self, node_id, budget)
        visited = budget
        while recs is None and n < budget and visited < SCAN_PER_DROP * budget:
            # the table's slice counts rows visited, the service's budget pages dropped: go on over rows that held
            # no READY page (freed, PENDING dropped at the detach), at most SCAN_PER_DROP x budget rows a call
            k, recs = drop_rows(self, node_id, budget - n)
            visited += budget - n
            n += k
        if fx is not None:
            self.effects(fx)
        if recs is None:
            return n, None
        disk = objformat.DISK_BIT if node_id.endswith(SUFFIX) else 0  # a disk page parks at its disk address
        out = [(ns, k, off | disk, plen, gen, parent, st, name) for ns, k, off, plen, gen, st, name, parent in recs]
        if disk or twin_id(node_id) in self.dying:
            out = self.tiers.parked(node_id, out)  # the DRAM pages kept until its disk's are dropped too
        return n, out

    def unpark(self, node_id: str, recs: list) -> tuple[int, Effects]:
        """A lost node came back with its arena; its parked records ``(ns, key, offset, payload_len, gen, parent,
        record name | None)`` (oldest first) are filed again into its (new, empty) rows, except keys present now,
        each under the commit record it came from (rewritten with it), by ``load_pages``' rules. Returns (restored,
        effects): the commit records rewritten, the own records of pages that could not come back deleted."""
        present = set()
        for ns, group in _by_ns(recs).items():
            rows = self._find(ns, [r[1] for r in group]).tolist()
            present.update(id(r) for r, row in zip(group, rows) if row >= 0)
        keep = [r for r in recs if id(r) not in present]  # oldest first, as parked
        fx = Effects()
        if not keep:
            return 0, fx
        disk = [r for r in keep if r[2] & objformat.DISK_BIT]  # its disk tier's pages: back under its twin
        if disk:
            keep = [r for r in keep if not r[2] & objformat.DISK_BIT]
            if twin_id(node_id) in self.node_by_id:
                on, fx = self.unpark(twin_id(node_id), [(r[0], r[1], r[2] & ~objformat.DISK_BIT) + tuple(r[3:])
                                                       for r in disk])
                back, fx2 = self.unpark(node_id, keep) if keep else (0, Effects())
                fx.deletes.extend(fx2.deletes)
                return on + back, self.effects(fx)
            keep += disk  # no disk now: each is lost (its own record deleted, a commit record rewritten)
            if not keep:
                return 0, fx
        names = [r[6] for r in keep]
        bad = load_pages(self, node_id, [r[0] for r in keep], [r[1] for r in keep], [r[2] for r in keep],
                         [r[3] for r in keep], [r[4] for r in keep], records=names, parents=[r[5] for r in keep])
        for name in dict.fromkeys(n for n in names if n is not None):
            rec = self.commits.by_name.get(name)
            if rec is not None:
                self.commits.rewrites[rec] = None  # with its pages back
        fx.deletes.extend((keep[i][0], keep[i][1]) for i in bad if names[i] is None)
        return len(keep) - len(bad), self.effects(fx)

    def forget_parked(self, recs: list, page_key) -> list:
        """Parked pages given up: the etcd keys of those with a record of their own (keys not written again since),
        and the commit records holding any (``TableRecord``: rewritten without them; the parked rows left them when
        they were dropped)."""
        out: list = []
        for ns, group in _by_ns(recs).items():
            rows = self._find(ns, [r[1] for r in group]).tolist()
            out.extend(page_key(r[0], r[1]) for r, row in zip(group, rows) if r[6] is None and row < 0)
        for name in dict.fromkeys(r[6] for r in recs if r[6] is not None):
            rec = self.commits.by_name.get(name)
            if rec is not None:
                out.append(rec)
        return out

    def set_placeable(self, node_id: str, placeable: bool) -> None:
        """Place on ``node_id`` or not (the service's, a slot's fence, the standby's: ``nodes.set_placeable``)."""
        set_placeable(self, node_id, placeable)

    def drain(self, node_id: str) -> tuple[int, int, Effects]:
        dropped, pinned = drain_rows(self, node_id)
        return dropped, pinned, self.effects()

    # -- eviction passes: the watermark, an operator's EVICT --------------------------------------------------
    def evict_node(self, node: NodeRows, nbytes: int, budget: int, stop=None, spare: bool = True
                   ) -> tuple[int, int]:
        """Evict the node's least recently used unpinned READY pages until ``nbytes`` are freed or ``budget``
        pages went, or ``stop()`` (asked after each victim) is true; ``spare``: pass over the pages of quota groups
        at their reservation (all but evict-all). Returns (evicted, freed bytes)."""
        gen = self.cols["gen"]
        rows: list[int] = []
        nss: list[int] = []
        freed = 0
        while freed < nbytes and len(rows) < budget and not (rows and stop is not None and stop()):
            i = victim(self, node, spare)
            if i < 0:
                break
            r = node.queue[i]
            size = extent_size(node.qcode[i])
            until = self.quarantine.free(node, node.qoff[i], size, int(gen[r]))
            if until and self.quota is not None:
                self.quota.held(node.qns[i], size, until)
            self._free_row(r, node)
            rows.append(r)
            nss.append(node.qns[i])
            if self.links.linking:
                self.links.evicted(r)  # its parent's tier now, for the next victim (metaserver/table/links.py)
            freed += size
        if rows:
            ra = np.array(rows, np.int64)
            self.commits.leaving(ra)
            self.ix.delete(ra, np.array(nss, np.uint64))
        self.evictions += len(rows)
        return len(rows), freed

    def watermark_pass(self, high: float, low: float, budget: int, fx: Effects) -> tuple[int, int]:
        n = freed = 0
        for node in list(self.node_by_id.values()):
            cap, used = node.alloc.capacity, node.alloc.used
            if n >= budget or not over_high(used, cap, high) or self.tiers.moves_for(node):
                continue
            k, f = self.evict_node(node, bytes_to_low(used, cap, low), budget - n)
            n += k
            freed += f
        self.effects(fx)
        return n, freed

    def needs_eviction(self, high: float) -> bool:
        return any(over_high(n.alloc.used, n.alloc.capacity, high) and not self.tiers.moves_for(n)
                   for n in self.node_by_id.values())

    def evict_bytes(self, nbytes: int, budget: int, fx: Effects) -> tuple[int, int]:
        """Free at least ``nbytes``, each victim from the fullest node by fill ratio (ties: the first added), at most
        ``budget`` evictions, so the nodes' fills come down together (a node is not emptied while others stay
        full). O((nodes + victims) log nodes): a heap of fills, a node's victims in one run while it stays fullest."""
        heap = [(-x.alloc.used / max(1, x.alloc.capacity), i, x) for i, x in enumerate(self.node_by_id.values())
                if x.alloc.used]
        heapq.heapify(heap)
        n = freed = 0
        while heap and freed < nbytes and n < budget:
            _, i, node = heapq.heappop(heap)
            cap = max(1, node.alloc.capacity)
            k, f = self.evict_node(node, nbytes - freed, budget - n,
                                   lambda: bool(heap) and (-node.alloc.used / cap, i) > heap[0][:2])
            n += k
            freed += f
            if k and node.alloc.used:
                heapq.heappush(heap, (-node.alloc.used / cap, i, node))
        self.effects(fx)
        return n, freed

    def evict_all(self, budget: int, fx: Effects) -> tuple[int, int, bool]:
        n = freed = 0
        for node in list(self.node_by_id.values()):
            k, f = self.evict_node(node, 1 << 62, budget - n, spare=False)  # an operator's --all: reservations too
            n += k
            freed += f
            if n >= budget:
                self.effects(fx)
                return n, freed, False
        self.effects(fx)
        return n, freed, True

    # -- the full load ----------------------------------------------------------------------------------------
    def load(self, descs: dict, pages: PageRecords, held: list | None = None) -> tuple[list[tuple], list[tuple]]:
        """The full load of one etcd snapshot: a node per description (not placeable), then each node's
        pages in commit order (recency: their records' revisions), filed under the commit records they came from.
        Returns (stale, rejected) ``page_record`` tuples of the pages with an etcd key of their own, for the leader
        to delete. A page of a commit record that cannot stand (its node has no record, or the
        load rejected it) is not returned: its record is rewritten without it (``CommitRecords.adopt``;
        the rewrite comes with the next ``effects``), never deleted with the pages of it that did load. ``held``
        (a warm standby's load, ``metaserver/ha/standby.py``): those pages are appended to it as ``page_record``
        tuples (their commit record's etcd key last), for the copy to file once they can stand."""
        for node_id, (desc, _) in descs.items():
            add_node(self, node_id, desc["capacity"])
            set_placeable(self, node_id, False)
            if desc.get("disk_capacity"):  # its disk tier (metaserver/table/tiers.py)
                self.tiers.disks[node_id] = desc["disk_capacity"]
                self.tiers.add(node_id)
        stale: list[tuple] = [(0, None, "", b"", 0, 0, 0, None, k) for k in pages.junk]
        rejected: list[tuple] = []
        orphans: list[bytes] = []  # commit records with a page of a node that has no record
        reserve(self, len(pages), len(descs))
        linking = self.links.linking
        groups = pages.columns(parents=linking)  # each node's pages as columns (snapshot.NodePages)
        loads = []
        held_at: dict[str, list] = {}  # node id -> its pages for ``held``, joined in the order of ``groups``
        for node_id in list(groups):
            cols = groups.pop(node_id)
            held_at[node_id] = []
            if node_id in self.node_by_id:
                loads.append((node_id, cols))
            else:
                for i in range(len(cols)):
                    p = cols.page(i, node_id, pages)
                    if cols.rec_names[cols.rec[i]] is not None:
                        orphans.append(p[8])
                        held_at[node_id].append(p)
                    else:
                        stale.append(p)
        cols = None

        def file(node_id, cols, staged, distinct) -> None:
            rev = cols.rev
            if len(rev) > 1 and (rev[1:] < rev[:-1]).any():
                cols = cols.take(np.argsort(rev, kind="stable"))
            names = cols.records()
            bad = load_pages(self, node_id, (cols.ns_names, cols.nsix), (cols.dig, cols.longs), cols.off, cols.code,
                             cols.gen, records=names, stamps=cols.rev, parents=cols.parents if linking else None,
                             staged=staged, distinct=distinct)
            rejected.extend(cols.page(i, node_id, pages) for i in bad if names[i] is None)
            if held is not None:
                held_at[node_id].extend(cols.page(i, node_id, pages) for i in bad if names[i] is not None)

        load_nodes(self, loads, file)  # (one key index insert for all the nodes, where that is exact)
        if held is not None:
            for part in held_at.values():
                held.extend(part)
        if orphans:
            self.commits.adopt([], np.zeros(0, np.int64), orphans)
        if pages.carried:  # dead lists read: their records compacted, the lists dropped after (table/commits.py)
            self.commits.adopt_dead(pages.carried, set(pages.batches))
        return stale, rejected


