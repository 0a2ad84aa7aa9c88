"""What ``metaserver/handlers/dataplane.py`` does per request around the page table (``metaserver.table.directory.TableDirectory``,
the metaserver's one directory core), minus sockets and etcd, for the "wire path" figures of ``bench/scale.py`` and
``bench/columns.py``: ``Wire`` packs and unpacks requests as msgpack, as the metaserver receives them;
``ServicePath`` runs LOOKUP+RELEASE, EXISTS and ALLOC+COMMIT the way the handlers do (decode, validate, the table's
call, tags and capabilities of a closed pool, the encoding of the commit records and of their rewrites as the etcd
writer encodes them, the connection's pending set, encode). A LOOKUP is the service's own columnar call
(``TableDirectory.lookup_granted(..., packed=True)``: tags kept in a column from a row's first LOOKUP on, one
capability per node packed from the columns, the answer's locations as packed rows, wire VERSION 12); an ALLOC is
``TableDirectory.alloc_placed`` and ``grants.grant_alloc`` (its answer as packed rows too), or with ``--turn N`` one
``TableDirectory.alloc_placed_many`` for N ALLOCs read in one turn (``DataPlane.alloc_many``). It mirrors
dataplane.lookup/alloc/alloc_many/commit so the figure needs no running metaserver; keep the two in step.

Run alone (``python bench/servicepath.py``) it times ALLOC+COMMIT requests of ``--keys`` new 4 KiB pages into a
table of ``--nodes`` nodes of ``--capacity`` each (a small capacity: every put evicts), each page naming the one
before it as its parent as the engines' puts do (``--parents none``: no parents), and prints keys per CPU-second.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaserver import validate as v  # noqa: E402
from metaserver.handlers.dataplane import _ALLOC, _COMMIT, _LOOKUP  # noqa: E402
from metaserver.table.entry import NEW  # noqa: E402
from metaserver.table.grants import grant_alloc  # noqa: E402
from metaserver.store.persist import EtcdStore  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402
from transport import wire  # noqa: E402
from transport import answerrows
from transport.keyform import pick  # noqa: E402
from umbp.auth import Tokens  # noqa: E402


class Wire:
    """Requests as a client of this tree sends them to a metaserver of this tree (msgpack; 32-byte keys packed into
    one bytes value, ``wire.pack_keys``) and as that metaserver reads them (``server.py``: packed keys made
    ``PackedKeys`` by ``validate.unpack_keys`` before a handler runs)."""

    @staticmethod
    def frame(meta: dict) -> bytes:
        return msgpack.packb(wire.pack_keys(meta), use_bin_type=True)

    @staticmethod
    def meta(frame: bytes) -> dict:
        m = msgpack.unpackb(frame, raw=False)
        v.unpack_keys(m)
        return m

    @staticmethod
    def put(ns: str, keys: list[bytes], sizes: list[int], parents: list) -> dict:
        return Wire.meta(Wire.frame({"ns": ns, "keys": keys, "sizes": sizes, "parents": parents}))

    @staticmethod
    def keys(ns: str, keys: list[bytes]) -> dict:
        return Wire.meta(Wire.frame({"ns": ns, "keys": keys}))


class _Member:
    """What the grants read of a member node: its capability key and epoch."""

    __slots__ = ("cap_key", "cap_epoch")

    def __init__(self, cap_key: bytes):
        self.cap_key = cap_key
        self.cap_epoch = 1


class ServicePath:
    """What ``metaserver/handlers/dataplane.py`` does around the table for LOOKUP+RELEASE, EXISTS and ALLOC+COMMIT, minus
    sockets and etcd: decode, validate, the table's call, per-key tags and per-node capabilities (closed pool), the
    commit records' encoding, encode. Mirrors dataplane.lookup/alloc/commit; kept here so the figure does not need a
    running metaserver."""

    LEASE_MS = 10_000  # what a leased LOOKUP answer tells (Metaserver.lease_ms at the default read lease)

    def __init__(self, d: TableDirectory, node_ids: list[str] | None = None):
        """``node_ids``: the members' ids (default: the table's nodes)."""
        self.d = d
        self.tokens = Tokens.load("scale-bench-cluster-secret", None, "bench")
        self.members = {nid: _Member(self.tokens.cap_key(nid, b"arena-" + nid.encode()))
                        for nid in (node_ids if node_ids is not None else list(d.spaces))}
        self.store = EtcdStore("127.0.0.1:2379", "/umbp")  # its key encoding only: never connected
        self.conn_pending: dict = {}  # the connection's PENDING allocations and their rows (server.Connection.pending)
        self.gen = 1 << 40

    def lookup(self, frame: bytes) -> bytes:
        """A LOOKUP answered as ``dataplane.lookup`` answers a VERSION 12 client (packed rows), then its RELEASE."""
        m = v.fields(Wire.meta(frame), _LOOKUP, ("ns", "keys"))
        ns, keys, shard = v.ns(m), v.keys(m, 4096), v.shard(m)
        ans = self.d.lookup_granted(ns, keys, time.monotonic(), None, self.tokens, self.members.get, shard, True)
        if ans["lease"]:
            ans["lease_ms"] = self.LEASE_MS
        return self.answer_lookup(self.d, ans)

    @staticmethod
    def answer_lookup(d: TableDirectory, ans: dict) -> bytes:
        """The LOOKUP answer encoded, then the client's RELEASE of its lease decoded, validated and applied."""
        reply = msgpack.packb(ans, use_bin_type=True)
        rel = msgpack.unpackb(msgpack.packb({"lease": ans["lease"]}), raw=False)
        d.release(v.integer(rel, "lease", 0, (1 << 63) - 1))
        return reply

    def exists(self, frame: bytes) -> bytes:
        m = Wire.meta(frame)
        return msgpack.packb({"exists": self.d.exists(v.ns(m), v.keys(m, 4096))}, use_bin_type=True)

    def put(self, frame: bytes) -> tuple[int, int]:
        """ALLOC then COMMIT of one request's keys: ``puts`` of one."""
        return self.puts([frame])

    def puts(self, frames: list[bytes]) -> tuple[int, int]:
        """ALLOCs read in one turn, then each one's COMMIT, as dataplane.alloc/alloc_many/_alloc_now,
        service._apply and dataplane.commit/_settle_request do them: field checks, one table pass for the turn's
        ALLOCs where ``alloc_placed_many`` takes them (else one at a time), the connection's pending set (filled by
        ALLOC, emptied by COMMIT), the rewrites of the records the evictions left and the commit's records, encoded as
        the etcd writer encodes them (``TableRecord.value``; the writer coalesces a record's rewrites while it waits,
        this encodes them once a request). Returns (keys the COMMITs made READY, commit records they wrote)."""
        asks = []
        for frame in frames:
            m = v.fields(Wire.meta(frame), _ALLOC, ("ns", "keys", "sizes"))
            keys = v.keys(m, 4096)
            asks.append((v.ns(m), keys, v.ints(m, "sizes", len(keys), 0, v.MAX_PAYLOAD), v.parents(m, len(keys))))
        d = self.d
        base = self.gen
        got = d.alloc_placed_many(asks[0][0], [(k, sz, par, None, None) for _, k, sz, par in asks], base,
                                  time.monotonic()) if len(asks) > 1 and len({a[0] for a in asks}) == 1 else None
        if got is not None:
            placed = got[0]
            _apply(self.store, got[1])
        else:
            placed = []
            for ns, keys, sizes, parents in asks:
                placed.append(d.alloc_placed(ns, keys, sizes, parents, self.gen, time.monotonic()))
                self.gen += len(keys)
                _apply(self.store, placed[-1].fx)
        self.gen = base + sum(len(a[1]) for a in asks)
        stored = records = 0
        for (ns, keys, _, _), p in zip(asks, placed):
            deadline_ms = int((time.time() + 10.0) * 1000)
            ans = grant_alloc(self.tokens, self.members.get, ns, keys, p, deadline_ms)  # VERSION 12: packed rows
            pending = self.conn_pending
            if len(p.new):
                pending.update(d.pending_of(ns, keys, p))
            # the client's side, what its COMMIT needs of the answer: the NEW keys and their generations, read from
            # the packed rows with one frombuffer (bench/slots.py's clients read them so)
            rows = np.frombuffer(msgpack.unpackb(msgpack.packb(ans, use_bin_type=True), raw=False)["rows"],
                                 answerrows.ALLOC_ROW)
            ok = np.flatnonzero(rows["state"] == NEW).tolist()
            news = list(zip(pick(keys, ok), rows["gen"].take(ok).tolist()))  # (the client holds its keys as a list)
            c = v.fields(Wire.meta(Wire.frame({"ns": ns, "keys": [k for k, _ in news], "gens": [g for _, g in news]})),
                         _COMMIT, ("ns", "keys", "gens"))
            cns = v.ns(c)
            ckeys = v.keys(c, 4096)
            gens = v.ints(c, "gens", len(ckeys), 0, (1 << 63) - 1)
            at = d.settle_handles(pending, cns, ckeys, gens) if pending else None
            ok, fx = d.commit(cns, ckeys, gens, time.monotonic(), None, at)
            puts, _deletes = _apply(self.store, fx)
            msgpack.packb({"ok": ok}, use_bin_type=True)
            stored += sum(ok)
            records += len(puts)
        return stored, records


