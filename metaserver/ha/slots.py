"""One slot of a pool: its etcd keys (``SlotStore``), its node regions (``SlotTable``) and its server
(``SlotServer``, the ``Metaserver`` handlers and duties over that slot alone); the membership role
(``MembershipServer``); the ranking that spreads slots over processes (``rank``).

A pool is always slots (``metaserver/ha/partition.py`` runs one process of it, ``metaserver/ha/election.py`` elects its
slots): it cuts the key space into S slots, slot = ``slotrules.slot_of(ns, key, S, rule)`` (the pool's rule). Each
slot is a whole directory of its own: a ``SlotServer`` is a ``Metaserver`` whose store, leadership and directory are
the slot's, so allocation, commit, lookup, expiry, eviction, node loss, warm standby and takeover are one code, per
slot.

A one-slot pool (the default) is the unpartitioned pool: its slot's store keeps the unpartitioned keys
(``SlotStore(at_root=True)``: pages under ``{prefix}/pages/``, ``{prefix}/gen``, ``{prefix}/open``, and the slot key
``{prefix}/leader``, which earlier releases campaigned on), its server owns the nodes (``owns_nodes``: REGISTER_NODE,
HEARTBEAT, node leases and records, and the node's single capability epoch, ``gens.issued_below``), its table is a
plain ``TableDirectory`` over whole arenas, and nothing below about regions, SLOT_EPOCH or FENCE applies to it.

etcd layout of a pool of S > 1 slots under ``prefix`` (next to ``nodes/`` and ``arenas/``, which the membership
leader writes)::

    {prefix}/slots/count              decimal S, written once when the pool is created
    {prefix}/slots/rule               decimal slot rule (``slotrules``), written just before the count; absent: 1
    {prefix}/slotmap/{s}              slot s's leader address, under that process's lease (``m``: membership)
    {prefix}/members/{addr}           msgpack {"addr", "warm": [slots whose warm copy is loaded]}, same lease
    {prefix}/slots/{s}/pages/{ns}/+{term}.{n}   slot s's READY pages (commit records, as ``persist.py`` writes them)
    {prefix}/slots/{s}/gen            slot s's generation counter
    {prefix}/slots/{s}/open           the open allocations a leader that gave slot s up handed on (``handoff.py``)

Fencing is per slot, as in a one-slot pool: every write of slot s compares ``create_revision(slotmap/{s})`` with the
revision its leader won at. Generations are unique across slots without coordination: slot s counts from
``(s << 52) + 1`` (at most 1024 slots, 2^52 generations each).

Node space: slot s of S allocates and evicts only in region s of every node, ``[ARENA_DATA_START + s * R,
+ R)`` with ``R = capacity // S`` rounded down to 4 KiB, so two slots never hand out the same bytes. Keys hash
uniformly, so every slot sees a uniform sample of the workload and per-slot LRU approximates the pool's LRU; an
object larger than R cannot be stored (slabs handed to slots on demand are the refinement). In a slot's table
(``SlotTable``) each node's allocator *is* the region (``PageTable.node_region``): placement, eviction,
drain and the full load never see bytes outside it (``tests/unit/test_slottable.py``).

What a slot leader does not own: node leases and arena records (the membership leader, ``MembershipServer``: nodes
register and heartbeat there; every slot leader follows the leased ``nodes/`` records instead, ``sync_nodes``),
and the unpartitioned write-capability epoch: a node's one epoch cannot order S slots' terms, so a slot leader's
capabilities carry ``slotrules.SLOT_EPOCH | g`` (g: the slot's generation floor at its takeover, increasing across the
slot's terms) and the node keeps one floor per slot, i.e. per region of its arena. A new slot leader FENCEs every
node (in an open pool those that say ``acks_floor``) before it places on it (``metaserver/ha/fence.py``): the deposed
leader's capabilities and writes, in flight ones included, die at the takeover, not at their deadline; a node the
fence did not reach is not placed on by this slot until one does.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time

from metaserver.store.combine import TxnCombiner
from metaserver.ha.fence import fence_nodes
from metaserver.handlers.turns import AllocTurn, LookupTurn
from metaserver.store.generations import GenCounter
from metaserver.store.persist import EtcdStore
from metaserver.ha.service import ETCD_START_DEADLINE_S, Metaserver
from metaserver.table.directory import TableDirectory
from transport import slotrules
from transport.wire import Op, Status
from umbp.config import MetaserverConfig
from umbp.errors import NotLeader, StartupError, Unavailable
from umbp.quotarules import QuotaRules

log = logging.getLogger("umbp.metaserver")

FENCE_RETRY_S = 1.0  # a node a fence did not reach is tried again this often (not placed on meanwhile)
GIVE_UP_TRIES = 200  # deleting a given-up slot's key: tries at most (backoff 0.1 s doubling to 2 s: over 6 minutes)
MEMBERSHIP = "m"  # the slot-like role that keeps node leases and arena records
GEN_SHIFT = slotrules.SLOT_GEN_SHIFT


def _score(name: str, addr: str) -> bytes:
    return hashlib.blake2b(f"{name}|{addr}".encode(), digest_size=8).digest()


def rank(name: str, members: list[str]) -> list[str]:
    """Rendezvous order of ``members`` for role ``name`` (the membership role; page slots use ``ranking``).
    O(members)."""
    return sorted(members, key=lambda addr: _score(name, addr), reverse=True)


def _balanced(slots: int, members: tuple[str, ...]) -> list[str]:
    """The leader of each page slot: rendezvous pairs taken best first, a process taking floor(S/N) slots, or one
    more while fewer than S mod N processes have taken that many, so every process leads floor or ceil of S/N
    (plain rendezvous gave 4 processes 6, 5, 3 and 2 of 16, and every batch waited on the busiest). The caps add
    up to S and every slot is paired with every process, so every slot gets a leader. O(S N log(S N))."""
    low, big = divmod(slots, len(members))
    pairs = sorted(((_score(str(s), a), s, a) for s in range(slots) for a in members), reverse=True)
    out: list[str | None] = [None] * slots
    load = dict.fromkeys(members, 0)
    for _, s, a in pairs:
        if out[s] is not None or load[a] > low or (load[a] == low and not big):
            continue
        if load[a] == low:
            big -= 1
        out[s] = a
        load[a] += 1
    return out  # type: ignore[return-value]


def _successors(slots: int, members: tuple[str, ...], lead: list[str], without: dict) -> list[str]:
    """Each page slot's successor (the process that keeps its warm copy and takes it over first), never its leader:
    the slot's leader in ``_balanced`` over the members without its leader (``without``), so that after a death the
    slot is where the survivors' own map puts it, while that process keeps at most floor or ceil of S/N copies as
    ``_balanced`` caps leaders; the other slots go to the process with fewest copies (ties: rendezvous), and a last
    pass moves copies from the busiest to the idlest process while they differ by two or more. A copy costs its
    process about half of leading the slot (``bench/warmcopy.py``), and every batch waits on its busiest process:
    successors taken from the removal maps alone gave 4 processes 2, 2, 0 and 0 copies of 4 slots, 8 processes
    2 to 20 of 64. Slots whose successor is not the survivors' leader (10-30 %) move once more after a death, warm
    (partition.py's handover). O(S N), the last pass O(S^2) at worst."""
    low, big = divmod(slots, len(members))
    copies = dict.fromkeys(members, 0)
    out: list[str] = [""] * slots
    rest = []
    for s in range(slots):
        a = without[lead[s]][s]
        if copies[a] < low or (copies[a] == low and big):
            big -= copies[a] == low
            out[s] = a
            copies[a] += 1
        else:
            rest.append(s)
    for s in rest:
        a = min((m for m in members if m != lead[s]), key=lambda m, s=s: (copies[m], _score(str(s), m)))
        out[s] = a
        copies[a] += 1
    for _ in range(slots):  # each move narrows the spread between the busiest and the idlest
        hi = max(members, key=lambda m: (copies[m], m))
        lo = min(members, key=lambda m: (copies[m], m))
        if copies[hi] - copies[lo] < 2:
            break
        s = next((s for s in range(slots) if out[s] == hi and lead[s] != lo), None)
        if s is None:
            break
        out[s] = lo
        copies[hi] -= 1
        copies[lo] += 1
    return out


@functools.lru_cache(maxsize=16)
def ranking(slots: int, members: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Per page slot, the order of ``members`` (sorted, no duplicates): [leader, successor, the rest by
    rendezvous]. The leaders are ``_balanced`` over ``members``; successors are ``_successors``: balanced too, and
    mostly the slot's leader in ``_balanced`` over the members without its leader, so when a process dies each of
    its slots goes to the process that kept its warm copy (``partition.py`` lets a warm copy campaign first), its
    slots spread over the survivors evenly, and most stay there. Every process computes the same orders from the
    same member list, with no coordinator. A removal can also move a slot or two of the survivors (1-2 on average
    for 16-64 slots over 2-8 processes): those are handed over warm (the new leader loads its copy first), as a
    join's share is. Cached per member list; O(N) balanced assignments."""
    if not members:
        return tuple(() for _ in range(slots))
    lead = _balanced(slots, members)
    if len(members) > 1:
        without = {a: _balanced(slots, tuple(m for m in members if m != a)) for a in members}
        succ = _successors(slots, members, lead, without)
    out = []
    for s in range(slots):
        order = [lead[s]] + ([succ[s]] if len(members) > 1 else [])
        order += [a for a in rank(str(s), list(members)) if a not in order]
        out.append(tuple(order))
    return tuple(out)


def leaders(slots: int, members) -> list[str]:
    """The leader ``ranking`` gives each page slot over ``members`` (any order): the map a settled pool shows."""
    return [order[0] for order in ranking(slots, tuple(sorted(set(members))))]


region = slotrules.slot_region  # (base, size) of slot s's region of a node arena (the node checks capabilities by it)


class SlotStore(EtcdStore):
    """``EtcdStore`` over one slot's keys, sharing the process's etcd client (``close`` leaves it open). Node and
    arena records are read from the pool's ``nodes/`` and ``arenas/``; a slot leader never writes them: its arena
    deletes (a lost node's, in ``rejoin.py``) go to a key of its own that nothing reads."""

    def __init__(self, root: EtcdStore, name: str, owns_nodes: bool, combiner: TxnCombiner | None = None,
                 at_root: bool = False):
        self.addr, self.prefix, self.client, self.timeout_s = root.addr, root.prefix, root.client, root.timeout_s
        self.combiner = combiner  # the process's (metaserver/store/combine.py): one transaction for several slots' writes
        # ``at_root``: slot 0 of a one-slot pool keeps the unpartitioned layout (see the module docstring)
        base = f"{root.prefix}/" if at_root else f"{root.prefix}/slots/{name}/"
        self._pages = (base + "pages/").encode()
        self._nodes, self._arenas = root._nodes, root._arenas
        self.gen_key = (base + "gen").encode()
        self.open_key = (base + "open").encode()
        self.leader_key = root.leader_key if at_root else f"{root.prefix}/slotmap/{name}".encode()
        self.fence_rev = 0
        self.on_fenced = None
        self._sink = None if owns_nodes else (base + "arena-not-owned/").encode()

    def arena_key(self, node_id: str) -> bytes:
        return super().arena_key(node_id) if self._sink is None else self._sink + node_id.encode()

    async def write(self, items: list) -> None:
        if self.combiner is None:
            return await super().write(items)
        return await self.combiner.write(self, items)

    async def close(self) -> None:
        return None  # the process's client is closed by the partition


def own_parents(slot: int, slots: int, ns: str, parents: list | None, keys=(), rule: int = slotrules.RULE_DIGEST
                ) -> list | None:
    """An ALLOC's ``parents`` with those of other slots left out (None): they are never linked in this slot, so a
    page naming one would count as an orphan under ``prefix-lru`` and go first (it cost that policy 54 points of
    hit rate on bench/eviction.py); without it the page is ordinary, evicted by recency. A parent that is one of the
    ALLOC's ``keys`` is of this slot (its keys are checked to be); the others' slots are one array (``slots_of``
    under the pool's rule), none when every parent is a key or nil (a chain: a multi-slot ALLOC's parts come with
    those of other slots already left out, ``multislot.split``)."""
    if not parents:
        return parents
    mine = set(keys)
    at = [i for i, p in enumerate(parents) if p is not None and p not in mine]
    if not at:
        return parents
    out = list(parents)
    for i, s in zip(at, slotrules.slots_of(ns, [parents[i] for i in at], slots, rule).tolist()):
        if s != slot:
            out[i] = None
    return out


class SlotTable(TableDirectory):
    """A slot's page table: every node's allocator is the slot's region of that node's arena
    (``node_region``: ``region``), so its ALLOC, eviction, drain and load place, free and accept extents there only,
    and a page of the other slots' regions is rejected by its load; parents of other slots are left out at ALLOC
    (``own_parents``)."""

    def __init__(self, slot: int, slots: int, rule: int = slotrules.RULE_DIGEST, **kw):
        super().__init__(**kw)
        self.slot, self.slots, self.rule = slot, slots, rule

    def node_region(self, capacity: int) -> tuple[int, int]:
        return region(self.slot, self.slots, capacity)

    def own_parents(self, ns: str, parents: list | None, keys=()) -> list | None:
        return own_parents(self.slot, self.slots, ns, parents, keys, self.rule)


class SlotLeadership:
    """What ``Metaserver`` reads of its election, for one slot led by a partition's process (``is_leader``,
    ``leader_addr``, ``addr``, ``revision``); the partition's campaign loop sets it."""

    def __init__(self, partition, name: str):
        self.partition = partition
        self.name = name
        self.addr = partition.addr
        self.revision = 0
        self.won = False

    @property
    def is_leader(self) -> bool:
        return self.won and self.partition.lease_valid()

    @property
    def leader_addr(self) -> str | None:
        return self.addr if self.won else self.partition.holder(self.name)

    async def resign(self) -> None:
        await self.partition.resign(self.name)


class SlotServer(Metaserver):
    """The metaserver's handlers and duties over one slot (see the module docstring). Built by the partition, whose
    election rounds (``metaserver/ha/election.py``) call ``_elected``/``_deposed``/``_standing_by``, which routes
    requests to it and feeds it the pool's node records (``sync_nodes``). ``owns_nodes``: the membership role, or
    slot 0 of a one-slot pool, which registers nodes itself and hands out the node's single capability epoch."""

    def __init__(self, config: MetaserverConfig, partition, name: str):
        self.partition = partition
        self.name = name
        self.slot = int(name) if name != MEMBERSHIP else -1
        one = partition.slots == 1
        self.owns_nodes = self.slot < 0 or one
        store = SlotStore(partition.store, name, owns_nodes=self.owns_nodes,
                          combiner=None if one else getattr(partition, "combiner", None), at_root=one)
        super().__init__(config, store, SlotLeadership(partition, name), partition.metrics)
        self.handlers[Op.ALLOC] = self.alloc  # the slot's own refusals first, then the data plane's ALLOC
        self.lookups = LookupTurn(self, partition.turns_due)  # a turn's LOOKUPs, answered together
        self.allocs = AllocTurn(self, partition.turns_due)  # and its ALLOCs

    def _new_state(self) -> None:
        super()._new_state()
        first = (self.slot << GEN_SHIFT) + 1 if self.slot >= 0 else 1
        self.gens = GenCounter(self.store, first=first)
        self.epoch = 0  # this term's write-capability epoch (slotrules.SLOT_EPOCH | generation floor at the takeover)
        self.unfenced: dict[str, str] = {}  # node id -> why this term's FENCE has not reached it (not placed on)
        self.fenced: dict[str, tuple] = {}  # node id -> (arena id, pid) this term's FENCE reached
        self._fenced_at = 0.0

    async def _elected(self, revision: int) -> None:
        """Today's takeover, then (a page slot) this term's epoch on every node and, in a closed pool, the FENCE
        that kills the slot's earlier capabilities on every node, before the partition starts serving the slot."""
        await super()._elected(revision)
        if self.owns_nodes:
            return
        self.epoch = slotrules.SLOT_EPOCH | self.gens.issued_below
        for node in self.members.nodes.values():
            node.cap_epoch = self.epoch
        await self.fence(list(self.members.nodes.values()))

    async def fence(self, nodes: list) -> None:
        """FENCE ``nodes`` at this term's epoch (closed pools, and in open pools the nodes that say ``acks_floor``;
        bounded by ``fence.FENCE_TIMEOUT_S``): a node not reached is taken out of this slot's placement until a later
        fence reaches it (``tick`` retries)."""
        if not self.tokens.closed:
            nodes = [n for n in nodes if n.acks_floor]
        if self.owns_nodes or not nodes:
            return
        self._fenced_at = time.monotonic()
        failed = await fence_nodes(nodes, self.epoch, self.partition.slots, getattr(self.cfg, "tls_ca", ""))
        for n in nodes:
            why = failed.get(n.node_id)
            if why:
                if n.node_id not in self.unfenced:
                    log.warning("metaserver: slot %s: node %s not fenced (%s): not placed on until it is",
                                self.name, n.node_id, why)
                self.unfenced[n.node_id] = why
                self.dir.set_placeable(n.node_id, False)
            else:
                self.fenced[n.node_id] = (n.arena_id, n.pid)
                if self.unfenced.pop(n.node_id, None) is not None and not n.draining:
                    self.dir.set_placeable(n.node_id, True)

    def _give_up(self, reason: str) -> None:
        """This slot's writer dropped writes (``Metaserver._writes_dropped``): step down and delete the slot's key
        (``_release_key``), so the next term has a new fence revision and loads what etcd holds."""
        self.partition._spawn(self._release_key(reason))

    async def _release_key(self, reason: str) -> None:
        """Stop serving the slot, then delete its key, fenced on this term, retrying while etcd is away. Ends when
        the key is deleted, no longer this term's (NotLeader), or the process lease lapsed (its keys go with it).
        Meanwhile the slot counts as being deposed, so the election round does not take the key up again under
        this term (``Partition._adopt_unserved``)."""
        p, store = self.partition, self.store
        p._deposing.add(self.name)
        try:
            if self.leader.won or self.loaded:
                self.leader.won = False
                log.warning("metaserver: slot %s: stepping down: %s", self.name, reason)
                await self._deposed(reason)
            delay = 0.1
            for _ in range(GIVE_UP_TRIES):
                try:
                    if await store.txn([store.op_delete(store.leader_key)]):
                        log.info("metaserver: slot %s: key deleted: the next term loads from etcd", self.name)
                        return
                except NotLeader:
                    return
                except Unavailable as e:
                    log.warning("metaserver: slot %s: giving the slot up: %s", self.name, e)
                if not p.lease_valid():
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        finally:
            p._deposing.discard(self.name)

    async def _deposed(self, reason: str) -> None:
        """Every caller stops a term that was won or loaded (``election.py``, ``_release_key``)."""
        await super()._deposed(reason)
        if self.partition.slots == 1:
            print(f"metaserver: standby, stepped down ({reason})", flush=True)  # the one-slot pool's line

    def tick(self, now: float) -> int:
        if self.unfenced and self.serving and now - self._fenced_at >= FENCE_RETRY_S:
            self._fenced_at = now
            nodes = [n for i in self.unfenced if (n := self.members.get(i)) is not None and n.alive]
            if nodes:
                self._spawn(self.fence(nodes))
        return super().tick(now)

    def _make_dir(self) -> TableDirectory:
        if self.owns_nodes:
            return super()._make_dir()
        cfg = self.cfg
        kw = dict(pending_ttl_s=cfg.pending_ttl_s, read_lease_s=cfg.read_lease_s, policy=cfg.eviction_policy,
                  quotas=QuotaRules.of(getattr(self.tokens, "quota_rules", None)).shared(
                      self.partition.slots))  # each slot leader enforces its share of every quota
        return SlotTable(self.slot, self.partition.slots, self.partition.rule, namer=self.store.batch_name, **kw)

    def _provisional_nodes(self, descs: dict, now: float) -> None:
        super()._provisional_nodes(descs, now)
        if self.partition.slots == 1:
            return  # slot 0 of a one-slot pool keeps the nodes' leases itself, as the unpartitioned leader did
        for node in self.members.nodes.values():
            node.lease_id = 0  # the membership leader's lease: a slot leader never revokes it

    def alloc(self, meta, conn, defer: bool = True):
        """ALLOC (its entry in ``handlers``): refused as a retry while this slot has no node to place on yet; then
        the data plane's (``defer``: whether it may wait for the end of the turn: ``DataPlane.alloc``)."""
        if not self.owns_nodes and not self.dir.spaces:
            # No node record has reached this slot yet (it took over before the nodes registered, and the next
            # round brings them): a retry, not a full pool.
            raise Unavailable("metaserver", f"slot {self.name}: no storage node known yet", Status.UNAVAILABLE)
        if self.unfenced and not any(sp.placeable for sp in self.dir.spaces.values()):
            # Nodes new to this term wait for their FENCE (a round trip, retried every tick): a retry, not a full
            # pool.
            raise Unavailable("metaserver", f"slot {self.name}: storage nodes not fenced yet ({len(self.unfenced)})",
                              Status.UNAVAILABLE)
        return self.dataplane.alloc(meta, conn, defer)

    def sync_nodes(self, live: dict[str, dict], now: float) -> None:
        """The pool's leased node records (node id -> description) as the membership leader keeps them: a node
        with one is alive here (its 'heartbeat'), a new or re-registered one gets its region (kept pages when it is
        the same arena, as ``register_node`` decides); a node whose record went stops being refreshed and is lost
        after its ``lease_ttl`` (parked, then dropped, as a node lost by its owner is). O(nodes)."""
        if not self.serving or self.owns_nodes:
            return
        for node_id, desc in live.items():
            node = self.members.get(node_id)
            if (node is not None and node.alive and not node.provisional and node.arena_id == desc["arena_id"]
                    and node.capacity == desc["capacity"] and node.pid == desc.get("pid", node.pid)
                    and node.disk_id == desc.get("disk_id")):
                node.last_heartbeat = now
                continue
            old_disk = (node.disk_id, node.disk_capacity) if node is not None else None
            node, keep = self.members.register(desc, now)
            node.cap_key = self.tokens.cap_key(node.node_id, node.arena_id)
            node.cap_epoch = self.epoch
            same_disk = self.rejoin.disk_registered(node, old_disk, keep)  # its disk tier (handlers/rejoin.py)
            node.lease_id = 0
            node.provisional = False
            self._check_settled()
            if keep and node.node_id in self.dir.spaces:
                self.dir.set_placeable(node.node_id, True)
            else:
                self.rejoin.finish_drop(node.node_id)
                _, fx = self.dir.drop_space(node.node_id, disk=not same_disk)  # a disk outlives its arena
                self._apply(fx)
                self.dir.add_space(node.node_id, node.capacity)
                self.rejoin.unpark(node)
            if (self.tokens.closed or node.acks_floor) and self.fenced.get(node.node_id) != (node.arena_id, node.pid):
                # a node new to this term, or restarted (its floors are gone): fenced before it is placed on
                self.unfenced[node.node_id] = "not fenced yet"
                self.dir.set_placeable(node.node_id, False)
                self._fenced_at = 0.0


class MembershipServer(SlotServer):
    """The membership leader: REGISTER_NODE and HEARTBEAT as a one-slot pool's server takes them (node leases,
    ``nodes/`` and ``arenas/`` records), no pages. Its registrations answer epoch 0 (see the module docstring)."""

    def __init__(self, config: MetaserverConfig, partition):
        super().__init__(config, partition, MEMBERSHIP)

    def register_node(self, meta, conn):
        res = super().register_node(meta, conn)
        for node in self.members.nodes.values():
            node.cap_epoch = 0
        return res

    def sync_nodes(self, live: dict[str, dict], now: float) -> None:
        return None  # nodes register here


async def pool_slots(config: MetaserverConfig) -> tuple[int, int]:
    """The slot count and slot rule (``slotrules``) of the pool at ``config.etcd_prefix`` ((1, RULE_DIGEST):
    unpartitioned), creating them on first use with ``config.slots`` and ``RULE_DIGEST``. The rule is written before
    the count, so whoever reads a count reads its pool's rule; a count without a rule is a pool made before rule 2
    (``RULE_KEY_HASH``). Raises StartupError when the flag contradicts the pool or the rule is one this release
    does not know."""
    store = EtcdStore(config.etcd, config.etcd_prefix)
    try:
        await store.wait_ready(ETCD_START_DEADLINE_S)
        key = f"{store.prefix}/slots/count".encode()
        rule_key = f"{store.prefix}/slots/rule".encode()
        cur = await store.get_value(key)
        if cur is None and config.slots > 1:
            if await store.get_value(store.gen_key) is not None:
                raise StartupError("metaserver", f"the pool at {store.prefix} was created unpartitioned: it cannot "
                                                 f"take --slots {config.slots}")
            await store.compare_and_put(rule_key, str(slotrules.RULE_DIGEST).encode(), None)
            await store.compare_and_put(key, str(config.slots).encode(), None)
            cur = await store.get_value(key)
        n = int(cur) if cur is not None else 1
        if config.slots and config.slots != n:
            raise StartupError("metaserver", f"the pool at {store.prefix} has {n} slots, not --slots {config.slots} "
                                             f"(fixed when the pool was created)")
        if n == 1:
            return 1, slotrules.RULE_DIGEST
        raw = await store.get_value(rule_key)
        rule = int(raw) if raw is not None and raw.isdigit() else slotrules.RULE_KEY_HASH if raw is None else 0
        if rule not in slotrules.RULES:
            raise StartupError("metaserver", f"the pool at {store.prefix} places keys by slot rule {raw!r}, which "
                                             f"this release does not know (it knows {slotrules.RULES}): upgrade it")
        return n, rule
    finally:
        await store.close()
