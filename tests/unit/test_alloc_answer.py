"""An ALLOC answer as the client keeps it (umbp/lookup.py ``alloc_rows``): the packed rows checked at once, the
per-key ``items`` list made only when read, equal to what ``answerrows.unpack_allocs`` makes."""

from __future__ import annotations

import numpy as np
import pytest

from transport import answerrows, wire
from umbp.errors import ProtocolError
from umbp.lookup import AllocAnswer, alloc_rows


def _answer(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows = np.zeros(n, answerrows.ALLOC_ROW)
    state = rng.integers(0, 4, n)
    new = state == wire.AllocState.NEW
    rows["state"] = state
    rows["node"] = np.where(new, rng.integers(0, 3, n), answerrows.NO_NODE)
    for f in ("off", "len", "gen", "tag"):
        rows[f] = np.where(new, rng.integers(1, 1 << 40, n), 0)
    return {"nodes": ["n0", "n1", "n2"], "caps": [b"a", b"b", b"c"], "rows": rows.tobytes()}


@pytest.mark.parametrize("seed", range(5))
def test_items_made_on_first_read_equal_the_eager_list(seed):
    lazy = alloc_rows(_answer(64, seed), "test")
    assert isinstance(lazy, AllocAnswer) and "items" not in lazy and len(lazy["alloc_rows"]) == 64
    eager = answerrows.unpack_allocs(_answer(64, seed), "test")
    assert lazy["items"] == eager["items"] and "items" in lazy  # made once, kept


def test_malformed_rows_fail_at_once_not_when_read():
    bad = _answer(8, 1)
    rows = np.frombuffer(bad["rows"], answerrows.ALLOC_ROW).copy()
    rows["state"][0], rows["node"][0] = wire.AllocState.NEW, 7  # a node beyond the three named
    bad["rows"] = rows.tobytes()
    with pytest.raises(ProtocolError, match="ALLOC"):
        alloc_rows(bad, "test")


def test_a_version_11_answer_is_left_as_it_came():
    old = {"items": [[1, None, None, None, None]], "caps": []}
    assert alloc_rows(dict(old), "test") == old
