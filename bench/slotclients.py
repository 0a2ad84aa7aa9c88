"""The client processes of ``bench/slots.py`` (the fair capacity bench): each keeps ``window`` batches in flight,
a request a metaserver process a batch (routed by the pool's slot map and rule, a part a slot, merged LOOKUPs where
the process takes them), and reports its counts; ``Clients`` spawns them once and drives them over pipes (connect to
a pool, prepare a phase, run it, close). What a phase measures and how: ``bench/slots.py``'s docstring.

Cost: the client's work per request is one frame out and one frame in (a LOOKUP answer's packed rows counted with
one ``np.frombuffer``, or unpacked as ``umbp.Client`` does with ``decode="locs"``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import selectors
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from metaserver.handlers.ownership import MAX_RELEASE  # noqa: E402
from transport import answerrows, slotrules, wire  # noqa: E402
from transport.framed import FramedSocket  # noqa: E402
from transport.wire import AllocState, Op  # noqa: E402

NS = "bench-slots"
DRAIN_S = 60.0  # after a phase's end, its requests in flight must all be answered within this
LOOKUP_PLANS = 512  # lookup batches prepared per client (cycled through during the phase)


# -- the client process --------------------------------------------------------------------------------------------

class _Sub:
    """One request of a batch to one process: its keys (grouped by slot), their slots, their parents (a put's, or
    None), and the batch's counter."""

    __slots__ = ("proc", "keys", "kslots", "route", "nparts", "parents", "batch", "op")

    def __init__(self, proc: int, keys: list, kslots: list, route: dict, nparts: int, parents: list | None = None):
        self.proc, self.keys, self.kslots, self.route, self.nparts = proc, keys, kslots, route, nparts
        self.parents = parents
        self.batch: list | None = None  # [requests of the batch not answered yet]
        self.op = 0


def _route_meta(kslots: list[int]) -> tuple[dict, int]:
    """The routing fields of a request whose keys (grouped by slot, in that order) have slots ``kslots``, and how
    many slot parts it has: ``{"slot": s}`` for one slot, ``{"parts": [[slot, n], ...]}`` for several."""
    parts: list[list[int]] = []
    for s in kslots:
        if parts and parts[-1][0] == s:
            parts[-1][1] += 1
        else:
            parts.append([s, 1])
    return ({"slot": parts[0][0]} if len(parts) == 1 else {"parts": parts}), len(parts)


