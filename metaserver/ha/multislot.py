"""Multi-slot requests of a partitioned pool (wire VERSION 7): one keyed request (ALLOC, COMMIT, ABORT, LOOKUP,
EXISTS, REMOVE) carrying the keys of several slots that the client believes one process leads, so a batch costs
one request per process instead of one per slot (``umbp/slotrouter.py`` sends them).

Request: the op's usual meta (``ns``, ``keys``, the per-key lists ``sizes``/``parents``/``gens``, any per-request
field such as ``token``) plus ``parts``: ``[[slot, n], ...]``: the keys grouped by slot in that order, ``n`` keys
each (every slot once, every ``n`` >= 1, the counts adding up to ``len(keys)``). An ALLOC's keys are each checked to
hash to their part's slot (``slotrules.slots_of``), so an entry only ever lives in its key's slot; the other requests
trust the parts (a key sent under another slot can only miss there: not found, not committed, not removed), which
saves a keyed hash per key on every read (12 % of a 4-process pool's CPU on lookups, py-spy on the GPU machine). A
single-slot request names its slot the same way with ``"slot": s`` (wire VERSION 10, ``Partition.named_slot``).

Answer, once, after every part is done: ``{"parts": [answer | None per part], "failed": [[index, status, message,
leader], ...]}``. Each part is answered exactly as a single-slot request to that slot would be (its own
capabilities, its own read lease); a part whose slot is led elsewhere fails NOT_LEADER naming that slot's leader
(MOVED), so the client re-routes only that part's keys; a part that fails otherwise fails alone (the other parts
took effect). A malformed ``parts`` fails the whole request BAD_REQUEST. PREFIX is not split (the client sends
EXISTS parts and counts the run itself).

Cost: O(keys) to slice and check, plus each part's handler; COMMIT parts waiting on etcd are awaited together.
"""

from __future__ import annotations

import asyncio
from typing import Any

from metaserver import validate as v
from transport import slotrules
from transport.wire import Op, Status
from umbp.errors import NotLeader, RemoteError, UmbpError

LISTS = ("keys", "sizes", "parents", "gens")  # per-key lists of a keyed request, sliced per part


def split(meta: dict, slots: int, check: bool = True) -> list[tuple[int, dict]]:
    """(slot, that part's meta) for each part of a multi-slot request; Reject when ``parts`` is malformed or
    (``check``: an ALLOC) a key is not of its part's slot."""
    parts, keys, ns = meta.get("parts"), meta.get("keys"), meta.get("ns")
    if type(keys) is not list or type(ns) is not str:
        raise v.Reject("a multi-slot request needs 'ns' (string) and 'keys' (list)")
    if type(parts) is not list or not 1 <= len(parts) <= slots:
        raise v.Reject(f"'parts' must be a list of 1..{slots} [slot, count] pairs")
    out: list[tuple[int, dict]] = []
    seen: set[int] = set()
    at = 0
    base = {k: x for k, x in meta.items() if k != "parts" and k not in LISTS}
    for part in parts:
        if (type(part) is not list or len(part) != 2 or type(part[0]) is not int or type(part[1]) is not int
                or not 0 <= part[0] < slots or part[0] in seen or part[1] < 1 or at + part[1] > len(keys)):
            raise v.Reject(f"'parts': bad entry {part!r} (want [slot 0..{slots - 1}, count >= 1], each slot once, "
                           f"counts adding up to the {len(keys)} keys)")
        slot, n = part
        seen.add(slot)
        m = dict(base)
        for k in LISTS:
            x = meta.get(k)
            if type(x) is list:
                m[k] = x[at:at + n]
            elif k in meta:
                m[k] = x
        for i, got in enumerate(slotrules.slots_of(ns, m["keys"], slots) if check else ()):
            if got != slot and got != -1:  # -1: not a key at all, refused by the part's own validation
                raise v.Reject(f"'parts': key {at + i} is not of slot {slot}")
        out.append((slot, m))
        at += n
    if at != len(keys):
        raise v.Reject(f"'parts' count {at} keys, the request has {len(keys)}")
    return out


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
    (a dict), or a coroutine for it when a part waits (COMMIT on etcd)."""
    if op == Op.PREFIX:
        raise v.Reject("PREFIX is not split over slots: send EXISTS parts and count the leading run")
    answers: list[Any] = []
    failed: list[list] = []
    waiting: list[int] = []
    for i, (slot, m) in enumerate(split(meta, p.slots, op == Op.ALLOC)):
        name = str(slot)
        srv = p.servers[name]
        try:
            if not srv.serving:
                raise p._moved(name)
            res = srv.handlers[op](m, p._slot_conn(conn, name))
        except Exception as e:  # noqa: BLE001 - a part's failure is that part's answer
            answers.append(None)
            failed.append(_failure(i, e))
            continue
        answers.append(res)
        if type(res) is not dict:
            waiting.append(i)
    if not waiting:
        return {"parts": answers, "failed": failed}
    return _gather(answers, failed, waiting)


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
