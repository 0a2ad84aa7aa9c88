"""Chained page keys: prefix sharing, partial pages, rank naming and split."""

import random

import pytest

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


# Vectors computed with SGLang 0.5.23's own native hash (sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, compiled
# from the wheel, called through its native_hash.get_native_hash with page_size): they pin the byte format.
SGL_PAGES4 = ["1d533aec2cd826f8f398589c20e169718d95dc7b123918889d58e0d09b7960c7",
              "2be5b730d7617a19b1b69dac4c2006c6e7bfd529c18f7580d47ab872f44b17bb",
              "90a04688b0ce8b4e82f689cd33ebedb79508e1da7d9c19f0a8bedc2cfaf928d2"]
SGL_SEED = "df3c1352162eaa748618b2b650a1c2a650963edc6dc8f59db1f798d0c9039a46"  # seed("lora-a", "salt")
SGL_SEEDED = ["a15f4d1d1110cdf91a87a95e9d59358c43817d828e415bd39b2a5079eea8cf80",
              "c9c391da06ce9d5359d15831ac119270ba9893498c55e3634e7f120f7e33aa6a",
              "565e33af049bd204484ac7b0bc380e4eb2c904aac0914e43fbb488a9e9bd3ff6"]
SGL_TUPLES = ["cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
              "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"]
SGL_U32_EDGE = ["5981693c8df83eea16da42a0f748facb299546688544a0c2887ed5ffbf086e86",
                "5282e418a86c66022ad1faa50289c3f876e81cc0149fe104b3c1e6a3aba68584"]


def test_keys_match_sglang_vectors():
    toks = list(range(1000, 1012))
    assert keys.chain_keys(toks, 4) == SGL_PAGES4
    assert keys.chain_keys(toks[4:], 4, parent=SGL_PAGES4[0]) == SGL_PAGES4[1:]
    assert keys.storage_namespace_seed("lora-a", "salt") == SGL_SEED
    assert keys.storage_namespace_seed(None, None) == ""
    assert keys.chain_keys(toks, 4, extra_key="lora-a", cache_salt="salt") == SGL_SEEDED
    assert keys.chain_keys(toks, 4, parent=SGL_SEED) == SGL_SEEDED
    assert keys.chain_keys([(1, 2), (3, 4), (5, 6), (7, 8)], 2) == SGL_TUPLES
    assert keys.chain_keys([0, 2**32 - 1, 7, 123456], 2) == SGL_U32_EDGE
    # an id past 2**32-1 makes its page "wide" (0xff tag, 8-byte ids); the next page is regular again
    assert keys.chain_keys([5, 2**33, 9, 10], 2) == [
        "a906f94ecc3445d17f46e328299e9efc07e9a7750d074c5808e2b8624062e2f5",
        "3a0ec5d4a66ab332883e4630c0ab13e1d814ac60a8ed46be591b1beb39bf2d78"]


def test_bad_token_ids_and_page_size_raise_invalid_argument():
    from umbp.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="^keys: token ids must be non-negative$"):
        keys.page_key("", [1, -2, 3])
    with pytest.raises(InvalidArgument, match="^keys: page_size must be positive, got 0$"):
        keys.chain_keys([1, 2, 3], 0)


def test_digest_keys_have_one_raw_form():
    h = SGL_PAGES4[0]
    raw = bytes.fromhex(h)
    # the hex text (str or bytes) and the raw digest name one page, 32 bytes; a rank key adds one rank byte
    assert keys.normalize_key(h) == keys.normalize_key(h.encode()) == keys.normalize_key(raw) == raw
    assert keys.normalize_key(keys.rank_key(h, 7)) == raw + b"\x07"
    assert keys.normalize_key(keys.rank_key(h, 255)) == raw + b"\xff"
    assert keys.digest_key(h.encode() + b"_0") == raw + b"\x00"
    # anything else is kept as it is: not lowercase hex, a rank out of range or with a leading zero, other lengths
    for k in (h.upper(), h + "_256", h + "_07", h + "_", h + "_1000", h[:63] + "g", h[:63] + " ", h + "x", h[:62]):
        assert keys.normalize_key(k) == k.encode(), k
    # a non-digest key keeps its identity (no copy)
    other = b"x" * 64
    assert keys.digest_key(other) is other


def test_digest_forms_is_digest_key_key_by_key():
    """``keyform.digest_forms`` skips ``digest_key`` only for keys it would return as they are: every length 60..70,
    hex and near-hex texts, rank suffixes with digits, letters, leading zeros and ranks past 255."""
    from transport.keyform import digest_forms, digest_key

    rng = random.Random(11)
    keys = []
    for _ in range(3000):
        h = bytes(rng.getrandbits(8) for _ in range(32)).hex()
        tail = rng.choice(["", "_", "_0", "_7", "_07", "_255", "_256", "_1k", "__k", "_0_k", "_12", "x", "_999"])
        k = (h + tail).encode()[:rng.choice([60, 63, 64, 65, 66, 67, 68, 69, 70, 200])]
        if rng.random() < 0.1:
            k = k[:-1] + bytes([rng.getrandbits(8)])
        keys.append(k)
    assert digest_forms(keys, list(map(len, keys))) == [digest_key(k) for k in keys]
