"""The array pieces of the read path (no processes): the header checks over arrays agree with
``objformat.check_object_header`` row by row, a LOOKUP answer's rows give the same ``locs`` as ``answerrows.unpack_locs``,
slot parts join in key order, and the location cache's rows round-trip."""

from __future__ import annotations

import random

import numpy as np
import pytest

from transport import answerrows, objformat
from transport.base import headers_match
from umbp.errors import CorruptionError, ProtocolError
from umbp.lookup import answer_rows, merge
from umbp.speculate import LocationCache, Speculation


def test_array_header_check_agrees_with_the_per_page_check():
    rng = random.Random(7)
    heads, want, expect = [], [], []
    for _ in range(400):
        tag, gen, plen = rng.getrandbits(64), rng.getrandbits(63), rng.randrange(1, 1 << 40)
        h = bytearray(objformat.pack_object_header(tag, gen, plen, checksum=rng.getrandbits(32) if rng.random() < 0.2
                                              else None))
        if rng.random() < 0.5:  # one flipped bit anywhere in the first 40 bytes (or the reserved tail)
            h[rng.randrange(64)] ^= 1 << rng.randrange(8)
        heads.append(bytes(h))
        want.append((tag, gen, plen))
        try:
            ok = objformat.check_object_header(bytes(h), "t", tag, gen, plen) is None
        except CorruptionError:
            ok = False
        expect.append(ok)
    arr = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, 64)
    tag, gen, plen = (np.array(c, np.uint64) for c in zip(*want))
    assert headers_match(arr, tag, gen, plen).tolist() == expect
    assert objformat.crc32_rows(arr[:, :36]).tolist() == [__import__("zlib").crc32(h[:36]) for h in heads]


def _answer(hit, nodes, caps):
    n = len(hit)
    idx = np.flatnonzero(hit)
    return {"lease": 3, "nodes": nodes, "caps": caps, "rows": answerrows.pack_locs(
        np.array(hit), idx + 100, idx + 1, idx * 10 + 5, idx * 4096 + 4096, idx % max(1, len(nodes)))}


def test_answer_rows_give_the_same_locs_and_reject_bad_rows():
    a = _answer([True, False, True, True], ["n0", "n1"], [b"c0", b"c1"])
    ans = answer_rows(dict(a), "t")
    assert ans["rows"]["off"].tolist() == [4096, 0, 3 * 4096, 4 * 4096]
    assert ans["locs"] == answerrows.unpack_locs(dict(a), "t")["locs"]
    assert "locs" in ans and ans["lease"] == 3
    with pytest.raises(ProtocolError):
        answer_rows({"nodes": ["n0"], "rows": a["rows"]}, "t")  # a row names node 1 of one
    with pytest.raises(ProtocolError):
        answer_rows({"nodes": [], "rows": b"x" * 7}, "t")


def test_parts_join_in_key_order_with_node_indices_shifted():
    p0 = answer_rows(_answer([True, True, False], ["a"], [b"ca"]), "t")
    p1 = answer_rows(_answer([True, False], ["b", "c"], [b"cb", b"cc"]), "t")
    out = merge([([0, 2, 4], p0), ([3, 1], p1)], 5)
    locs = out["locs"]
    assert [loc[0] if loc else None for loc in locs] == ["a", None, "a", "b", None]
    assert out["nodes"] == ["a", "b", "c"] and out["caps"] == [b"ca", b"cb", b"cc"]
    assert locs[3][1:5] == p1["locs"][0][1:5] and locs[2][1:5] == p0["locs"][1][1:5]


def test_location_cache_rows_round_trip_and_settle():
    c = LocationCache(100)
    a = answer_rows(_answer([True, False, True], ["n0", "n1"], [b"c0", b"c1"]), "t")
    keys = [b"k0", b"k1", b"k2"]
    c.learn([b"k1"], [("old", 1, 2, 3, 4, None)])  # a location the per-page path learned
    c.learn_rows(keys, a["rows"], a["nodes"], a["caps"])
    assert [c.get(k) for k in keys] == [("n0", 4096, 5, 1, 100, b"c0"), None, ("n0", 3 * 4096, 25, 3, 102, b"c0")]
    rows, node = c.rows(keys + [b"nope"])
    assert node.tolist() == [0, -1, 0, -1] and rows["off"][[0, 2]].tolist() == [4096, 3 * 4096]
    s = Speculation(limit=10)
    done = s.settle_rows((rows, node), np.array([True, True, False, True]), rows, node)
    assert done.tolist() == [True, False, False, False] and (s.hits, s.wasted) == (1, 1)
    assert c.forget_node("n0") == 2 and len(c) == 0