def _apply(store: EtcdStore, fx) -> tuple[list, list]:
    """What ``Metaserver._apply`` and the etcd writer encode: the table's new commit records and the rewrites of
    records that pages left (``TableRecord.value``, None: the record is deleted), and the keys of deleted page
    records of their own."""
    puts = [(r.name, r.value()) for r in fx.recs] if fx.recs else []
    if fx.batches:
        puts += [(b.name, b.value()) for b in dict.fromkeys(fx.batches)]
    deletes = [store.page_key(ns, k) for ns, k in fx.deletes] if fx.deletes else []
    return puts, deletes


def bench_key(i: int, j: int, width: int) -> bytes:
    """Key ``j`` of request ``i``: a blake2b digest (32 bytes) or its 64 hex digits and ``_k`` (66 bytes, an SGLang
    page's K object: ``umbp/integrations/sglang/naming.py``)."""
    h = hashlib.blake2b(b"%d/%d" % (i, j), digest_size=32)
    return h.digest() if width == 32 else h.hexdigest().encode() + b"_k"


def main() -> None:
    import argparse

    from umbp.sizes import parse_size

    ap = argparse.ArgumentParser(description="ALLOC+COMMIT through the service path: keys per CPU-second")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--keys", type=int, default=128, help="new 4 KiB pages a request")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--capacity", default="4GiB", help="per node (64MiB: a full pool, every put evicts)")
    ap.add_argument("--key-bytes", type=int, default=66, choices=(32, 66),
                    help="66: SGLang's object names (64 hex digits and '_k'); 32: raw digests, each its own")
    ap.add_argument("--turn", type=int, default=1,
                    help="ALLOCs read in one turn of the metaserver's loop, placed in one table pass (default 1)")
    ap.add_argument("--parents", default="chain", choices=("chain", "none"),
                    help="chain: each page names the one before it as its parent, as the engines' puts do "
                         "(the request's first names the last page of the request before); none: no parents")
    a = ap.parse_args()
    d = TableDirectory(policy="lru")
    for i in range(a.nodes):
        d.add_space(f"node-{i}", parse_size(a.capacity))
    sp = ServicePath(d)
    keys = [[bench_key(i, j, a.key_bytes) for j in range(a.keys)] for i in range(a.requests)]
    frames = [Wire.frame({"ns": "bench", "keys": ks, "sizes": [4000] * a.keys,
                          "parents": [keys[i - 1][-1] if i else None] + ks[:-1] if a.parents == "chain" else None})
              for i, ks in enumerate(keys)]
    t = time.process_time()
    for i in range(0, len(frames), a.turn):
        sp.puts(frames[i:i + a.turn])
    dt = time.process_time() - t
    n = a.requests * a.keys
    print(f"servicepath: {n:,} keys of {a.key_bytes} bytes ({a.parents} parents) in {a.requests:,} ALLOC+COMMIT "
          f"requests ({a.turn} a turn), {a.nodes} node(s) of {a.capacity}: "
          f"{n / dt:,.0f} keys per CPU-second ({dt / n * 1e6:.2f} us a key), {d.evictions:,} evictions")


if __name__ == "__main__":
    main()
