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
from transport.keyform import digests as _digest_rows
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


def _spy_packing(monkeypatch) -> tuple[list, object]:
    """Record every ``wire.pack_keys`` call as (digests asked, what it packed); returns the record and the real
    function."""
    from transport import wire

    sent, real = [], wire.pack_keys

    def spy(meta, digests=False):
        got = real(meta, digests)
        sent.append((digests, got))
        return got

    monkeypatch.setattr(wire, "pack_keys", spy)
    return sent, real


def test_lookups_go_as_digests_and_a_reloaded_pages_read_tag_comes_from_its_own_key(cluster, monkeypatch):
    """A client's LOOKUP, EXISTS and PREFIX carry each key as its 32-byte digest (the metaserver's HELLO says
    ``digest_keys``): the directory files keys by digest, so it finds the same rows and hashes no key. Keys of every
    form: SGLang's page names (66 bytes, their own form), short names, hex text (its raw 32 bytes), rank keys (33).
    A row's read tag is computed at its first LOOKUP after a load, which here names it by digest: from the row's own
    key, so the reloaded pages read back byte for byte, and so they do for a LOOKUP that names the keys themselves."""
    import umbp.metaclient as metaclient
    from transport import keyform

    names = [f"{h}_k" for h in digests(20, "n")]
    short = [f"s{i}" for i in range(10)]
    hexes = digests(10, "h")
    ranked = [f"{h}_7" for h in digests(5, "r")]
    keys = names + short + hexes + ranked
    data = {k: payload(k, 1500) for k in keys}
    with umbp.Client(cluster.metaserver_addr) as c:
        assert all(c.batch_put(keys, [data[k] for k in keys]))
    cluster.metaserver.restart()  # a full load: every row's read tag is computed again at its first LOOKUP
    cluster.wait_nodes()
    sent, real = _spy_packing(monkeypatch)
    asked = keys + ["absent-page"]
    with umbp.Client(cluster.metaserver_addr) as c:
        outs = [bytearray(1500) for _ in asked]
        assert c.batch_get_into(asked, outs) == [1500] * len(keys) + [-1]
        assert [bytes(o) for o in outs[:-1]] == [data[k] for k in keys]
        assert c.batch_exists(asked) == [True] * len(keys) + [False]
    forms = [keyform.digest_forms([k.encode()], [len(k)])[0] for k in asked]
    want = keyform.digests(forms)[0].tobytes()
    lookups = [m for d, m in sent if d and m.get("keys") == want]
    assert len(lookups) >= 2 and all("key_width" not in m for m in lookups), sent  # LOOKUP, EXISTS: 32 bytes a key
    # a client that names the keys themselves (as before digest keys) reads the same bytes: the tags kept are right
    monkeypatch.setattr(metaclient, "_packed", lambda conn, op, meta: real(meta) if conn.packed_keys else meta)
    with umbp.Client(cluster.metaserver_addr) as c:  # (a new client: no locations remembered)
        outs = [bytearray(1500) for _ in keys]
        assert c.batch_get_into(keys, outs) == [1500] * len(keys)
        assert [bytes(o) for o in outs] == [data[k] for k in keys]


def test_keys_the_full_digest_memory_cannot_take_go_as_digests_not_kept_and_read_back(cluster, monkeypatch):
    """A client whose memory of key digests is full (``keyform.digest_blob``: it keeps what it holds and takes no
    more) sends a LOOKUP of keys it neither holds nor can take as their digests all the same, hashed for the request
    and not kept, so the metaserver hashes none; the pages read back byte for byte. Its STATS show the memory."""
    from transport import keyform

    keys = [f"{h}_k" for h in digests(12, "full")]
    data = {k: payload(k, 900) for k in keys}
    with umbp.Client(cluster.metaserver_addr) as c:
        assert all(c.batch_put(keys, [data[k] for k in keys]))
    monkeypatch.setattr(keyform, "MEMO_KEYS", 4)
    monkeypatch.setattr(keyform, "_MEMO", {b"other-%d" % i: bytes(32) for i in range(4)})  # full of other keys
    monkeypatch.setattr(keyform, "_FULL", [False, 0, 0])
    sent, real = _spy_packing(monkeypatch)
    with umbp.Client(cluster.metaserver_addr) as c:
        outs = [bytearray(900) for _ in keys]
        assert c.batch_get_into(keys, outs) == [900] * len(keys)
        assert [bytes(o) for o in outs] == [data[k] for k in keys]
        st = c.stats()["client"]
    asked = [m for d, m in sent if d and m.get("ns") is not None]
    want = _digest_rows([k.encode() for k in keys])[0].tobytes()  # each 66-byte name's blake2b, packed
    assert asked and all(m["keys"] == want and "key_width" not in m for m in asked), sent
    assert sorted(keyform._MEMO) == [b"other-%d" % i for i in range(4)]  # kept what it held
    assert (st["digest_keys"], st["digest_keys_limit"], st["digest_passed_full"]) == (4, 4, len(keys) * len(asked))
