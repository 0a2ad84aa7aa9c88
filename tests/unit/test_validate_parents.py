"""An ALLOC's ``parents`` (``metaserver/validate.py``): each named by the pool's one key form, bad ones refused by
index, the request's own list left as it came."""

from __future__ import annotations

import os

import pytest

from metaserver import validate as v
from transport.keyform import digest_key


def test_parents_take_the_digest_form_of_keys_and_only_that():
    h = os.urandom(32).hex().encode()
    given = [None, h, h + b"_3", h + b"_0_k", h + b"_k", os.urandom(32), b"x", h + b"_03", h + b"_256", h.upper()]
    meta = {"parents": list(given)}
    got = v.parents(meta, len(given))
    assert got == [None if p is None else digest_key(p) for p in given]
    assert got[1] == bytes.fromhex(h.decode()) and got[2] == bytes.fromhex(h.decode()) + b"\x03"
    assert got[3:] == given[3:]  # page names, digests, short keys and what is no digest text stay as they are
    assert meta["parents"] == given  # the request's list is not rewritten in place


def test_bad_parents_are_refused_by_index():
    with pytest.raises(v.Reject, match=r"parents\[1\] must be 1\.\."):
        v.parents({"parents": [b"a", b""]}, 2)
    with pytest.raises(v.Reject, match=r"parents\[0\] must be"):
        v.parents({"parents": ["text"]}, 1)
    with pytest.raises(v.Reject, match=r"parents\[2\] must be"):
        v.parents({"parents": [None, b"a", b"k" * (v.MAX_KEY + 1)]}, 3)
    with pytest.raises(v.Reject, match="parents has 1 items, keys has 2"):
        v.parents({"parents": [None]}, 2)
    assert v.parents({}, 3) is None
