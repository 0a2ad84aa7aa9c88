"""The client's metaserver layer for a pool of either kind (``MetaRouter``): ``MetaClient``'s interface (``call``,
``submit``/``result``/``forget``, ``send_noreply``, ``close``, ``address``, ``sent``), routing by slot when the pool
is partitioned, so everything above it (puts, gets, ``prefix_hits``, ``mapped``, the engine loaders) is unchanged.

Discovery: the first call asks any configured metaserver LEADER. An answer without ``slots`` (an unpartitioned
pool) makes this a plain ``MetaClient`` for good (one extra round trip per client lifetime, nothing per call).
Otherwise it keeps the slot map (slot -> leader address) and the live processes, and one ``MetaClient`` per
process address that does not follow NOT_LEADER by itself (``follow=False``).

A keyed request (ALLOC, COMMIT, ABORT, LOOKUP, EXISTS, PREFIX, REMOVE) is split by ``slotrules.slots_of`` under the
pool's slot rule (LEADER's ``"slot_rule"``; a metaserver that names none is of a release before rule 2: rule 1) and
the slots' parts are grouped by the process the map names as each slot's leader: one request per process, all in
flight at once (submitted on each process's pipelined connection, then collected): a single-slot request naming its
slot (``"slot"``, wire VERSION 10) when the process gets one slot's keys, a multi-slot one (``parts``:
``metaserver/ha/multislot.py``, answered per part) otherwise. The parts' answers are merged back into key order. A
multi-slot LOOKUP asks for one answer (``"merge": true``): the process's rows for all its parts in one packed column,
one capability a node and one read lease (its failed parts' keys misses, resent as any failed part); a process that
does not know ``merge`` (it refuses the field) is asked per part from then on. Capabilities are concatenated and each
item's ``cap_index`` shifted; the read leases of the slots of one LOOKUP become one handle that RELEASE expands
(or the next LOOKUP: each process its own ids, ``"release"``, where its last answer said ``"release_any"``); PREFIX
becomes EXISTS per slot and the leading run is counted here. A part answered NOT_LEADER (``leader`` named: Redis'
MOVED) is resent there, only that part's keys; a part whose process cannot be reached re-reads the map from any
process (LEADER) and is resent, with a backoff, until the call's deadline: a dead process's slots move within its
lease TTL and the client follows without a restart. Waiting for one process's answer is bounded by half the time
left (at most ATTEMPT_S, at least PART_ATTEMPT_MIN_S), so a process whose host went silent (no RST: a cut cable, a
black hole) leaves the call time to re-read the map from another process and resend there; a call that still runs
out of its deadline on such a process marks it suspect: the next call re-reads the map first, asking the suspects
last.
Admin requests (STATS, NODES, LIST, EVICT, DRAIN) go to every live process and are summed (``slotmap``).

Thread-safe: one lock serialises the router (a client makes one metaserver call per batch).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from transport import keyform, slotrules, wire
from transport.wire import Op, Status
from umbp import lookup
from umbp.errors import DeadlineExceeded, NotLeader, ProtocolError, RemoteError, TransportError, Unavailable
from umbp.metaclient import ATTEMPT_S, MetaClient, Ticket
from umbp.slotmap import merge_nodes, merge_stats, split_by_use

_KEYED = frozenset({Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.EXISTS, Op.PREFIX, Op.REMOVE})
_LISTS = ("keys", "sizes", "parents", "gens")  # the per-key lists of a keyed request
_LEASES_KEPT = 1 << 16  # composite read leases remembered for RELEASE (older ones expired at the metaservers)
_BACKOFF = (0.05, 0.1, 0.2, 0.3, 0.5)
_PART_TRIES = 200  # per slot part; the deadline ends it first in practice
PART_ATTEMPT_MIN_S = 1.0  # one process's answer is awaited at least this long (or to the deadline) before re-routing


class _Part:
    __slots__ = ("slot", "idx", "meta", "addr", "answer")

    def __init__(self, slot: int, idx: list[int], meta: dict):
        self.slot, self.idx, self.meta = slot, idx, meta
        self.addr: str | None = None
        self.answer: Any = None


class _Group:
    """The parts of one request sent to one process (one part: a single-slot request; more: ``parts``)."""

    __slots__ = ("addr", "parts", "ticket")

    def __init__(self, addr: str, parts: list[_Part], ticket: Ticket):
        self.addr, self.parts, self.ticket = addr, parts, ticket


class SlotTicket:
    """A routed request in flight (``MetaRouter.submit``)."""

    __slots__ = ("op", "meta", "parts", "n", "plain", "groups", "unrouted", "merged", "release", "released",
                 "release_any")

    def __init__(self, op: int, meta: Any, parts: list[_Part], n: int, plain: Ticket | None = None):
        self.op, self.meta, self.parts, self.n, self.plain = op, meta, parts, n, plain
        self.groups: list[_Group] = []
        self.unrouted: list[_Part] = []  # parts whose slot has no known leader yet
        self.merged: list[tuple[list[int], dict, str]] = []  # merged LOOKUP answers: (key indices, answer, process)
        self.release: dict[str, list[int]] | None = None  # a LOOKUP's lease ids to give back, by process, until sent
        self.released: list[tuple[str, list[int]]] = []  # those sent inside this LOOKUP's requests
        self.release_any = True  # every process answering this LOOKUP took "release" (its answer said so)


_MERGED = object()  # a part's answer that is in one of its ticket's merged answers


class MetaRouter:
    def __init__(self, addrs: tuple[str, ...] | list[str], component: str = "client", token: str | None = None,
                 tls_ca: str = ""):
        self.component = component
        self.token, self.tls_ca = token, tls_ca
        self.seed = MetaClient(addrs, component, token, tls_ca=tls_ca)
        self.slots = 0  # 0: not discovered yet; 1: unpartitioned (everything goes to ``seed``)
        self.rule = slotrules.RULE_DIGEST  # the pool's slot rule (LEADER's "slot_rule"), read with its slot count
        self.map: list[str | None] = []
        self.members: list[str] = list(addrs)
        self._conns: dict[str, MetaClient] = {}
        self._leases: OrderedDict[int, list[tuple[str, int]]] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.moved = 0  # NOT_LEADER answers followed (tests, observability)
        self.refreshes = 0  # slot map re-reads
        self._suspects: set[str] = set()  # processes that did not answer in time: the map is re-read before a call
        self._no_merge: set[str] = set()  # processes that refused a merged LOOKUP (an older release): asked per part
        self._release_any: set[str] = set()  # processes whose last LOOKUP answer said "release_any"

    # -- MetaClient's interface --------------------------------------------------------------------------------
    @property
    def sent(self) -> dict[int, int]:
        if self.slots <= 1:
            return self.seed.sent
        out = dict(self.seed.sent)
        for c in self._conns.values():
            for op, n in c.sent.items():
                out[op] = out.get(op, 0) + n
        return out

    @property
    def address(self) -> str | None:
        if self.slots <= 1:
            return self.seed.address
        return next((c.address for c in self._conns.values() if c.address), None)

    def close(self) -> None:
        with self._lock:
            self.seed.close()
            for c in self._conns.values():
                c.close()

    def call(self, op: int, meta: Any, deadline: float) -> Any:
        with self._lock:
            self._discover(deadline)
            if self.slots <= 1:
                return self.seed.call(op, meta, deadline)
            if op in _KEYED:
                return self._finish(self._start(op, meta, deadline), deadline)
            if op in (Op.STATS, Op.NODES, Op.LIST, Op.EVICT, Op.DRAIN):
                return self._fan_out(op, meta, deadline)
            return self.seed.call(op, meta, deadline)

    def submit(self, op: int, meta: Any, deadline: float) -> SlotTicket:
        with self._lock:
            try:
                self._discover(deadline)
            except (TransportError, DeadlineExceeded, Unavailable):
                return SlotTicket(op, meta, [], 0)  # result() makes the full call
            if self.slots <= 1 or op not in _KEYED:
                return SlotTicket(op, meta, [], 0, plain=self.seed.submit(op, meta, deadline))
            return self._start(op, meta, deadline)

    def result(self, t: SlotTicket, deadline: float) -> Any:
        with self._lock:
            if t.plain is not None:
                return self.seed.result(t.plain, deadline)
            if not t.parts:
                return self.call(t.op, t.meta, deadline)
            return self._finish(t, deadline)

    def forget(self, tickets) -> None:
        with self._lock:
            for t in tickets:
                if t.plain is not None:
                    self.seed.forget([t.plain])
                self._forget(t)

    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        with self._lock:
            if self.slots <= 1:
                self.seed.send_noreply(op, meta, deadline)
                return
            if op == Op.RELEASE and type(meta) is dict:
                handles = meta["leases"] if type(meta.get("leases")) is list else [meta.get("lease")]
                self._frame(self._by_process(handles), deadline)

    def _by_process(self, handles: list) -> dict[str, list[int]]:
        """The slots' read leases under composite lease ``handles`` (each forgotten here), by process."""
        per: dict[str, list[int]] = {}
        for h in handles:
            for addr, lease in self._leases.pop(h, ()):
                per.setdefault(addr, []).append(lease)
        return per

    def _frame(self, per: dict[str, list[int]], deadline: float) -> None:
        """One RELEASE frame a process for all of its slots' leases in ``per``."""
        for addr, ids in per.items():
            self._conn(addr).send_noreply(Op.RELEASE, {"leases": ids}, deadline)

    # -- the slot map ------------------------------------------------------------------------------------------
    def _discover(self, deadline: float) -> None:
        if self.slots == 0:
            info = self.seed.call(Op.LEADER, {}, deadline)
            self._learn(info)
        elif self._suspects and self.slots > 1:
            self._refresh(deadline)  # a process went silent in an earlier call: its slots may have moved since

    def _learn(self, info: Any) -> None:
        slots = info.get("slots") if type(info) is dict else None
        if type(slots) is not int or slots <= 1:
            self.slots = 1
            return
        rule = info.get("slot_rule", slotrules.RULE_KEY_HASH)  # none said: a release before rule 2, whose pools are 1
        if rule not in slotrules.RULES:
            raise ProtocolError(self.component, f"the pool places keys by slot rule {rule!r}, which this client does "
                                                f"not know (it knows {slotrules.RULES}): upgrade the client")
        self.slots, self.rule = slots, rule
        m = info.get("map")
        if type(m) is list and len(m) == slots:
            self.map = [a if type(a) is str else None for a in m]
        elif len(self.map) != slots:
            self.map = [None] * slots
        members = info.get("members")
        if type(members) is list and members:
            self.members = [a for a in members if type(a) is str]

    def _refresh(self, deadline: float) -> None:
        """Re-read the map from the first process that answers LEADER (every live one knows it)."""
        self.refreshes += 1
        addrs = list(dict.fromkeys(self.members + self.seed.addrs))
        for addr in [a for a in addrs if a not in self._suspects] + [a for a in addrs if a in self._suspects]:
            try:
                info = self._conn(addr).call(Op.LEADER, {}, min(deadline, time.monotonic() + 1.0))
            except (TransportError, DeadlineExceeded, Unavailable, NotLeader):
                continue
            self._suspects.discard(addr)
            self._learn(info)
            if not any(a in self._suspects for a in self.map):
                self._suspects.clear()  # the map moved off them: nothing left to re-read for
            return

    def _conn(self, addr: str) -> MetaClient:
        c = self._conns.get(addr)
        if c is None:
            c = self._conns[addr] = MetaClient([addr], self.component, self.token, tls_ca=self.tls_ca, follow=False)
        return c

    # -- keyed requests ----------------------------------------------------------------------------------------
    def _slots(self, ns: str, keys: list) -> np.ndarray:
        """``slotrules.slots_of`` of the keys; under rule 2 from their digests as this client remembers them
        (``keyform.digest_blob``, which also packs a LOOKUP's: a key it remembers is hashed once, not for each; a key
        its full memory cannot take is hashed for each request, not kept)."""
        if self.rule == slotrules.RULE_DIGEST:
            try:
                blob = keyform.digest_blob(keys)  # (the keys as sent: the metaserver checks an ALLOC's so)
            except TypeError:  # not all bytes: marked -1 one by one
                pass
            else:
                return slotrules.slots_of_digests(np.frombuffer(blob, np.uint64).reshape(-1, 4), self.slots)
        return slotrules.slots_of(ns, keys, self.slots, self.rule)

    def _split(self, op: int, meta: dict) -> list[_Part]:
        """The request's parts, one a slot its keys fall in (ascending), each naming its slot: the keys' slots as
        one array (``slotrules.slots_of`` under the pool's rule), grouped by one stable argsort."""
        ns, keys = meta["ns"], meta["keys"]
        sl = self._slots(ns, keys)
        np.maximum(sl, 0, out=sl)  # -1 (not a key): slot 0 refuses it precisely
        n = len(sl)
        first = int(sl[0]) if n else 0
        if not n or not np.count_nonzero(sl != first):
            m = dict(meta)
            m["slot"] = first  # sent as a single-slot request: the process needs not hash the keys again
            return [_Part(first, list(range(n)), m)]
        order = sl.argsort(kind="stable")
        counts = np.bincount(sl)
        present = counts.nonzero()[0]
        lists = [(k, v) for k, v in meta.items() if k in _LISTS and type(v) is list]
        parts, a = [], 0
        for slot, b in zip(present.tolist(), np.cumsum(counts.take(present)).tolist()):
            idx = order[a:b].tolist()
            m = dict(meta)
            for k, v in lists:
                m[k] = [v[i] for i in idx]
            m["slot"] = slot
            parts.append(_Part(slot, idx, m))
            a = b
        return parts

    def _start(self, op: int, meta: Any, deadline: float) -> SlotTicket:
        asked, release = meta, None
        if op == Op.LOOKUP and type(meta) is dict and "release" in meta:  # composite leases to give back first
            release = self._by_process(meta["release"])
            meta = {k: x for k, x in meta.items() if k != "release"}
        if type(meta) is not dict or type(meta.get("keys")) is not list or type(meta.get("ns")) is not str:
            if release:
                self._frame(release, deadline)
            return SlotTicket(op, meta, [], 0, plain=self.seed.submit(op, meta, deadline))
        parts = self._split(op, meta)
        t = SlotTicket(op, asked, parts, len(meta["keys"]))  # (asked: a refused "release" is seen by ReleasingMeta)
        t.release = release
        self._send(Op.EXISTS if op == Op.PREFIX else op, t, parts, deadline)
        return t

    def _send(self, op: int, t: SlotTicket, parts: list[_Part], deadline: float) -> None:
        """Submit ``parts`` grouped by the process the map names for each slot: one request per process (a
        single-slot request when it gets one part, a multi-slot one with ``parts`` otherwise)."""
        by: dict[str, list[_Part]] = {}
        t.groups, t.unrouted = [], []
        for p in parts:
            addr = self.map[p.slot] if p.slot < len(self.map) else None
            if addr is None:
                t.unrouted.append(p)
                continue
            p.addr = addr
            by.setdefault(addr, []).append(p)
        for addr, ps in by.items():
            meta = ps[0].meta if len(ps) == 1 else self._combine(ps, op == Op.LOOKUP and addr not in self._no_merge)
            ids = t.release.pop(addr, None) if t.release and addr in self._release_any else None
            if ids:  # this process's leases of earlier gets ride in its LOOKUP (umbp/releases.py)
                meta = {**meta, "release": ids}
                t.released.append((addr, ids))
            t.groups.append(_Group(addr, ps, self._conn(addr).submit(op, meta, deadline)))
        if t.release:  # the other processes' leases: a RELEASE frame each, now
            self._frame(t.release, deadline)
        t.release = None

    @staticmethod
    def _combine(ps: list[_Part], merge: bool = False) -> dict:
        """One multi-slot request of several parts (``metaserver/ha/multislot.py``): the per-key lists concatenated
        part after part, ``parts`` saying each one's slot and key count; ``merge``: one LOOKUP answer for them."""
        first = ps[0].meta
        out = {k: x for k, x in first.items() if k != "slot" and (k not in _LISTS or type(x) is not list)}
        for k in _LISTS:
            if type(first.get(k)) is list:
                out[k] = [x for p in ps for x in p.meta[k]]
        out["parts"] = [[p.slot, len(p.idx)] for p in ps]
        if merge:
            out["merge"] = True
        return out

    def _forget(self, t: SlotTicket) -> None:
        """Give up the ticket's requests in flight. Its parts not answered yet become unrouted, so a later
        ``result`` on it (a failed put's unwind asks for the ALLOC that failed) makes their call again, as
        ``MetaClient.result`` does for a request not sent, instead of collecting tickets already given up."""
        for g in t.groups:
            if g.ticket is not None and g.addr in self._conns:
                self._conns[g.addr].forget([g.ticket])
            g.ticket = None
        t.unrouted = [p for p in t.parts if p.answer is None]
        t.groups = []

    def _moved_to(self, slot: int, leader: str | None) -> bool:
        """A NOT_LEADER for ``slot`` (MOVED): remember its leader; False when it names none (re-read the map)."""
        self.moved += 1
        if not leader:
            return False
        self.map[slot] = leader
        if leader not in self.members:
            self.members.append(leader)
        return True

    def _finish(self, t: SlotTicket, deadline: float) -> Any:
        """Collect every group's answer; parts answered NOT_LEADER are resent to the leader named (only those
        keys), parts whose process cannot be reached re-read the map and are resent after a backoff, until
        ``deadline``. Then merge in key order."""
        op = Op.EXISTS if t.op == Op.PREFIX else t.op
        last: dict[int, Exception] = {}  # slot -> the last failure of its part (the deadline's error says it)
        try:
            for attempt in range(_PART_TRIES):
                retry = list(t.unrouted)
                refresh = pause = bool(t.unrouted)
                for g in t.groups:
                    conn = self._conn(g.addr)
                    ticket, g.ticket = g.ticket, None
                    try:
                        res = conn.result(ticket, self._attempt_end(deadline))
                        self._suspects.discard(g.addr)
                        if op == Op.LOOKUP:
                            self._learn_release(g.addr, res, t)
                    except NotLeader as e:
                        last.update((p.slot, e) for p in g.parts)
                        if not (len(g.parts) == 1 and self._moved_to(g.parts[0].slot, e.leader)):
                            refresh = True
                        retry.extend(g.parts)
                        continue
                    except (TransportError, DeadlineExceeded, Unavailable) as e:
                        last.update((p.slot, e) for p in g.parts)
                        if not isinstance(e, Unavailable):
                            conn.close()
                            self._suspects.add(g.addr)
                        if time.monotonic() >= deadline:
                            raise self._no_leader(g.parts[0].slot, last) from e
                        refresh = pause = True
                        retry.extend(g.parts)
                        continue
                    if len(g.parts) == 1:
                        g.parts[0].answer = res
                        continue
                    answers, failed = self._parts_of(res, len(g.parts), g.addr)
                    if answers is None:  # one merged LOOKUP answer for every part (failed parts' keys: misses)
                        t.merged.append(([i for p in g.parts for i in p.idx], res, g.addr))
                    for i, p in enumerate(g.parts):
                        e = failed.get(i)
                        if e is None:
                            p.answer = _MERGED if answers is None else answers[i]
                            continue
                        last[p.slot] = e
                        if isinstance(e, NotLeader):
                            refresh = not self._moved_to(p.slot, e.leader) or refresh
                        elif isinstance(e, Unavailable):
                            refresh = pause = True
                        elif op == Op.LOOKUP and e.code == Status.BAD_REQUEST and "'merge'" in str(e):
                            self._no_merge.add(g.addr)  # a process of an older release: per part from now on
                        else:
                            raise e
                        retry.append(p)
                if not retry:
                    return self._merge(t.op, t, [p.answer for p in t.parts])
                if refresh:
                    self._refresh(deadline)
                if pause:
                    wait = _BACKOFF[min(attempt, len(_BACKOFF) - 1)]
                    if time.monotonic() + wait >= deadline:
                        raise self._no_leader(retry[0].slot, last)
                    time.sleep(wait)
                self._send(op, t, retry, deadline)
            raise DeadlineExceeded(self.component, f"{len(retry)} slot parts: gave up after {_PART_TRIES} tries")
        except BaseException:
            self._forget(t)
            if t.released:  # whether its process took them or not, they go again in frames (a second RELEASE of
                try:  # a lease changes nothing; one that goes nowhere expires at its process)
                    self._frame(dict(t.released), time.monotonic() + 2.0)
                except Exception:  # noqa: BLE001 - the request's own error is the one to raise
                    pass
                t.released = []
            raise

    def _learn_release(self, addr: str, res: Any, t: SlotTicket) -> None:
        """Whether process ``addr`` takes lease ids inside a LOOKUP, from its answer; the ticket's verdict is every
        one of its processes'."""
        if isinstance(res, dict) and res.get("release_any") is True:
            self._release_any.add(addr)
        else:
            self._release_any.discard(addr)
            t.release_any = False

    def _no_leader(self, slot: int, last: dict[int, Exception]) -> DeadlineExceeded:
        """The deadline's error for a part of ``slot``: the leader the map names and the part's last failure."""
        why = f"; last: {last[slot]}" if slot in last else ""
        return DeadlineExceeded(self.component, f"slot {slot}: no leader answered before the deadline (map says "
                                                f"{self.map[slot] if slot < len(self.map) else None}{why})")

    @staticmethod
    def _attempt_end(deadline: float) -> float:
        """When to stop waiting for one process's answer: half the time left, within [PART_ATTEMPT_MIN_S,
        ATTEMPT_S], never past the deadline."""
        now = time.monotonic()
        return min(deadline, now + min(ATTEMPT_S, max(PART_ATTEMPT_MIN_S, (deadline - now) / 2)))

    def _parts_of(self, res: Any, n: int, addr: str) -> tuple[list | None, dict[int, RemoteError]]:
        """The per-part answers (None: one merged LOOKUP answer, ``rows`` for every part) and failures of a
        multi-slot answer (``metaserver/ha/multislot.py``)."""
        answers = res.get("parts") if isinstance(res, dict) else None
        failed = res.get("failed") if isinstance(res, dict) else None
        if answers is None and isinstance(res, dict) and "rows" in res and type(failed) is list:
            pass
        elif type(answers) is not list or len(answers) != n or type(failed) is not list:
            raise ProtocolError(self.component, f"metaserver {addr}: malformed multi-slot answer")
        out: dict[int, RemoteError] = {}
        for f in failed:
            if (type(f) is not list or len(f) != 4 or type(f[0]) is not int or not 0 <= f[0] < n
                    or type(f[1]) is not int):
                raise ProtocolError(self.component, f"metaserver {addr}: malformed failure in a multi-slot answer")
            i, status, message, leader = f
            if status == Status.NOT_LEADER:
                out[i] = NotLeader(self.component, str(message), status, leader=leader if type(leader) is str else None)
            else:
                out[i] = wire.error_for_status(status, str(message), self.component)
        return answers, out

    def _merge(self, op: int, t: SlotTicket, answers: list) -> Any:
        n = t.n
        if len(answers) == 1 and op != Op.PREFIX and op != Op.LOOKUP:
            return answers[0]
        if op == Op.ABORT:
            return {"aborted": sum(a.get("aborted", 0) for a in answers)}
        if op == Op.PREFIX:
            hit = [False] * n
            for p, a in zip(t.parts, answers):
                for i, x in zip(p.idx, a["exists"]):
                    hit[i] = x
            run = 0
            while run < n and hit[run]:
                run += 1
            return {"hits": run}
        if op == Op.LOOKUP and t.merged:  # merged answers first: a part failed in one was answered later
            own = [(p.idx, a) for p, a in zip(t.parts, answers) if a is not _MERGED]
            if all("rows" in a for _, a in own):
                return self._lookup_leases(t, answers, lookup.merge(
                    [(idx, a) for idx, a, _ in t.merged] + own, n))
            raise ProtocolError(self.component, "a LOOKUP answered both merged and as a version 11 list")
        if op == Op.LOOKUP and all("rows" in a for a in answers):  # packed rows: one index scatter a part
            return self._lookup_leases(t, answers, lookup.merge([(p.idx, a) for p, a in zip(t.parts, answers)], n))
        if op == Op.ALLOC and all("alloc_rows" in a for a in answers):  # packed rows: one index scatter a part
            return lookup.merge_allocs([(p.idx, a) for p, a in zip(t.parts, answers)], n)
        field = {Op.ALLOC: "items", Op.COMMIT: "ok", Op.LOOKUP: "locs", Op.EXISTS: "exists", Op.REMOVE: "removed"}[op]
        out: list = [None] * n
        caps: list = []
        cap_at = 6 if op == Op.ALLOC else 5
        for p, a in zip(t.parts, answers):
            shift = len(caps)
            caps.extend(a.get("caps") or ())
            for i, x in zip(p.idx, a[field]):
                if shift and type(x) is list and len(x) > cap_at and type(x[cap_at]) is int:
                    x[cap_at] += shift
                out[i] = x
        res: dict[str, Any] = {field: out}
        if op in (Op.ALLOC, Op.LOOKUP):
            res["caps"] = caps
        if op == Op.ALLOC:  # the writes of every part's places land by the earliest part's deadline (umbp/puts.py)
            until = [a["write_until_ms"] for a in answers if a.get("write_until_ms")]
            if until:
                res["write_until_ms"] = min(until)
        if op == Op.LOOKUP:
            return self._lookup_leases(t, answers, res)
        return res

    def _lookup_leases(self, t: SlotTicket, answers: list, res: dict) -> dict:
        """The merged LOOKUP answer ``res`` with one lease handle for the slots' read leases (RELEASE expands it)
        and the shortest of their ``lease_ms``."""
        leases = [(p.addr, a["lease"]) for p, a in zip(t.parts, answers) if a is not _MERGED and a.get("lease")]
        leases += [(addr, a["lease"]) for _, a, addr in t.merged if a.get("lease")]
        answers = [a for a in answers if a is not _MERGED] + [a for _, a, _ in t.merged]
        res["lease"] = 0
        if t.release_any:  # every process took "release" in its LOOKUP: ``ReleasingMeta`` may queue leases
            res["released"] = sum(len(ids) for _, ids in t.released)
            res["release_any"] = True
        if leases:
            handle = next(self._ids)
            self._leases[handle] = leases
            while len(self._leases) > _LEASES_KEPT:
                self._leases.popitem(last=False)
            res["lease"] = handle
            # the shortest of the slots' leases
            res["lease_ms"] = min([wire.DEFAULT_LEASE_MS] + [a.get("lease_ms", wire.DEFAULT_LEASE_MS) for a in answers
                                                            if a.get("lease")])
        return res

    # -- admin -------------------------------------------------------------------------------------------------
    def _fan_out(self, op: int, meta: Any, deadline: float) -> Any:
        """Ask every live process (the one answering for the slots it leads) and sum. Each one's answer is awaited
        at most half the time left (``_attempt_end``), so one silent process does not hide the others."""
        self._refresh(deadline)
        answers = []
        metas = {addr: meta for addr in self.members}
        if op == Op.EVICT and type(meta) is dict and type(meta.get("bytes")) is int and len(meta) == 1:
            # The bytes split over the processes by their use (each splits its share over its slots), not asked
            # of every process: one STATS each first.
            uses = {}
            for addr in list(self.members):
                try:
                    uses[addr] = int(self._conn(addr).call(Op.STATS, {}, self._attempt_end(deadline))
                                     .get("used_bytes", 0))
                except (TransportError, DeadlineExceeded):
                    continue
            metas = {a: {"bytes": b} for a, b in zip(uses, split_by_use(meta["bytes"], list(uses.values()))) if b}
            if uses and not metas:
                return {"evicted": 0, "freed_bytes": 0}  # nothing asked
        for addr in list(self.members):
            if addr not in metas:
                continue
            try:  # a process whose host went silent costs half the time left, not the others' answers
                answers.append(self._conn(addr).call(op, metas[addr], self._attempt_end(deadline)))
            except (TransportError, DeadlineExceeded):
                self._suspects.add(addr)
                continue
        if not answers:
            raise TransportError(self.component, f"no metaserver of {', '.join(self.members)} answered")
        if op == Op.STATS:
            out = merge_stats(answers)
            out.update({"slots": self.slots, "slot_rule": self.rule, "slot_map": list(self.map), "is_leader": True,
                        "leader": next((a.get("membership_leader") for a in answers if a.get("membership_leader")),
                                       None),
                        "metaservers": [{"addr": a.get("metaserver"), "slots_led": a.get("slots_led", []),
                                         "objects": a.get("objects", 0), "used_bytes": a.get("used_bytes", 0),
                                         "handovers": a.get("handovers", 0),
                                         "warm_copies": a.get("warm_copies", {})} for a in answers]})
            return out
        if op == Op.NODES:
            return {"nodes": merge_nodes([a.get("nodes") or [] for a in answers])}
        if op == Op.LIST:
            objects = [o for a in answers for o in a.get("objects", ())]
            limit = meta.get("limit", 1000) if type(meta) is dict and type(meta.get("limit")) is int else 1000
            return {"objects": objects[:limit], "truncated": any(a.get("truncated") for a in answers)
                    or len(objects) > limit}
        keys = ("evicted", "freed_bytes") if op == Op.EVICT else ("dropped", "pinned")
        return {k: sum(a.get(k, 0) for a in answers) for k in keys}
