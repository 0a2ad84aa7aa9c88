"""``metaserver.table.evict.least`` (a refill's oldest rows) against a stable argsort's first k: keys in order, in
reverse, random, with many ties and with a few outliers, at refill sizes and around the sample's edges."""

import numpy as np
import pytest

from metaserver.table.evict import least


def _keys(kind: str, n: int, rng) -> np.ndarray:
    if kind == "random":
        return rng.permutation(10 * n + 10)[:n].astype(np.uint64)
    if kind == "sorted":
        return np.arange(n, dtype=np.uint64)
    if kind == "reversed":
        return np.arange(n, dtype=np.uint64)[::-1].copy()
    if kind == "ties":
        return rng.integers(0, 50, n).astype(np.uint64)
    return np.where(np.arange(n) % 997 == 0, 0, 5).astype(np.uint64)  # a few old rows, the rest one stamp


@pytest.mark.parametrize("kind", ["random", "sorted", "reversed", "ties", "outliers"])
@pytest.mark.parametrize("n,k", [(31250, 1024), (100000, 1562), (5000, 1024), (1500, 1024), (1024, 1024),
                                 (10, 3), (0, 0)])
def test_least_is_a_stable_argsorts_first_k(kind, n, k):
    key = _keys(kind, n, np.random.default_rng(n + k))
    got = least(key, k)
    assert np.array_equal(got, np.argsort(key, kind="stable")[:k])
