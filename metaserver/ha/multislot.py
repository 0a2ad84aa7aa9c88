"""Multi-slot requests of a partitioned pool (wire VERSION 7): one keyed request (ALLOC, COMMIT, ABORT, LOOKUP,
EXISTS, REMOVE) carrying the keys of several slots that the client believes one process leads, so a batch costs
one request per process instead of one per slot (``umbp/slotrouter.py`` sends them).

Request: the op's usual meta (``ns``, ``keys``, the per-key lists ``sizes``/``parents``/``gens``, any per-request
field such as ``token``) plus ``parts``: ``[[slot, n], ...]``: the keys grouped by slot in that order, ``n`` keys
each (every slot once, every ``n`` >= 1, the counts adding up to ``len(keys)``). An ALLOC's keys are each checked to
be of their part's slot under the pool's rule (``slotrules.slots_of``, ``check_slots``), so an entry only ever lives
in its key's slot; the other requests trust the parts (a key sent under another slot can only miss there: not found,
not committed, not removed), which saves a keyed hash per key on every read (12 % of a 4-process pool's CPU on
lookups under rule 1, py-spy on the GPU machine). A single-slot request names its slot the same way with
``"slot": s`` (wire VERSION 10, ``Partition.named_slot``).

Answer, once, after every part is done: ``{"parts": [answer | None per part], "failed": [[index, status, message,
leader], ...]}``. Each part is answered exactly as a single-slot request to that slot would be (its own
capabilities, its own read lease); a part whose slot is led elsewhere fails NOT_LEADER naming that slot's leader
(MOVED), so the client re-routes only that part's keys; a part that fails otherwise fails alone (the other parts
took effect). A malformed ``parts`` fails the whole request BAD_REQUEST. PREFIX is not split (the client sends
EXISTS parts and counts the run itself).

A LOOKUP with ``"merge": true`` (a client of wire VERSION 12 that knows it: ``umbp/slotrouter.py``) is answered as
one LOOKUP answer for the whole request (``lookup_merged``): ``{"lease", "lease_ms", "nodes", "caps", "rows",
"failed"}``, one packed row a key in the request's order (a failed part's keys are misses), one read capability a
node covering every part's slots on it (read capabilities carry no slot epoch: a node checks each (offset, length,
generation) it is asked for against the capability alone), and one read lease for the process (``ProcessLeases``:
its id names each part's slice of a lease its slot's table holds; RELEASE of it releases them all). The parts still
run on their own slot's table, each with the other LOOKUPs and parts of its slot's event-loop turn
(``metaserver/handlers/turns.py``: one table pass a slot and turn, one lease in slices for the turn's parts, so a part
takes no lease, owner or expiry entry of its own), but the validation, the grants, the answer and the lease are the
request's, once; the answer's nodes come from ``AnswerNodes`` (each slot table's node codes mapped once, not a
Python step a node and part).

Cost: O(keys) to slice and check, plus each part's handler; COMMIT parts waiting on etcd are awaited together; an
ALLOC's parts from a server connection each join their slot's turn (``metaserver/handlers/turns.py``: one table
pass a slot for the turn's ALLOCs and parts), the answer given when the last part is back. A
merged LOOKUP: its share of each slot's turn pass (``TableDirectory.lookup_columns_many``), then O(keys) numpy over
the request and one keyed blake2b a node.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import numpy as np

from metaserver import validate as v
from metaserver.handlers.turns import Later, when_done
from metaserver.handlers.ownership import LEASES_PRUNE_AT
from metaserver.table.grants import by_node
from metaserver.table.entry import random_id
from metaserver.table.leases import SLICED
from transport import answerrows, slotrules
from transport.keyform import PackedKeys
from transport.wire import Op, Status
from umbp.auth import read_capabilities_packed
from umbp.errors import NotLeader, RemoteError, UmbpError

LISTS = ("keys", "sizes", "parents", "gens")  # per-key lists of a keyed request, sliced per part
_MERGED = frozenset({"ns", "keys", "parts", "shard", "merge"})
_NODES_KEPT = 256  # entries ``AnswerNodes`` keeps at least before it starts over


def check_slots(got: np.ndarray, slot: int, rule: int, at: int = 0) -> None:
    """Reject an ALLOC's keys (part) unless each is of ``slot``: ``got`` their slots under the pool's ``rule``, -1
    for what is no key at all (refused by the slot's own validation, precisely). Keys start at index ``at``."""
    bad = np.flatnonzero((got != slot) & (got != -1))
    if len(bad):
        why = (" (a client of a release older than rule 2 routes keys by rule 1: upgrade it)"
               if rule == slotrules.RULE_DIGEST else "")
        raise v.Reject(f"key {at + int(bad[0])} is not of slot {slot} under this pool's slot rule {rule}{why}")


def split(meta: dict, slots: int, check: bool = True, rule: int = slotrules.RULE_DIGEST) -> list[tuple[int, dict]]:
    """(slot, that part's meta) for each part of a multi-slot request; Reject when ``parts`` is malformed or
    (``check``: an ALLOC) a key is not of its part's slot under the pool's slot ``rule``. An ALLOC's part names as
    parents none of the request's keys of other slots (``_part_parents``)."""
    parts, keys, ns = meta.get("parts"), meta.get("keys"), meta.get("ns")
    if type(keys) not in v.KEY_LISTS or type(ns) is not str:
        raise v.Reject("a multi-slot request needs 'ns' (string) and 'keys' (list, or packed)")
    key_slots = slotrules.slots_of(ns, keys, slots, rule) if check else None  # the request's keys at once
    parents = _part_parents(keys, key_slots, meta.get("parents")) if check else None
    out: list[tuple[int, dict]] = []
    base = {k: x for k, x in meta.items() if k != "parts" and k not in LISTS}
    for slot, at, end in cuts(parts, slots, len(keys)):
        m = dict(base)
        for k in LISTS:
            x = meta.get(k)
            if type(x) in v.KEY_LISTS:  # (packed keys slice as packed keys)
                m[k] = x[at:end]
            elif k in meta:
                m[k] = x
        if check:
            check_slots(key_slots[at:end], slot, rule, at)
            if parents is not None:
                m["parents"] = [p if s in (slot, -1) else None for p, s in zip(m["parents"], parents[at:end])]
        out.append((slot, m))
    return out


def _part_parents(keys, key_slots: np.ndarray, parents) -> list[int] | None:
    """The slot of each parent of a multi-slot ALLOC that is one of its keys (from ``key_slots``, no digest), -1 for
    the others (a slot's table finds theirs: ``SlotTable.own_parents``); None where ``parents`` is not a list of
    hashables as long as the keys (the slot's own validation refuses it by name)."""
    if type(parents) is not list or len(parents) != len(keys):
        return None
    try:
        of = dict(zip(keys.tolist() if type(keys) is PackedKeys else keys, key_slots.tolist()))
        return [of.get(p, -1) for p in parents]
    except TypeError:  # an unhashable key or parent
        return None


def _failure(i: int, e: BaseException) -> list:
    """[index, status, message, leader] for a part that failed (the statuses ``server.Connection._fail`` gives)."""
    if isinstance(e, NotLeader):
        return [i, Status.NOT_LEADER, e.detail, e.leader]
    if isinstance(e, v.Reject):
        return [i, e.status, e.message, e.extra.get("leader")]
    if isinstance(e, RemoteError):
        return [i, e.code or Status.INTERNAL, e.detail, None]
    if isinstance(e, UmbpError):
        return [i, Status.INTERNAL, e.detail, None]
    return [i, Status.INTERNAL, f"internal error: {type(e).__name__}: {e}", None]


def dispatch(p, op: int, meta: dict, conn) -> Any:
    """Run each part on its slot server of partition ``p`` (``metaserver.ha.partition.Partition``); the merged answer
    (a dict), a coroutine for it when a part waits (COMMIT on etcd), or a ``Later`` when an ALLOC's parts wait for
    their slots' turns."""
    if op == Op.PREFIX:
        raise v.Reject("PREFIX is not split over slots: send EXISTS parts and count the leading run")
    if op == Op.LOOKUP and meta.get("merge") is True and conn.version >= 12:
        return lookup_merged(p, meta, conn)
    answers: list[Any] = []
    failed: list[list] = []
    waiting: list[int] = []
    turns = op == Op.ALLOC and getattr(conn, "in_turns", False)  # an ALLOC's parts join their slots' turns
    for i, (slot, m) in enumerate(split(meta, p.slots, op == Op.ALLOC, p.rule)):
        name = str(slot)
        srv = p.servers[name]
        try:
            if not srv.serving:
                raise p._moved(name)
            sc = p._slot_conn(conn, name)
            if op == Op.LOOKUP:  # answered now (a merged LOOKUP's parts join the turns: lookup_merged)
                res = srv.dataplane.lookup(m, sc, False)
            elif op == Op.ALLOC:
                res = srv.alloc(m, sc, turns)
            else:
                res = srv.handlers[op](m, sc)
        except Exception as e:  # noqa: BLE001 - a part's failure is that part's answer
            answers.append(None)
            failed.append(_failure(i, e))
            continue
        answers.append(res)
        if type(res) is not dict:
            waiting.append(i)
    if not waiting:
        return {"parts": answers, "failed": failed}
    if op == Op.COMMIT:
        return _in_turn(answers, failed, waiting)
    if turns:
        return _when_answered(answers, failed, waiting)
    return _gather(answers, failed, waiting)


def _when_answered(answers: list, failed: list, waiting: list[int]) -> Later:
    """``_gather`` for an ALLOC whose parts wait for their slots' turns (a ``Later`` each) or for generations or a
    durable removal (a coroutine each, run as a task): a ``Later`` answered when the last part is."""
    out = Later()
    left = [len(waiting)]

    def got(i: int, res: dict | None, err: BaseException | None) -> None:
        if err is not None:
            answers[i] = None
            failed.append(_failure(i, err))
        else:
            answers[i] = res
        left[0] -= 1
        if not left[0]:
            failed.sort()
            out.done({"parts": answers, "failed": failed})

    for i in waiting:
        a = answers[i]
        if type(a) is Later:
            a.then = functools.partial(got, i)
        else:
            when_done(a, functools.partial(got, i))
    return out


async def _gather(answers: list, failed: list, waiting: list[int]) -> dict:
    done = await asyncio.gather(*(answers[i] for i in waiting), return_exceptions=True)
    for i, res in zip(waiting, done):
        if isinstance(res, BaseException):
            if isinstance(res, asyncio.CancelledError):
                raise res
            answers[i] = None
            failed.append(_failure(i, res))
        else:
            answers[i] = res
    failed.sort()
    return {"parts": answers, "failed": failed}


async def _in_turn(answers: list, failed: list, waiting: list[int]) -> dict:
    """``_gather`` for COMMIT parts, awaited one after the other in this task: each only waits for its pages'
    write, handed to its slot's writer already (all in flight together), so no task a part is needed (a task and
    gather's callbacks a part were a tenth of a multi-slot COMMIT's glue)."""
    try:
        for n, i in enumerate(waiting):
            try:
                answers[i] = await answers[i]
            except Exception as e:  # noqa: BLE001 - a part's failure is that part's answer
                answers[i] = None
                failed.append(_failure(i, e))
    except BaseException:
        for i in waiting[n + 1:]:
            answers[i].close()  # never started: no 'never awaited' warning
        raise
    failed.sort()
    return {"parts": answers, "failed": failed}


def cuts(parts: Any, slots: int, n: int) -> list[tuple[int, int, int]]:
    """(slot, first key, end) of each part of ``parts`` over ``n`` keys. Reject unless ``parts`` is a list of 1..
    ``slots`` [slot, count] pairs of ints, each slot once and in range, each count at least 1, the counts adding up to
    ``n`` (``_refuse`` names the first bad entry). A few comprehensions and numpy calls, no Python step of checks a
    part."""
    if type(parts) is not list or not 1 <= len(parts) <= slots:
        raise v.Reject(f"'parts' must be a list of 1..{slots} [slot, count] pairs")
    if all([type(q) is list and len(q) == 2 for q in parts]):
        s, c = [q[0] for q in parts], [q[1] for q in parts]
        if all([type(x) is int for x in s]) and all([type(x) is int for x in c]):
            try:
                sa, ca = np.array(s, np.int64), np.array(c, np.int64)
            except OverflowError:
                _refuse(parts, slots, n)
            ends = ca.cumsum()  # (counts at most n each: no overflow)
            if (sa.min() >= 0 and sa.max() < slots and ca.min() >= 1 and ca.max() <= n and ends[-1] == n
                    and len(set(s)) == len(s)):
                e = ends.tolist()
                return list(zip(s, [0] + e[:-1], e))
    _refuse(parts, slots, n)


def _refuse(parts: list, slots: int, n: int) -> None:
    """Reject a malformed ``parts`` (``cuts``) naming its first bad entry, or its count."""
    seen, at = set(), 0
    for part in parts:
        if (type(part) is not list or len(part) != 2 or type(part[0]) is not int or type(part[1]) is not int
                or not 0 <= part[0] < slots or part[0] in seen or part[1] < 1 or at + part[1] > n):
            raise v.Reject(f"'parts': bad entry {part!r} (want [slot 0..{slots - 1}, count >= 1], each slot once, "
                           f"counts adding up to the {n} keys)")
        seen.add(part[0])
        at += part[1]
    raise v.Reject(f"'parts' count {at} keys, the request has {n}")


def lookup_merged(p, meta: dict, conn) -> Any:
    """A multi-slot LOOKUP answered as one LOOKUP (module docstring): each part's rows found and pinned in its slot's
    table, then one capability a node, one packed answer and one process lease over all of them. A part whose slot
    is not served here, or whose table call fails, is in ``failed`` and its keys are misses. For a connection that
    waits (the server's), each part joins its slot's turn (``metaserver/handlers/turns.py``: one table pass for the
    turn's LOOKUPs and parts of that slot) and the answer is a ``Later``, given when the last part is back."""
    m = v.fields(meta, _MERGED, ("ns", "keys", "parts"))
    ns = v.ns(m)
    conn.auth.scope.check(ns, False, "metaserver")
    keys = v.keys(m, p.membership.max_keys * (len(m["parts"]) if type(m["parts"]) is list else 1))
    merged = Merged(p, conn, cuts(m["parts"], p.slots, len(keys)))
    shard = v.shard(m)
    defer = shard is None and getattr(conn, "in_turns", False)
    now = time.monotonic()
    for i, (slot, a, b) in enumerate(merged.parts):
        name = str(slot)
        srv = p.servers[name]
        if not srv.serving:
            merged.got[i] = p._moved(name)
        elif defer:
            merged.waiting += 1
            srv.lookups.ask_part(ns, keys[a:b], conn, functools.partial(merged.part, i))
        else:
            try:
                srv.lookups.free_now()  # (answered now: after the releases read before it)
                merged.got[i] = srv.dir.lookup_columns(ns, keys[a:b], now, SLICED, srv.tokens, shard)
            except Exception as e:  # noqa: BLE001 - a part's failure is that part's answer
                merged.got[i] = e
    if not merged.waiting:
        return merged.answer()
    merged.later = Later()
    return merged.later


class Merged:
    """A merged LOOKUP's parts as they come back (``got``: each part's ``lookup_columns``, or its error), and its
    answer once every one is (``answer``; ``later``: given then, when the parts waited for their turns)."""

    __slots__ = ("p", "conn", "parts", "got", "waiting", "later")

    def __init__(self, p, conn, parts: list[tuple[int, int, int]]) -> None:
        self.p, self.conn, self.parts = p, conn, parts
        self.got: list = [None] * len(parts)
        self.waiting = 0
        self.later: Later | None = None

    def part(self, i: int, got) -> None:
        """Part ``i``'s columns (or error), from its slot's turn; the answer goes out with the last one."""
        self.got[i] = got
        self.waiting -= 1
        if self.waiting:
            return
        try:
            ans = self.answer()
        except Exception as e:  # noqa: BLE001 - the request is answered either way
            self.later.fail(e)
            return
        self.later.done(ans)

    def answer(self) -> dict:
        p, conn = self.p, self.conn
        hits, tags, slots, codes, failed, held = [], [], [], [], [], []
        nodes = p.answer_nodes
        nodes.trim()
        for i, ((slot, a, b), got) in enumerate(zip(self.parts, self.got)):
            if isinstance(got, BaseException):
                failed.append(_failure(i, got))
                hits.append(np.zeros(b - a, bool))
                continue
            lease, hit, tg, sl, nix = got
            hits.append(hit)
            if not lease:
                continue
            name = str(slot)
            srv = p.servers[name]
            held.append((srv, srv.term, lease))  # (the term names its table: no old table is kept alive)
            tags.append(tg)
            slots.append(sl)
            codes.append(nodes.codes(name, srv).take(nix))  # the answer's nodes, one entry each over the parts
        hit = hits[0] if len(hits) == 1 else np.concatenate(hits)
        if not held:
            return {"lease": 0, "nodes": [], "caps": [], "rows": answerrows.pack_locs(hit, (), (), (), (), ()),
                    "failed": failed}
        if len(held) > 1:
            tags, slots, codes = np.concatenate(tags), np.concatenate(slots), np.concatenate(codes)
        else:
            tags, slots, codes = tags[0], slots[0], codes[0]
        uniq, inv, order, ends = by_node(codes)
        used = uniq.tolist()
        cap_keys = [nodes.keys[j] for j in used]
        caps = (read_capabilities_packed(cap_keys, (slots if order is None else slots.take(order, axis=0)).tobytes(),
                                         ends) if any(cap_keys) else [b""] * len(cap_keys))
        lease = ProcessLeases.of(conn).add(held)
        return {"lease": lease, "lease_ms": min(srv.lease_ms for srv, _, _ in held),
                "nodes": [nodes.ids[j] for j in used], "caps": caps,
                "rows": answerrows.pack_locs(hit, tags, slots[:, 2], slots[:, 1], slots[:, 0], inv), "failed": failed}


class AnswerNodes:
    """The nodes a process's merged LOOKUP answers name, each once by (node id, capability key) over the parts'
    tables (a slot that has not seen a node's new arena yet keeps its own entry): ``ids`` and ``keys`` by index.
    ``codes(name, srv)``: slot server ``srv``'s ``node`` column values -> indexes here, an array kept while its
    table's node names, its membership and the membership's version stay (a part costs a ``take``, not a Python step
    a node of its table). ``trim`` starts over, before an answer, once entries of nodes gone or keys replaced have
    made it more than twice what the slots' tables named: O(nodes x slots) then, as often as node churn asks."""

    __slots__ = ("ix", "ids", "keys", "maps", "limit")

    def __init__(self) -> None:
        self.ix: dict[tuple, int] = {}
        self.ids: list[str] = []
        self.keys: list[bytes | None] = []
        self.maps: dict[str, tuple] = {}  # slot name -> (node_names, membership, its version, codes -> indexes)
        self.limit = _NODES_KEPT

    def codes(self, name: str, srv) -> np.ndarray:
        names, mem = srv.dir.node_names, srv.members
        got = self.maps.get(name)
        if got is not None and got[0] is names and got[1] is mem and got[2] == mem.version:
            return got[3]
        out = np.zeros(len(names), np.int64)  # (a retired index names None: no live row has it)
        for j, nid in enumerate(names.tolist()):
            if nid is not None:
                m = mem.get(nid)
                key = (nid, None if m is None else m.cap_key)
                i = self.ix.get(key)
                if i is None:
                    i = self.ix[key] = len(self.ids)
                    self.ids.append(nid)
                    self.keys.append(key[1])
                out[j] = i
        self.maps[name] = (names, mem, mem.version, out)
        return out

    def trim(self) -> None:
        if len(self.ids) > self.limit:
            self.limit = max(_NODES_KEPT, 2 * sum(len(m[3]) for m in self.maps.values()))
            self.ix.clear()
            self.ids, self.keys = [], []
            self.maps.clear()


class ProcessLeases(dict):
    """A connection's process leases (merged LOOKUPs): id -> [(slot server, its term, (lease, j)), ...], each part's
    slice j of a lease in slices of that term's table (``TableDirectory.lookup_columns_many``: the parts of a slot's
    turn share one lease, and no connection owns it; a slot's table is its ``dir`` for exactly one term, made or
    adopted before it serves: ``Metaserver._new_state``, ``_adopt``). The lease runs out as any read lease of its
    table; at the connection's close its slices are left to run out (``orphan``), as a connection's own leases are.
    Pruned of ids none of whose slices is held when it has doubled (as ``HeldLeases``): O(1) amortized a LOOKUP."""

    __slots__ = ("prune_at",)

    def __init__(self) -> None:
        super().__init__()
        self.prune_at = LEASES_PRUNE_AT

    @staticmethod
    def of(conn) -> "ProcessLeases":
        got = getattr(conn, "process_leases", None)
        if got is None:
            got = conn.process_leases = ProcessLeases()
        return got

    def add(self, held: list[tuple]) -> int:
        if len(self) >= self.prune_at:
            for x in [x for x, ls in self.items() if not any(held_now(*part) for part in ls)]:
                del self[x]
            self.prune_at = max(LEASES_PRUNE_AT, 2 * len(self))
        lease = random_id() or 1
        while lease in self:
            lease = random_id() or 1
        self[lease] = held
        return lease


def release(p, conn, ids: list[int]) -> tuple[int, list[int]]:
    """Release the process leases among ``ids`` (each: every part's slice still held, on its slot's table of this
    term), at the end of the turn for a connection that waits in turns (``LookupTurn.free_slice``), else at once;
    (how many of them were held, the ids that are not process leases)."""
    mine = getattr(conn, "process_leases", None)
    if not mine:
        return 0, ids
    turns = getattr(conn, "in_turns", False)
    n, rest = 0, []
    for x in ids:
        held = mine.pop(x, None)
        if held is None:
            rest.append(x)
            continue
        got = False
        for srv, term, (lease, j) in held:
            if not held_now(srv, term, (lease, j)):  # another term's table, or run out
                continue
            got = True
            if turns:
                srv.lookups.free_slice(srv.dir, lease, j)
            else:
                srv.dir.release_many((), ((lease, j),))
        n += got
    return n, rest


def held_now(srv, term: int, lease: tuple[int, int]) -> bool:
    """Whether a process lease's part (``ProcessLeases``) still holds its slice: its slot in the same term, the
    slice neither released nor run out."""
    return srv.term == term and srv.dir.slice_open(*lease)


def orphan(conn) -> None:
    """``conn`` closed: its process leases' slices still held are left to run out, as its own leases are
    (``ownership.drop_leases``), each counted in its table's ``leases_orphaned``."""
    mine = getattr(conn, "process_leases", None)
    if not mine:
        return
    for held in mine.values():
        for part in held:
            if held_now(*part):
                part[0].dir.leases_orphaned += 1
    mine.clear()
