"""KV events (metaserver/handlers/kvevents.py) without a pool: the directory's hooks report exactly the pages that become
READY and those that leave (commit, eviction at a full node, remove, a lost node), grouped into chained
``BlockStored`` events; the publisher's wire (topic, 8-byte seq, msgpack batch in vLLM's array-like layout) and its
replay socket. vLLM's own classes decode the same bytes in tests/test_kv_events.py (engines venv).
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from metaserver.handlers import kvevents
from processes import eventually
from metaserver.table.entry import NEW
from metaserver.table.directory import TableDirectory
from transport.objformat import ALIGN
from umbp.config import MetaserverConfig
from umbp.errors import ConfigError

PAGE = ALIGN - 64
NS = "llama/mha/p16/bf16"


class Recorder:
    """A publisher stand-in: what a sink publishes, in order."""

    def __init__(self):
        self.batches: list[tuple[str, list[dict]]] = []
        self.sinks: set = set()

    def publish(self, topic, events):
        self.batches.append((topic, events))

    def snapshot(self, jobs):
        for ns, keys, parents, removed in jobs:
            self.batches.append((ns, [kvevents.removed_event(keys)] if removed
                                 else kvevents.chain_events(ns, keys, parents)))


def put(d, ns, keys, parents=None, gen=100):
    items, _ = d.alloc(ns, keys, [PAGE] * len(keys), parents, gen, 0.0)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, _ = d.commit(ns, [k for k, _ in news], [g for _, g in news], 0.0)
    assert all(ok)
    return [k for k, _ in news]


def events(rec):
    return [(topic, ev) for topic, evs in rec.batches for ev in evs]


def ready(d) -> dict[str, list[bytes]]:
    return {ns: keys for ns, keys, _ in d.links.snapshot()}


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_directory_hooks_report_stored_chains_and_every_page_that_leaves(policy):
    d = TableDirectory(policy=policy)
    d.add_space("n1", 6 * ALIGN)  # six pages
    d.add_space("n2", 2 * ALIGN)
    rec = Recorder()
    kvevents.attach(rec, d)  # empty directory: nothing to announce (no event loop here: each call publishes)
    assert rec.batches == [] and d.kv_sink is not None
    a = [b"a%d" % i for i in range(4)]
    put(d, NS, a, parents=[None] + a[:-1])
    d.kv_sink.flush()
    # one chain: one BlockStored of four hashes, parent None, block size from the namespace's p16
    assert events(rec) == [(NS, kvevents.stored_event(a, None, 16))]
    rec.batches.clear()
    b = [b"b%d" % i for i in range(4)]  # onto n1 only: 4 + 4 > 6 pages, two of a evicted to make room
    d.set_placeable("n2", False)
    put(d, "other", b, parents=[b"x"] + b[:-1], gen=200)
    d.kv_sink.flush()
    got = events(rec)
    removed = [h for t, ev in got if ev["type"] == "BlockRemoved" for h in ev["block_hashes"]]
    stored = [(t, ev["block_hashes"], ev["parent_block_hash"]) for t, ev in got if ev["type"] == "BlockStored"]
    assert sorted(removed) == sorted(k for k in a if k not in ready(d).get(NS, []))
    assert len(removed) == 2 and stored == [("other", b, b"x")]
    assert all(t == NS for t, ev in got if ev["type"] == "BlockRemoved")
    # under prefix-lru the chain's leaves go first (a3, then a2, a leaf by then), under lru its head
    assert removed == ([a[3], a[2]] if policy == "prefix-lru" else a[:2])
    d.set_placeable("n2", True)
    d.set_placeable("n1", False)
    c = [b"c0", b"c1"]
    put(d, "third", c, gen=300)  # onto n2
    rec.batches.clear()
    d.remove("other", [b[0], b"absent"])
    d.drop_space("n2")  # a lost node: its pages go
    d.kv_sink.flush()
    got = events(rec)
    assert {ev["type"] for _, ev in got} == {"BlockRemoved"}
    assert [(t, h) for t, ev in got for h in ev["block_hashes"]] == [("other", b[0]), ("third", c[0]),
                                                                     ("third", c[1])]
    # Detaching the only directory clears; attaching again announces what it holds.
    kvevents.detach(rec, d)
    assert d.kv_sink is None and rec.batches[-1] == ("", [kvevents.CLEARED])
    rec.batches.clear()
    kvevents.attach(rec, d)
    held = {k for t, ev in events(rec) for k in ev["block_hashes"]}
    assert held == {k for r in ready(d).values() for k in r} and len(held) == 5
    # the announcement names each page's parent under prefix-lru (the chain b1..b3 is one event; b0 was removed);
    # under lru the table keeps no links, so each page is its own event
    want = [(b[1:], b[0])] if policy == "prefix-lru" else [([k], None) for k in b[1:]]
    assert [(ev["block_hashes"], ev["parent_block_hash"]) for t, ev in events(rec) if t == "other"] == want


def test_sink_keeps_order_within_a_namespace_and_splits_chains():
    rec = Recorder()
    sink = kvevents.Sink(rec, None)
    sink.scheduled = True  # flush by hand

    sink.stored_keys(NS, [b"1", b"2", b"9", b"3"], [None, b"1", b"7", b"2"])
    sink.removed_keys(NS, [b"2"])
    sink.stored_keys(NS, [b"4"], [b"3"])
    sink.flush()
    assert rec.batches == [(NS, [kvevents.stored_event([b"1", b"2"], None, 16),
                                 kvevents.stored_event([b"9"], b"7", 16), kvevents.stored_event([b"3"], b"2", 16),
                                 kvevents.removed_event([b"2"]), kvevents.stored_event([b"4"], b"3", 16)])]


def recv(sock, timeout_ms=5000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart()


def test_publisher_wire_and_replay():
    pub = kvevents.Publisher("tcp://127.0.0.1:0", replay_batches=3)
    ctx = zmq.Context()
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint
        for i in range(4):
            pub.publish(NS, [kvevents.stored_event([bytes([i]) * 32], None, 16)])
        eventually(lambda: pub.seq == 5, 5.0, "the publisher's thread sending the queued batches")
        req = ctx.socket(zmq.DEALER)  # one request, many answers: a DEALER (a REQ takes one answer only)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        got = [recv(req)[1:]]
        while got[-1][1] != kvevents.END_SEQ:
            got.append(recv(req)[1:])
        # 5 batches were sent (AllBlocksCleared at seq 0, then 4); the buffer keeps the last 3
        assert [int.from_bytes(f[1], "big") for f in got[:-1]] == [2, 3, 4] and got[-1] == [b"", kvevents.END_SEQ, b""]
        topic, seq, payload = got[-2]
        ts, evs, dp = msgpack.unpackb(payload, raw=False)
        assert topic == NS.encode() and dp == 0 and ts > 0
        assert evs == [{"type": "BlockStored", "block_hashes": [b"\x03" * 32], "parent_block_hash": None,
                        "token_ids": [], "block_size": 16, "lora_id": None, "medium": "UMBP", "lora_name": None}]
        # A live subscriber gets the next batch with the next seq.
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        for _ in range(50):  # a PUB drops what it sends before the subscription arrived: send until one lands
            pub.publish("", [kvevents.CLEARED])
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") >= 5 and msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
        sub.close(0)
        req.close(0)
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_config_refuses_bad_endpoints():
    assert MetaserverConfig(kv_events="tcp://127.0.0.1:5557").kv_events
    for bad in ("127.0.0.1:5557", "tcp://host", "ipc:///tmp/x"):
        with pytest.raises(ConfigError, match="kv_events must be tcp://HOST:PORT"):
            MetaserverConfig(kv_events=bad)
    with pytest.raises(Exception, match="cannot bind"):
        kvevents.Publisher("tcp://203.0.113.1:0")  # not an address of this host
