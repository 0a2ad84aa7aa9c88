"""What ``metaserver/service.py`` does per request around the directory, minus sockets and etcd, for
``bench/scale.py``'s "wire path" figures: ``Wire`` packs and unpacks requests as msgpack, as the metaserver receives
them; ``ServicePath`` runs LOOKUP+RELEASE, EXISTS and ALLOC+COMMIT the way the handlers do (decode, validate, the
directory call, tags and capabilities of a closed pool, the etcd record of each commit, encode). It mirrors
service.lookup/alloc/commit so the figure needs no running metaserver; keep the two in step.
"""

from __future__ import annotations

import time

import msgpack

from metaserver import validate as v
from metaserver.directory import NEW, Directory
from metaserver.grants import grant_reads, grant_writes
from metaserver.persist import EtcdStore
from umbp.auth import Tokens


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
    """What ``metaserver/service.py`` does around the directory for LOOKUP+RELEASE and ALLOC+COMMIT, minus sockets and
    etcd: decode, validate, directory call, per-key tag and capability (closed pool), etcd record of each commit,
    encode. Mirrors service.lookup/alloc/commit; kept here so the figure does not need a running metaserver."""

    def __init__(self, d: Directory):
        self.d = d
        self.tokens = Tokens.load("scale-bench-cluster-secret", None, "bench")
        self.members = {nid: _Member(self.tokens.cap_key(nid, b"arena-" + nid.encode())) for nid in d.spaces}
        self.pages_prefix = b"/umbp/pages/"
        self.gen = 1 << 40

    def lookup(self, frame: bytes) -> bytes:
        m = msgpack.unpackb(frame, raw=False)
        ns = v.ns(m)
        keys = v.keys(m, 4096)
        lease, locs = self.d.lookup(ns, keys, time.monotonic())
        caps = grant_reads(self.tokens, self.members.get, ns, keys, locs)
        reply = msgpack.packb({"lease": lease, "locs": locs, "caps": caps}, use_bin_type=True)
        rel = msgpack.unpackb(msgpack.packb({"lease": lease}), raw=False)
        self.d.release(v.integer(rel, "lease", 0, (1 << 63) - 1))
        return reply

    def exists(self, frame: bytes) -> bytes:
        m = msgpack.unpackb(frame, raw=False)
        return msgpack.packb({"exists": self.d.exists(v.ns(m), v.keys(m, 4096))}, use_bin_type=True)

    def put(self, frame: bytes) -> int:
        m = msgpack.unpackb(frame, raw=False)
        ns = v.ns(m)
        keys = v.keys(m, 4096)
        sizes = v.ints(m, "sizes", len(keys), 0, v.MAX_PAYLOAD)
        parents = v.parents(m, len(keys))
        now = time.monotonic()
        items, _fx = self.d.alloc(ns, keys, sizes, parents, self.gen, now)
        self.gen += len(keys)
        deadline_ms = int((time.time() + 10.0) * 1000)
        out, caps, _new = grant_writes(self.tokens, self.members.get, ns, keys, items, deadline_ms)
        answer = msgpack.unpackb(msgpack.packb({"items": out, "caps": caps}, use_bin_type=True), raw=False)
        news = [(k, it[4]) for k, it in zip(keys, answer["items"]) if it[0] == NEW]
        c = msgpack.unpackb(msgpack.packb({"ns": ns, "keys": [k for k, _ in news], "gens": [g for _, g in news]},
                                          use_bin_type=True), raw=False)
        cns = v.ns(c)
        ckeys = v.keys(c, 4096)
        gens = v.ints(c, "gens", len(ckeys), 0, (1 << 63) - 1)
        ok, fx = self.d.commit(cns, ckeys, gens, time.monotonic())
        pfx = self.pages_prefix
        records = [(pfx + e.ns.encode() + b"/" + e.key.hex().encode(),
                    EtcdStore.page_value(e.node_id, e.offset, e.payload_len, e.gen, e.parent)) for e in fx.puts]
        msgpack.packb({"ok": ok}, use_bin_type=True)
        return len(records)