class BenchClient:
    """One client process's state: a connection per metaserver process, the slot map, the keys it committed."""

    def __init__(self, cid: int, window: int, page_bytes: int, decode: str, merge: bool = True, chain: bool = True,
                 digests: bool = True, release_next: bool = True):
        self.cid, self.window, self.page_bytes, self.decode = cid, window, page_bytes, decode
        self.merge = merge
        self.digests = digests  # LOOKUPs packed as umbp.Client packs them: every key as its digest
        # a LOOKUP's read leases ride in the next LOOKUP to that process ("release", as umbp/releases.py sends
        # them), not in a RELEASE frame each; those left at the end of a phase go in one RELEASE frame a process
        self.release_next = release_next
        self.to_release: dict[int, list[int]] = {}
        self.chain = chain  # puts name each page's predecessor in its batch as its parent, as the engines do
        self.socks: list[FramedSocket] = []
        self.slots = 1
        self.owner: list[int] = []  # slot -> index of its process in socks
        self.keys: list[bytes] = []  # committed by the last put phase, with their slots
        self.kslots: list[int] = []
        self.plan: list[list[_Sub]] = []
        self.op = 0
        self.round = 0

    def connect(self, addrs: list[str]) -> int:
        self.close()
        token = os.environ.get("UMBP_TOKEN") or None
        first = FramedSocket(addrs[0], "bench", time.monotonic() + 10, token, hello=True)
        info = first.request(Op.LEADER, {}, time.monotonic() + 10).meta
        first.close()
        slots = info.get("slots") if type(info) is dict else None
        if type(slots) is int and slots > 1:
            smap = info["map"]
            if any(a is None for a in smap):
                raise RuntimeError(f"bench: slots without a leader in the map {smap}")
            procs = sorted(set(smap))
            self.slots, self.owner = slots, [procs.index(a) for a in smap]
        else:
            procs, self.slots, self.owner = addrs[:1], 1, [0]
        self.socks = [FramedSocket(a, f"bench metaserver {a}", time.monotonic() + 10, token, hello=True)
                      for a in procs]
        self.keys, self.kslots = [], []
        return len(procs)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []

    def _batch(self, keys: list[bytes], kslots: list[int], parents: list | None = None) -> list[_Sub]:
        """One batch as one request per process: its keys grouped by slot (stable, so a part keeps key order)."""
        if self.slots <= 1:
            return [_Sub(0, keys, kslots, {}, 1, parents)]
        by: dict[int, list[int]] = {}
        for i in sorted(range(len(keys)), key=kslots.__getitem__):
            by.setdefault(self.owner[kslots[i]], []).append(i)
        subs = []
        for proc, idx in by.items():
            ks = [kslots[i] for i in idx]
            route, nparts = _route_meta(ks)
            subs.append(_Sub(proc, [keys[i] for i in idx], ks, route, nparts,
                             [parents[i] for i in idx] if parents is not None else None))
        return subs

    def prep(self, op: str, batch: int, budget: int) -> int:
        """Build the next phase's batches before it starts (keys, their slots, the routing)."""
        self.op = Op.ALLOC if op == "put" else Op.LOOKUP
        if op == "put":
            self.round += 1
            n = budget // batch * batch
            keys = [b"c%d/r%d/%d" % (self.cid, self.round, i) for i in range(n)]
            ks = slotrules.slots_of(NS, keys, self.slots).tolist()
            self.plan = [self._batch(keys[i:i + batch], ks[i:i + batch],
                                     [None] + keys[i:i + batch - 1] if self.chain else None) for i in range(0, n, batch)]
            self.keys, self.kslots = [], []
        else:
            if len(self.keys) < batch:
                raise RuntimeError(f"bench: client {self.cid} committed {len(self.keys)} keys, fewer than a batch")
            rng = random.Random(self.cid * 7919 + self.round)
            self.plan = []
            for _ in range(max(LOOKUP_PLANS, 2 * self.window)):  # a batch is never in flight twice at once
                idx = rng.sample(range(len(self.keys)), batch)
                self.plan.append(self._batch([self.keys[i] for i in idx], [self.kslots[i] for i in idx]))
        return len(self.plan)

    def _send(self, sub: _Sub, op: int, meta: dict, inflight: dict, deadline: float) -> None:
        fs = self.socks[sub.proc]
        rid = fs.next_id()
        meta.update(sub.route)
        if op == Op.LOOKUP and self.merge and "parts" in sub.route:
            meta["merge"] = True  # one answer for the parts, as umbp/slotrouter.py asks (metaserver/ha/multislot.py)
        if op == Op.LOOKUP and self.release_next and sub.proc in self.to_release:
            meta["release"] = self.to_release.pop(sub.proc)
        if op == Op.LOOKUP and self.digests and fs.digest_keys:
            meta = wire.pack_keys(meta, True)  # packed, 32 bytes a key: the metaserver hashes none (umbp/metaclient.py)
        fs.send([wire.encode(op, rid, meta)], deadline)
        sub.op = op
        inflight[(sub.proc, rid)] = sub

    @staticmethod
    def _answers(sub: _Sub, meta: dict) -> list[dict]:
        """The per-part answers of a request (one for a single-slot or unpartitioned one, or a merged LOOKUP)."""
        if "parts" not in sub.route:
            return [meta]
        if meta.get("failed"):
            raise RuntimeError(f"bench: parts failed (the slot map moved during the bench?): {meta['failed']}")
        return meta["parts"] if "parts" in meta else [meta]

    @staticmethod
    def _allocs(answers: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(state, gen) of each key of an ALLOC's answers, in key order: their packed rows (wire VERSION 12)."""
        rows = [np.frombuffer(a["rows"], answerrows.ALLOC_ROW) for a in answers]
        rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return rows["state"], rows["gen"]

    def _hits(self, ans: dict) -> int:
        if self.decode == "locs" or "rows" not in ans:
            answerrows.unpack_locs(ans, "bench")
            return sum(1 for x in ans["locs"] if x is not None)
        return int(np.count_nonzero(np.frombuffer(ans["rows"], answerrows.LOC_ROW)["node"] != answerrows.NO_NODE))

    def run(self, start_at: float, seconds: float) -> dict:
        """One timed phase from ``start_at`` (wall clock, common to the clients) for ``seconds``: the window kept
        full with the plan's batches (lookups cycle through theirs; puts stop at the end of theirs), then every
        request in flight answered. Returns the counts and the time of the last answer."""
        st = {"batches": 0, "requests": 0, "parts": 0, "keys": 0, "committed": 0, "found": 0, "not_new": 0,
              "leases": 0, "released": 0, "flushed": 0,
              "budget_hit": False}
        sel = selectors.DefaultSelector()
        for i, fs in enumerate(self.socks):
            sel.register(fs.sock, selectors.EVENT_READ, i)
        inflight: dict[tuple[int, int], _Sub] = {}
        cycle = self.op == Op.LOOKUP
        active = nxt = 0
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, end, last = time.process_time(), start_at + seconds, time.time()
        drain_by = time.monotonic() + seconds + DRAIN_S
        while True:
            now = time.time()
            while active < self.window and now < end and (cycle or nxt < len(self.plan)):
                subs = self.plan[nxt % len(self.plan)]
                nxt += 1
                counter = [len(subs)]
                for sub in subs:
                    sub.batch = counter
                    meta = {"ns": NS, "keys": sub.keys}
                    if self.op == Op.ALLOC:
                        meta["sizes"] = [self.page_bytes] * len(sub.keys)
                        if sub.parents is not None:
                            meta["parents"] = sub.parents
                    self._send(sub, self.op, meta, inflight, drain_by)
                    st["requests"] += 1
                    st["parts"] += sub.nparts
                    st["keys"] += len(sub.keys)
                st["batches"] += 1
                active += 1
            if not cycle and nxt >= len(self.plan) and now < end:
                st["budget_hit"] = True
            if not inflight:
                if now >= end or not cycle and nxt >= len(self.plan):
                    break
                continue
            if time.monotonic() > drain_by:
                raise RuntimeError(f"bench: {len(inflight)} requests unanswered {DRAIN_S:.0f} s after the phase")
            for key, _ in sel.select(0.2):
                p = key.data
                fs = self.socks[p]
                fr = fs.recv_frame(drain_by)
                sub = inflight.pop((p, fr.request_id))
                wire.raise_for_status(fr, fs.component)
                if self._answer(sub, fr.meta, inflight, st, drain_by):
                    sub.batch[0] -= 1
                    if sub.batch[0] == 0:
                        active -= 1
                        last = time.time()
        sel.close()
        for proc, ids in self.to_release.items():  # the phase's last leases
            st["flushed"] += len(ids)
            for i in range(0, len(ids), MAX_RELEASE):
                self.socks[proc].send_noreply(Op.RELEASE, {"leases": ids[i:i + MAX_RELEASE]}, drain_by)
        self.to_release = {}
        st["t_last"] = last
        st["client_cpu_s"] = time.process_time() - cpu0
        return st

    def _answer(self, sub: _Sub, meta: dict, inflight: dict, st: dict, deadline: float) -> bool:
        """Take one answer; True when ``sub`` is done (False: its COMMIT was sent)."""
        answers = self._answers(sub, meta)
        if sub.op == Op.LOOKUP:
            leases = []
            for a in answers:
                st["found"] += self._hits(a)
                if a.get("lease"):
                    leases.append(a["lease"])
            st["leases"] += len(leases)
            st["released"] += meta.get("released", 0)  # (leases of earlier LOOKUPs this one carried)
            if leases and self.release_next:
                self.to_release.setdefault(sub.proc, []).extend(leases)
            elif leases:
                self.socks[sub.proc].send_noreply(
                    Op.RELEASE, {"lease": leases[0]} if len(leases) == 1 else {"leases": leases}, deadline)
            return True
        if sub.op == Op.ALLOC:
            state, gen = self._allocs(answers)  # the packed rows: one frombuffer an answer
            ok = np.flatnonzero(state == AllocState.NEW).tolist()
            st["not_new"] += len(state) - len(ok)
            if not ok:
                return True
            if len(ok) < len(state):  # only the allocated keys are committed; their parts counted again
                sub.keys, sub.kslots = [sub.keys[i] for i in ok], [sub.kslots[i] for i in ok]
                sub.route = _route_meta(sub.kslots)[0] if self.slots > 1 else {}
            self._send(sub, Op.COMMIT, {"ns": NS, "keys": sub.keys, "gens": gen.take(ok).tolist()}, inflight,
                       deadline)
            return False
        oks = [x for a in answers for x in a["ok"]]
        st["committed"] += sum(oks)
        self.keys += [k for k, x in zip(sub.keys, oks) if x]
        self.kslots += [s for s, x in zip(sub.kslots, oks) if x]
        return True


def client_main(cid: int, conn, window: int, page_bytes: int, decode: str, merge: bool = True, chain: bool = True,
                digests: bool = True, release_next: bool = True) -> None:
    """A client process: obeys the bench's commands on ``conn`` (connect, prep, go, close, exit)."""
    c = BenchClient(cid, window, page_bytes, decode, merge, chain, digests, release_next)
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                c.close()
                return
            out = {"connect": c.connect, "prep": c.prep, "go": c.run, "close": c.close}[cmd](*args)
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001 - the bench process reports it and stops
            conn.send(("error", traceback.format_exc()))


class Clients:
    """The client processes (spawned once, reconnected to each pool) and their command pipes."""

    def __init__(self, n: int, window: int, page_bytes: int, decode: str, merge: bool = True, chain: bool = True,
                 digests: bool = True, release_next: bool = True):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for cid in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=client_main, daemon=True,
                            args=(cid, b, window, page_bytes, decode, merge, chain, digests, release_next))
            p.start()
            self.pipes.append(a)
            self.procs.append(p)

    def ask(self, cmd: str, *args, timeout: float = 120.0) -> list:
        for p in self.pipes:
            p.send((cmd, *args))
        out = []
        for i, p in enumerate(self.pipes):
            if not p.poll(timeout):
                raise SystemExit(f"bench/slots.py: client {i} did not answer {cmd!r} within {timeout:.0f} s")
            status, val = p.recv()
            if status != "ok":
                raise SystemExit(f"bench/slots.py: client {i} failed at {cmd!r}:\n{val}")
            out.append(val)
        return out

    def stop(self) -> None:
        for p in self.pipes:
            try:
                p.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
