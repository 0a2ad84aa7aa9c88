"""One metaserver process of a pool: its slot servers and the request routing. A pool is always slots, one by
default; the process's election (its lease, the rounds that win, keep, hand over and give up slots, the warm copies
it keeps) is ``metaserver/ha/election.py``'s, one mechanism for every pool. The process-level answers of a pool of
several slots (LEADER with the slot map, STATS/NODES/LIST/EVICT/DRAIN over the slots it leads) are
``metaserver/ha/partanswers.py``'s (``ProcessAnswers``, held as ``answers``).

A one-slot pool (the default) answers as the unpartitioned metaserver always did: its slot-0 server
(``membership``) owns the nodes and keeps the unpartitioned etcd layout (``metaserver/ha/slots.py``) and answers
every request itself, so nodes, clients and the wire see what they saw; a standby (a process that leads no slot yet)
answers NOT_LEADER with the leader's address (``server.py``).

A pool of several slots routes each keyed request to its slot's server (by the keys' slot, a named ``slot``, or
``parts``: ``metaserver/ha/multislot.py``); the membership role ``m`` owns the nodes. Requests for a slot served
elsewhere are answered NOT_LEADER naming the slot's leader (``leader``) and the slot (``slot``): a client learns the
map from LEADER and from these answers (Redis' MOVED).

Costs: routing O(keys) hashing per request of a pool of several slots (none with ``slot`` or ``parts``, none in a
one-slot pool); the election's are ``election.py``'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from metaserver.ha import multislot
from metaserver import validate as v
from metaserver.store.combine import TxnCombiner
from metaserver.ha.election import RANK_DELAY_S, ElectedProcess  # noqa: F401 - RANK_DELAY_S: the pool's constant
from metaserver.store.fullload import node_descs
from metaserver.handlers.metrics import MetaserverMetrics
from metaserver.handlers.turns import Later, release_turn
from metaserver.handlers.ownership import HeldLeases, release_answer, release_held, release_ids
from metaserver.ha.partanswers import ProcessAnswers
from metaserver.store.persist import EtcdStore
from metaserver.ha.slots import MEMBERSHIP, MembershipServer, SlotServer
from transport import slotrules
from transport.wire import Op, Status
from umbp.auth import Tokens
from umbp.config import MetaserverConfig

log = logging.getLogger("umbp.metaserver")

_KEYED = (Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.EXISTS, Op.PREFIX, Op.REMOVE)


class SlotConn:
    """A connection as one slot server sees it: the peer's authentication, but its own PENDING allocations and read
    leases (ownership is per directory)."""

    __slots__ = ("conn", "pending", "leases")
    in_turns = True  # as the server's connections: a turn's LOOKUPs and ALLOCs together (metaserver/handlers/turns.py)

    def __init__(self, conn):
        self.conn = conn
        self.pending: dict = {}  # (ns, key, gen) -> row, as ``Conn.pending``
        self.leases = HeldLeases()

    @property
    def auth(self):
        return self.conn.auth

    @property
    def closed(self) -> bool:
        return self.conn.closed

    @property
    def version(self) -> int:
        return self.conn.version

    @property
    def peer(self) -> str:
        return self.conn.peer


class _Leadership:
    """What ``metaserver.server.Connection`` and the metrics read of ``ms.leader``: the membership role's (slot 0's
    in a one-slot pool)."""

    def __init__(self, p: "Partition"):
        self.p = p
        self.first_round = asyncio.Event()

    @property
    def addr(self) -> str:
        return self.p.addr

    @property
    def leader_addr(self) -> str | None:
        return self.p.membership.leader.leader_addr

    @property
    def revision(self) -> int:
        return self.p.membership.leader.revision

    @property
    def is_leader(self) -> bool:
        return self.p.membership.serving


class Partition(ElectedProcess):
    """The process: its slot servers and the request routing; its lease and election rounds are
    ``ElectedProcess``'s."""

    def __init__(self, config: MetaserverConfig, advertise: str, slots: int, rule: int = slotrules.RULE_DIGEST):
        self.cfg = config
        self.addr = advertise
        self.slots = slots
        self.rule = rule  # the pool's slot rule (transport/slotrules.py), fixed at its creation
        self.store = EtcdStore(config.etcd, config.etcd_prefix, config.etcd_timeout_s)
        self.combiner = TxnCombiner(self.store, config.persist_batch)  # the slots' etcd writes, combined
        self.tokens = Tokens.load(config.token, config.tokens_file, "metaserver")
        self.leader = _Leadership(self)
        self.metrics = MetaserverMetrics(self)
        self._init_election()
        self.turns_due: set = set()  # slot servers' turns with requests waiting (metaserver/handlers/turns.py)
        self.answer_nodes = multislot.AnswerNodes()  # the nodes merged LOOKUP answers name
        self.page_slots = [str(s) for s in range(slots)]
        self.names = self.page_slots + ([MEMBERSHIP] if slots > 1 else [])
        self.servers: dict[str, SlotServer] = {s: SlotServer(config, self, s) for s in self.page_slots}
        if slots > 1:
            self.servers[MEMBERSHIP] = MembershipServer(config, self)
        self.membership: SlotServer = self.servers[MEMBERSHIP if slots > 1 else "0"]  # owns the nodes
        self._load_s = 0.0
        m = self.membership
        self.answers = a = ProcessAnswers(self)  # LEADER, STATS, NODES, LIST, EVICT, DRAIN of the process
        if slots == 1:
            self.handlers = dict(m.handlers)  # the unpartitioned answers; a standby's NOT_LEADER is server.py's
            self.handlers[Op.LOOKUP] = functools.partial(self._lookup_releasing, m.handlers[Op.LOOKUP], m.release)
            return
        self.handlers = {op: self._keyed(op) for op in _KEYED}
        self.handlers.update({
            Op.HELLO: m.hello, Op.AUTH: m.authenticate, Op.PING: m.ping, Op.LEADER: a.leader_info,
            Op.REGISTER_NODE: self._membership(Op.REGISTER_NODE), Op.HEARTBEAT: self._membership(Op.HEARTBEAT),
            Op.RELEASE: self.release, Op.STATS: a.stats, Op.NODES: a.nodes, Op.LIST: a.list_objects,
            Op.EVICT: a.evict, Op.DRAIN: a.drain,
        })

    # -- what server.py and the metrics read -------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """A one-slot pool's process serves while it leads the slot; a pool of several slots routes (or answers
        NOT_LEADER) per slot, so its process always 'serves'."""
        return self.slots > 1 or self.membership.serving

    @property
    def writer(self):
        return self.membership.writer

    @property
    def dir(self):
        return self.membership.dir

    @property
    def ticks(self) -> int:
        return sum(srv.ticks for srv in self.servers.values())

    @property
    def load_s(self) -> float:
        """The last takeover's directory load (one slot), or the longest slot campaign so far."""
        return self.membership.load_s if self.slots == 1 else self._load_s

    @load_s.setter
    def load_s(self, value: float) -> None:
        self._load_s = value

    def led(self) -> list[str]:
        return [s for s in self.page_slots if self.servers[s].serving]

    # -- nodes -------------------------------------------------------------------------------------------------
    _nodes_at = 0.0

    def _nodes_due(self) -> bool:
        return self.slots > 1 and any(self.servers[s].serving for s in self.page_slots)

    async def _sync_nodes(self, now: float, names: list[str] | None = None) -> None:
        """Feed the served slots (or ``names``) the pool's leased node records (the membership leader's)."""
        live = await self.store._records(self.store._nodes)
        descs = {nid: d for nid, (d, lease) in node_descs(live, []).items() if lease}
        for s in names or self.page_slots:
            self.servers[s].sync_nodes(descs, now)

    # -- routing -----------------------------------------------------------------------------------------------
    def _moved(self, name: str) -> v.Reject:
        holder = self.holder(name)
        if holder == self.addr:
            return v.Reject(f"slot {name} is taking over here; not serving yet", Status.UNAVAILABLE)
        return v.Reject(f"slot {name} is led by {holder or 'nobody yet'}", Status.NOT_LEADER, leader=holder,
                        slot=int(name) if name != MEMBERSHIP else -1)

    def _slot_conn(self, conn, name: str) -> SlotConn:
        sc = conn.slot_conns  # (server.Connection's: its views in this process's slots)
        c = sc.get(name)
        if c is None:
            c = sc[name] = SlotConn(conn)
        return c

    def slot_of_request(self, meta: Any) -> str:
        """The slot every key of a request belongs to; BAD_REQUEST when they span several (a request for several
        slots says so with ``parts``: ``metaserver/ha/multislot.py``)."""
        if type(meta) is not dict or type(meta.get("ns")) is not str or type(meta.get("keys")) not in v.KEY_LISTS:
            return "0"  # malformed: slot 0's handler answers with the precise error
        ns, keys = meta["ns"], meta["keys"]
        S = self.slots
        slots = set(slotrules.slots_of(ns, keys, S, self.rule).tolist())
        slots.discard(-1)
        if len(slots) > 1:
            raise v.Reject(f"keys of {len(slots)} slots in one request: a partitioned pool ({S} slots) takes one "
                           f"slot's keys per request unless it names its 'parts'")
        return str(slots.pop()) if slots else "0"

    def named_slot(self, meta: dict, check: bool) -> str:
        """The slot a single-slot request names (``"slot"``, taken out of ``meta``: wire VERSION 10), instead of the
        one its keys hash to. ``check`` (ALLOC: the one request that creates entries) hashes every key and refuses a
        key of another slot, so an entry only ever lives in its key's slot; the other keyed requests trust the name,
        since against the wrong slot they can only miss (``multislot.split``)."""
        s = meta.pop("slot")
        if type(s) is not int or not 0 <= s < self.slots:
            raise v.Reject(f"'slot' must be an int 0..{self.slots - 1}, got {s!r}")
        if check and type(meta.get("ns")) is str and type(meta.get("keys")) in v.KEY_LISTS:
            multislot.check_slots(slotrules.slots_of(meta["ns"], meta["keys"], self.slots, self.rule), s, self.rule)
        return str(s)

    def _keyed(self, op: int):
        check = op == Op.ALLOC

        def handle(meta: Any, conn):
            if op == Op.LOOKUP:
                return self._lookup_releasing(keyed, self.release, meta, conn)
            return keyed(meta, conn)

        def keyed(meta: Any, conn):
            if type(meta) is dict and "parts" in meta:
                return multislot.dispatch(self, op, meta, conn)  # several slots' keys in one request
            name = (self.named_slot(meta, check) if type(meta) is dict and "slot" in meta
                    else self.slot_of_request(meta))
            srv = self.servers[name]
            if not srv.serving:
                raise self._moved(name)
            return srv.handlers[op](meta, self._slot_conn(conn, name))
        return handle

    @staticmethod
    def _lookup_releasing(lookup, release, meta: Any, conn) -> Any:
        """``lookup`` of a LOOKUP (single- or multi-slot) with ``"release"``: this connection's lease ids of any of
        this process's slots, process leases of merged LOOKUPs included, released first by ``release`` as a RELEASE
        of them is (a RELEASE frame fewer a get: umbp/releases.py). Every answer says ``"released"`` (how many) and
        ``"release_any"`` (this process takes any of its lease ids here; in a partitioned pool of an earlier release
        a slot's LOOKUP took only that slot's), which tells a client it may. The one place a LOOKUP's ``"release"``
        is taken, for a pool of one slot (``release``: the slot's RELEASE) and of several (the process's)."""
        rel = meta.pop("release", None) if type(meta) is dict else None
        n = release({"leases": rel}, conn)["released"] if rel is not None else 0
        ans = lookup(meta, conn)
        if type(ans) is dict:
            ans["released"] = n
            ans["release_any"] = True
        elif type(ans) is Later:
            ans.extra = {"released": n, "release_any": True}
        return ans

    def _membership(self, op: int):
        def handle(meta: Any, conn):
            srv = self.membership
            if not srv.serving:
                raise self._moved(MEMBERSHIP)
            return srv.handlers[op](meta, conn)
        return handle

    def release(self, meta: Any, conn) -> dict:
        """RELEASE on the slots that gave the leases (each slot's leases are its connection's: ``_slot_conn``); a
        merged LOOKUP's process lease releases every part's (``multislot.release``)."""
        ids = release_ids(meta)
        n, rest = multislot.release(self, conn, ids)
        for name, sc in conn.slot_conns.items() if rest else ():
            mine = [x for x in rest if x in sc.leases]
            if mine and self.servers[name].serving:
                srv = self.servers[name]
                n += release_held(srv.dir, mine, sc, release_turn(srv, conn))
        return release_answer(meta, ids, n)

    def drop_pending(self, conn) -> int:
        if self.slots == 1:
            return self.membership.drop_pending(conn)  # the connection's own PENDING set, as unpartitioned
        multislot.orphan(conn)
        n = 0
        for name, sc in conn.slot_conns.items():
            n += self.servers[name].drop_pending(sc)
        return n
