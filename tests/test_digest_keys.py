"""Digest keys in their one raw form (``umbp.keys.digest_key``) through a real etcd, metaserver and node: the hex
text a client passes, its bytes and its raw 32 bytes name one page; the metaserver converts hex text it receives
on the wire (a client that does not convert still finds the page); the etcd record is named by the raw form's 64 hex
characters, and a record named the old way (by the hex text's hex) is deleted at a load, never served."""

from __future__ import annotations

import asyncio
import hashlib

import msgpack

import umbp
from cluster import NotYet, eventually
from metaserver.table.records import pages_of
from test_failover import PREFIX, raw
from test_pool import payload
from transport.wire import Op


def digests(n: int, tag: str = "d") -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def page_records(etcd_url: str) -> dict[bytes, bytes]:
    import aetcd

    async def go():
        host, port = etcd_url.split("//")[-1].rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as cl:
            return {kv.key: kv.value for kv in await cl.get_prefix(f"{PREFIX}/pages/".encode())}

    return asyncio.run(go())


def put_record(etcd_url: str, key: bytes, value: bytes) -> None:
    import aetcd

    async def go():
        host, port = etcd_url.split("//")[-1].rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as cl:
            await cl.put(key, value)

    asyncio.run(go())


def test_hex_text_bytes_and_raw_digest_name_one_page(cluster):
    hexes = digests(40)
    ranked = [f"{h}_3" for h in hexes[:10]]
    with umbp.Client(cluster.metaserver_addr) as c:
        assert all(c.batch_put(hexes + ranked, [payload(k, 2000) for k in hexes + ranked]))
        # bytes of the hex text and the raw digest find the same pages, and read the same bytes
        assert c.batch_exists([h.encode() for h in hexes]) == [True] * 40
        assert c.batch_exists([bytes.fromhex(h) for h in hexes]) == [True] * 40
        assert c.batch_exists([bytes.fromhex(h) + b"\x03" for h in hexes[:10]]) == [True] * 10
        outs = [bytearray(2000) for _ in hexes]
        assert c.batch_get_into([bytes.fromhex(h) for h in hexes], outs) == [2000] * 40
        assert all(bytes(o) == payload(h, 2000) for h, o in zip(hexes, outs))
        assert c.put(bytes.fromhex(hexes[0]), b"again") is False  # the same page: EXISTS
    # a raw request carrying the hex text (a client that does not convert) finds them too
    ans = raw(cluster.metaserver_addr, Op.EXISTS, {"ns": "default", "keys": [h.encode() for h in hexes] + [b"x"]})
    assert ans["exists"] == [True] * 40 + [False]
    # etcd's commit records hold each key in its raw form: 32 bytes (33 with the rank byte), not the text's 64
    keys = [p[0] for v in page_records(cluster.etcd.url).values() for p in pages_of(v)]
    assert sorted(keys) == sorted([bytes.fromhex(h) for h in hexes] + [bytes.fromhex(h) + b"\x03" for h in hexes[:10]])


def test_record_named_by_hex_text_is_deleted_at_load(cluster):
    hexes = digests(5, "legacy")
    with umbp.Client(cluster.metaserver_addr) as c:
        assert all(c.batch_put(hexes, [payload(h, 1000) for h in hexes]))
    recs = page_records(cluster.etcd.url)
    (new_name, value), = recs.items()  # one commit record
    assert len(pages_of(value)) == 5
    # A page record of its own (the layout before commit records) for hexes[0] under the old name (hex of the
    # 64-character text), pointing at the same slot
    old_name = f"{PREFIX}/pages/default/{hexes[0].encode().hex()}".encode()
    _key, node_id, off, plen, gen, parent = next(p for p in pages_of(value)
                                                 if p[0] == bytes.fromhex(hexes[0]))
    put_record(cluster.etcd.url, old_name, msgpack.packb([node_id, off, plen, gen + 1, parent], use_bin_type=True))
    cluster.metaserver.restart()
    cluster.wait_nodes()
    def deleted() -> dict:  # the stale record's delete goes through the writer
        recs = page_records(cluster.etcd.url)
        if old_name in recs:
            raise NotYet(f"etcd holds {sorted(recs)}")
        return recs

    recs = eventually(deleted, 10.0, "the stale page record deleted from etcd")
    assert old_name not in recs and list(recs) == [new_name] and recs[new_name] == value
    with umbp.Client(cluster.metaserver_addr) as c:
        assert c.batch_exists(hexes) == [True] * 5
        outs = [bytearray(1000) for _ in hexes]
        assert c.batch_get_into(hexes, outs) == [1000] * 5  # the page's own record, its own generation
        assert all(bytes(o) == payload(h, 1000) for h, o in zip(hexes, outs))
