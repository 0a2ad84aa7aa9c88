"""Chained page keys: prefix sharing, partial pages, rank naming and split."""

from umbp import keys


def test_chained_keys_share_exactly_the_common_prefix():
    a = list(range(256))
    b = list(range(192)) + [9999] * 64
    ka, kb = keys.chain_keys(a, 64), keys.chain_keys(b, 64)
    assert len(ka) == len(kb) == 4
    assert ka[:3] == kb[:3] and ka[3] != kb[3]
    assert len(set(ka)) == 4 and all(len(k) == 64 for k in ka)
    assert keys.chain_keys(a[:100], 64) == ka[:1]  # the partial page has no key
    assert keys.chain_keys(a[64:], 64, parent=ka[0]) == ka[1:]


def test_parents_ranks_and_split():
    ks = keys.chain_keys(list(range(64 * 5)), 64)
    assert keys.parents_of(ks) == [None] + ks[:-1]
    assert keys.rank_key("k", None) == "k" and keys.rank_key("k", 3) == "k_3"
    parts = [keys.split_for_ranks(ks, 2, r) for r in range(2)]
    assert parts == [[0, 2, 4], [1, 3]]
    assert keys.namespace("llama", "mha", 64) == "llama/mha/p64/bf16"
