"""The cold load's column paths (metaserver/table/records.py ``unpack_segment``/``Segment.digests``,
metaserver/table/snapshot.py ``PageRecords.columns``): a segment whose keys are all of one length takes them as one
blob (no gather), its checks refuse what they refused before, and each node's columns hold the pages the slow path
(``PageRecords.done``: an entry a page) lists, in commit order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metaserver.table.entry import MAX_SHARDS, SHARD_SHIFT
from metaserver.table.index import digests
from metaserver.table.records import pack_segment, unpack_segment
from metaserver.table.snapshot import PageRecords

PREFIX = b"/umbp/pages/"


def seg33(keys: list[bytes], lens=True, digs=True, gen0: int = 5, codes=(4096,)) -> bytes:
    n = len(keys)
    return pack_segment(["m"], None, ["n0"], None, list(range(1, n + 1)), list(codes), [i % len(codes) for i in range(n)],
                        [gen0 + i for i in range(n)], b"".join(keys), 32,
                        [len(k) for k in keys] if lens else None, digs=digests(keys)[0] if digs else None)


@pytest.mark.parametrize("klen", [33, 32, 40])
def test_keys_of_one_length_given_with_lengths_come_as_one_blob(klen):
    keys = [bytes([i]) * klen for i in range(1, 21)]
    s = unpack_segment(seg33(keys))
    assert s.same_len == klen and s.key_list() == keys
    dig, longs = s.digests()
    assert (dig == digests(keys)[0]).all()
    want = [] if klen == 32 else list(enumerate(keys))
    assert list(longs) == want and len(longs) == len(want)
    if klen != 32:
        assert longs.blob == b"".join(keys) and longs.ends.tolist() == [klen * (i + 1) for i in range(20)]


def test_keys_of_several_lengths_are_gathered_as_before():
    keys = [bytes([i]) * (32 if i % 3 else 33) for i in range(1, 22)]
    s = unpack_segment(seg33(keys))
    assert s.same_len == 0 and s.key_list() == keys
    dig, longs = s.digests()
    assert (dig == digests(keys)[0]).all()
    assert list(longs) == [(i, k) for i, k in enumerate(keys) if len(k) == 33]


def test_the_checks_refuse_what_they_refused():
    good = [bytes([i]) * 33 for i in range(1, 5)]
    unpack_segment(seg33(good, gen0=(1 << 63) - 4))  # the largest generation that fits
    with pytest.raises(ValueError, match="generation"):
        unpack_segment(seg33(good, gen0=(1 << 63) - 3))
    with pytest.raises(ValueError, match="layout code"):
        unpack_segment(seg33(good, codes=(4096, (MAX_SHARDS + 1) << SHARD_SHIFT)))
    with pytest.raises(ValueError, match="layout code"):
        unpack_segment(seg33(good, codes=(1 << 63,)))
    for bad in ([b"x" * 33, b""], [b"x" * 33, b"ab" * 32]):  # an empty key; a 64-byte key not in its digest form
        with pytest.raises(ValueError, match="one form"):
            unpack_segment(seg33(bad, digs=False))
    assert unpack_segment(seg33([b"x" * 70, b"y" * 33], digs=False)).same_len == 0
