"""What ``metaserver/dataplane.py`` does per request around the directory, minus sockets and etcd, for
``bench/scale.py``'s "wire path" figures: ``Wire`` packs and unpacks requests as msgpack, as the metaserver receives
them; ``ServicePath`` runs LOOKUP+RELEASE, EXISTS and ALLOC+COMMIT the way the handlers do (decode, validate, the
directory call, tags and capabilities of a closed pool, the etcd keys of the deletes and the records of the commits
as ``Metaserver._apply`` encodes them, the connection's pending set, encode). It mirrors
dataplane.lookup/alloc/commit so the figure needs no running metaserver; keep the two in step.

Run alone (``python bench/servicepath.py``) it times ALLOC+COMMIT requests of ``--keys`` new 4 KiB pages into a
directory of ``--nodes`` nodes of ``--capacity`` each (a small capacity: every put evicts) and prints keys per
CPU-second.
"""

from __future__ import annotations

import os
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaserver import validate as v  # noqa: E402
from metaserver.directory import NEW, Directory  # noqa: E402
from metaserver.grants import grant_reads, grant_writes  # noqa: E402
from metaserver.persist import EtcdStore  # noqa: E402
from metaserver.dataplane import _ALLOC, _COMMIT  # noqa: E402
from umbp.auth import Tokens  # noqa: E402


class Wire:
    """Requests packed and unpacked as msgpack, as the metaserver receives them."""

    @staticmethod
    def put(ns: str, keys: list[bytes], sizes: list[int], parents: list) -> dict:
        return msgpack.unpackb(msgpack.packb({"ns": ns, "keys": keys, "sizes": sizes, "parents": parents},
                                             use_bin_type=True), raw=False)

    @staticmethod
    def keys(ns: str, keys: list[bytes]) -> dict:
        return msgpack.unpackb(msgpack.packb({"ns": ns, "keys": keys}, use_bin_type=True), raw=False)


class _Member:
    """What the grants read of a member node: its capability key and epoch."""

    __slots__ = ("cap_key", "cap_epoch")

    def __init__(self, cap_key: bytes):
        self.cap_key = cap_key
        self.cap_epoch = 1


class ServicePath:
    """What ``metaserver/dataplane.py`` does around the directory for LOOKUP+RELEASE and ALLOC+COMMIT, minus sockets and
    etcd: decode, validate, directory call, per-key tag and capability (closed pool), etcd record of each commit,
    encode. Mirrors dataplane.lookup/alloc/commit; kept here so the figure does not need a running metaserver."""

    def __init__(self, d: Directory | None, node_ids: list[str] | None = None):
        """``node_ids``: the members' ids, where ``d`` is not a directory to take them from (``bench/columns.py``)."""
        self.d = d
        self.tokens = Tokens.load("scale-bench-cluster-secret", None, "bench")
        self.members = {nid: _Member(self.tokens.cap_key(nid, b"arena-" + nid.encode()))
                        for nid in (node_ids if node_ids is not None else d.spaces)}
        self.store = EtcdStore("127.0.0.1:2379", "/umbp")  # its key and record encoding only: never connected
        self.conn_pending: set = set()  # the connection's PENDING entries (server.Connection.pending)
        self.gen = 1 << 40

    def lookup(self, frame: bytes) -> bytes:
        ns, keys = self.keys_of(frame)
        lease, locs = self.d.lookup(ns, keys, time.monotonic())
        caps = grant_reads(self.tokens, self.members.get, ns, keys, locs)
        return self.answer_lookup(self.d, {"lease": lease, "locs": locs, "caps": caps})

    @staticmethod
    def keys_of(frame: bytes) -> tuple[str, list]:
        """A LOOKUP request decoded and validated: (namespace, keys)."""
        m = msgpack.unpackb(frame, raw=False)
        return v.ns(m), v.keys(m, 4096)

    @staticmethod
    def answer_lookup(d, ans: dict) -> bytes:
        """The LOOKUP answer encoded, then the client's RELEASE of its lease decoded, validated and applied to
        ``d`` (a directory or a page table)."""
        reply = msgpack.packb(ans, use_bin_type=True)
        rel = msgpack.unpackb(msgpack.packb({"lease": ans["lease"]}), raw=False)
        d.release(v.integer(rel, "lease", 0, (1 << 63) - 1))
        return reply

    def exists(self, frame: bytes) -> bytes:
        m = msgpack.unpackb(frame, raw=False)
        return msgpack.packb({"exists": self.d.exists(v.ns(m), v.keys(m, 4096))}, use_bin_type=True)

    def put(self, frame: bytes) -> int:
        """ALLOC then COMMIT of one request's keys, as dataplane.alloc/_alloc_now, service._apply and dataplane.commit/
        _settle_request/_apply do them: field checks, the connection's pending set (filled by ALLOC, emptied by
        COMMIT), the rewrites of the records the evictions left and the commit's records (``_apply``). Returns the
        number of records the commit wrote."""
        store = self.store
        m = v.fields(msgpack.unpackb(frame, raw=False), _ALLOC, ("ns", "keys", "sizes"))
        ns = v.ns(m)
        keys = v.keys(m, 4096)
        sizes = v.ints(m, "sizes", len(keys), 0, v.MAX_PAYLOAD)
        parents = v.parents(m, len(keys))
        now = time.monotonic()
        items, fx = self.d.alloc(ns, keys, sizes, parents, self.gen, now)
        self.gen += len(keys)
        _apply(store, fx)
        deadline_ms = int((time.time() + 10.0) * 1000)
        out, caps, new = grant_writes(self.tokens, self.members.get, ns, keys, items, deadline_ms)
        pending = self.conn_pending
        if new:
            pd = self.d.pending_keys[ns]
            pending.update([pd[keys[i]] for i in new])
        answer = msgpack.unpackb(msgpack.packb({"items": out, "caps": caps}, use_bin_type=True), raw=False)
        news = [(k, it[4]) for k, it in zip(keys, answer["items"]) if it[0] == NEW]
        c = v.fields(msgpack.unpackb(msgpack.packb({"ns": ns, "keys": [k for k, _ in news],
                                                    "gens": [g for _, g in news]}, use_bin_type=True), raw=False),
                     _COMMIT, ("ns", "keys", "gens"))
        cns = v.ns(c)
        ckeys = v.keys(c, 4096)
        gens = v.ints(c, "gens", len(ckeys), 0, (1 << 63) - 1)
        if pending:
            pd = self.d.pending_keys.get(cns)
            if pd:
                get, discard = pd.get, pending.discard
                for key in ckeys:
                    discard(get(key))
        ok, fx = self.d.commit(cns, ckeys, gens, time.monotonic())
        puts, _deletes = _apply(store, fx)
        msgpack.packb({"ok": ok}, use_bin_type=True)
        return len(puts)


def _apply(store: EtcdStore, fx) -> tuple[list, list]:
    """What ``Metaserver._apply`` and the etcd writer encode: the commit records (``batches_of``, then the writer's
    ``batch_value`` when it takes them), the rewrites of records that pages left (encoded here once a request; the
    writer coalesces a record's rewrites while it waits) and the keys of deleted page records of their own."""
    puts = [(b.name, store.batch_value(b)) for b in store.batches_of(fx.puts)] if fx.puts else []
    if fx.batches:
        puts += [(b.name, store.batch_value(b)) for b in dict.fromkeys(fx.batches)]
    deletes = [store.page_key(ns, k) for ns, k in fx.deletes] if fx.deletes else []
    return puts, deletes


def main() -> None:
    import argparse

    from umbp.sizes import parse_size

    ap = argparse.ArgumentParser(description="ALLOC+COMMIT through the service path: keys per CPU-second")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--keys", type=int, default=128, help="new 4 KiB pages a request")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--capacity", default="4GiB", help="per node (64MiB: a full pool, every put evicts)")
    a = ap.parse_args()
    d = Directory(policy="lru")
    for i in range(a.nodes):
        d.add_space(f"node-{i}", parse_size(a.capacity))
    sp = ServicePath(d)
    frames = [msgpack.packb({"ns": "bench", "keys": [b"c/%d/%d" % (i, j) for j in range(a.keys)],
                             "sizes": [4000] * a.keys, "parents": None}, use_bin_type=True) for i in range(a.requests)]
    t = time.process_time()
    for f in frames:
        sp.put(f)
    dt = time.process_time() - t
    n = a.requests * a.keys
    print(f"servicepath: {n:,} keys in {a.requests:,} ALLOC+COMMIT requests, {a.nodes} node(s) of {a.capacity}: "
          f"{n / dt:,.0f} keys per CPU-second ({dt / n * 1e6:.2f} us a key), {d.evictions:,} evictions")


if __name__ == "__main__":
    main()
