"""The get path's per-batch shortcuts (issue 45, fixed cost a batch) against the general forms they stand in for, on
random batches: ``keys.normalize_keys`` against ``normalize_key`` key by key (bytes and errors), the flat crc
table of ``headers_match`` against ``zlib.crc32``, and ``LocationCache.learn_rows``'s skip of unchanged rows against
a cache that always stores (same remembered rows after each answer: hits, moves, misses)."""

from __future__ import annotations

import random
import time
import zlib

import numpy as np
import pytest

from transport import answerrows, objformat
from transport.base import headers_match
from transport.objformat import WORD0, crc32_headers
from umbp.errors import CorruptionError, InvalidArgument
from umbp.keys import normalize_key, normalize_keys
from umbp.speculate import LocationCache


def _key(rng: random.Random):
    kind = rng.random()
    n = rng.choice([0, 1, 5, 40, 63, 64, 66, 68, 69, 200, 512, 513])
    if kind < 0.6:
        return "".join(rng.choice("abcé/_0") for _ in range(n))
    if kind < 0.8:
        return bytes(rng.getrandbits(8) for _ in range(n))
    if kind < 0.9:
        return bytearray(rng.getrandbits(8) for _ in range(n))
    return rng.choice([3, None, 1.5])


def _general(keys):
    try:
        return [normalize_key(k) for k in keys]
    except InvalidArgument as e:
        return ("error", str(e))


def _fast(keys):
    try:
        return normalize_keys(keys)
    except InvalidArgument as e:
        return ("error", str(e))


def test_normalize_keys_matches_normalize_key_on_random_batches():
    rng = random.Random(45)
    for _ in range(400):
        n = rng.choice([1, 2, 64])
        if rng.random() < 0.5:  # the usual batch: short str keys (the fast path), sometimes with one odd key
            keys = [f"k/{rng.getrandbits(40)}" for _ in range(n)]
            if rng.random() < 0.4:
                keys[rng.randrange(n)] = _key(rng)
        else:
            keys = [_key(rng) for _ in range(n)]
        assert _fast(keys) == _general(keys)
    assert normalize_keys(["a" * 63, "b"]) == [b"a" * 63, b"b"]
    assert normalize_keys(["a" * 64, "b"])[0] == normalize_key("a" * 64)  # a digest key's form


def test_normalize_keys_digest_forms_and_page_names():
    """Keys of 64..68 bytes: the digest text and rank keys become their raw form, SGLang's page names (ending in a
    letter) and near misses stay as they are, str and bytes alike, as ``normalize_key`` does key by key; a generator
    is read once."""
    rng = random.Random(7)
    hexes = [bytes(rng.getrandbits(8) for _ in range(32)).hex() for _ in range(6)]
    names = ([h for h in hexes] + [f"{h}_{r}" for h, r in zip(hexes, (0, 7, 99, 255, 256, 5))]
             + [f"{hexes[0]}_07", f"{hexes[1]}__k", f"{hexes[2]}_0_k", f"{hexes[3]}_1_v", hexes[4].upper(),
                f"{hexes[5][:-1]}g", f"{hexes[0]}x1", f"{hexes[1]}_1a", "k/short", "x" * 66])
    for keys in (names, [n.encode() for n in names]):
        want = [normalize_key(k) for k in keys]
        assert normalize_keys(keys) == want and normalize_keys(tuple(keys)) == want
        assert normalize_keys(k for k in keys) == want
    assert sum(len(k) == 32 for k in normalize_keys(names)) == 6  # the six hex texts
    assert sum(len(k) == 33 for k in normalize_keys(names)) == 5  # ranks 0, 7, 99, 255, 5 (256 is no rank)
    assert normalize_keys([]) == [] and normalize_keys(iter([])) == []


def test_flat_crc_table_matches_zlib_and_headers_match_the_per_page_check():
    rng = np.random.default_rng(45)
    rows = rng.integers(0, 256, (300, 64), dtype=np.uint8)
    rows[:, :8] = np.frombuffer(WORD0.tobytes(), np.uint8)  # the rows it is meant for: valid magic, version, flags
    assert crc32_headers(rows).tolist() == [zlib.crc32(r[:36].tobytes()) for r in rows]
    prng = random.Random(46)
    heads, want, expect = [], [], []
    for _ in range(300):
        tag, gen, plen = prng.getrandbits(64), prng.getrandbits(63), prng.randrange(1, 1 << 40)
        h = bytearray(objformat.pack_object_header(tag, gen, plen))
        if prng.random() < 0.5:  # corruption: one flipped bit anywhere in the header
            h[prng.randrange(64)] ^= 1 << prng.randrange(8)
        heads.append(bytes(h))
        want.append((tag, gen, plen))
        try:
            expect.append(objformat.check_object_header(bytes(h), "t", tag, gen, plen) is None)
        except CorruptionError:
            expect.append(False)
    arr = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, 64)
    tag, gen, plen = (np.array(c, np.uint64) for c in zip(*want))
    assert headers_match(arr, tag, gen, plen).tolist() == expect


def _rows(rng: random.Random, n: int, pages: dict, keys: list[bytes], nnodes: int) -> np.ndarray:
    """An answer's rows for ``keys``: each key's page in ``pages`` (moved now and then), or a miss."""
    rows = np.zeros(n, answerrows.LOC_ROW)
    for i, k in enumerate(keys):
        r = rng.random()
        if r < 0.1:
            pages.pop(k, None)
        elif r < 0.2 or k not in pages:
            pages[k] = (rng.getrandbits(64), rng.getrandbits(40), rng.randrange(1, 1 << 20),
                        rng.randrange(1, 1 << 20) * 4096, rng.randrange(nnodes))
        if k in pages:
            rows[i] = (*pages[k], 0)
        else:
            rows[i]["node"] = answerrows.NO_NODE
    return rows


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_learn_rows_skip_leaves_the_same_cache_as_storing_every_answer(seed):
    rng = random.Random(seed)
    universe = [f"key-{i}".encode() for i in range(48)]
    pages: dict = {}
    fast, plain = LocationCache(limit=40), LocationCache(limit=40)
    nodes = ["n0", "n1", "n2"]
    for step in range(300):
        keys = rng.sample(universe, rng.choice([2, 8, 16]))
        if rng.random() < 0.5:  # steady state: the same pages answered again, unchanged
            stable = {k: pages[k] for k in keys if k in pages}
            if len(stable) == len(keys):
                rows = np.array([(*stable[k], 0) for k in keys], answerrows.LOC_ROW)
            else:
                rows = _rows(rng, len(keys), pages, keys, len(nodes))
        else:
            rows = _rows(rng, len(keys), pages, keys, len(nodes))
        caps = [b"c%d" % (step % 3)] * len(nodes) if rng.random() < 0.3 else []
        guess = fast.rows(keys)
        fast.learn_rows(keys, rows, nodes, caps, None if guess is None else guess[0])
        plain.learn_rows(keys, rows, nodes, caps)
        assert list(fast._locs.items()) == list(plain._locs.items()), step
        assert [fast.get(k) for k in universe] == [plain.get(k) for k in universe]


def _arena(pages: int, size: int):
    """A ShmTransport over an anonymous mapping (no node): ``pages`` objects of ``size`` bytes, their offsets,
    tags, generations and payloads."""
    import mmap

    from transport.shm import ShmTransport
    from umbp import copies
    osz = objformat.object_size(size)
    m = mmap.mmap(-1, objformat.ARENA_DATA_START + osz * pages)
    t = ShmTransport.__new__(ShmTransport)
    t.component, t._map, t.arena, t.size = "transport shm t", m, memoryview(m), len(m)
    t._base, t._head_rows, t._checked = copies.address(t.arena), None, {}
    rng = np.random.default_rng(size)
    off = (objformat.ARENA_DATA_START + np.arange(pages) * osz).astype(np.uint64)
    tag = rng.integers(0, 1 << 63, pages, dtype=np.uint64)
    gen = rng.integers(1, 1 << 40, pages, dtype=np.uint64)
    data = rng.integers(0, 256, (pages, size), dtype=np.uint8)
    a8 = np.frombuffer(t.arena, np.uint8)
    for i, o in enumerate(off.tolist()):
        a8[o:o + 64] = np.frombuffer(objformat.pack_object_header(int(tag[i]), int(gen[i]), size), np.uint8)
        a8[o + 64:o + 64 + size] = data[i]
    return t, a8, off, tag, gen, data


def _shared(monkeypatch) -> None:
    """Every ``copies.copy_shared`` batch split with the helper thread, whatever the machine's cores."""
    from umbp import copies
    monkeypatch.setattr(copies, "SHARE_BYTES", 0)
    monkeypatch.setattr(copies, "_limit", copies.SHARE_THREADS)  # set_max_threads, undone after the test


@pytest.mark.parametrize("shared", [False, True])
def test_read_rows_agrees_with_start_read_on_random_batches(shared, monkeypatch):
    """On the calling thread alone and with the copy shared with the helper thread (``copies.copy_shared``)."""
    from transport.base import ReadOp
    if shared:
        _shared(monkeypatch)
    size, pages = 4096, 96
    t, a8, off, tag, gen, data = _arena(pages, size)
    prng = random.Random(47)
    for _ in range(60):
        n = prng.choice([2, 7, 64])
        pick = np.array(prng.sample(range(pages), n))
        o, tg, g = off[pick].copy(), tag[pick].copy(), gen[pick].copy()
        plen = np.full(n, size, np.uint64)
        saved = []
        for i in range(n):
            r = prng.random()
            if r < 0.08:
                o[i] = np.uint64(t.size + 4096 * prng.randrange(1, 4))  # outside the arena
            elif r < 0.16:
                g[i] += np.uint64(1)  # the directory names a newer generation: stale slot
            elif r < 0.24:
                at = int(o[i]) + prng.randrange(64)  # a corrupt header byte in the arena
                saved.append((at, a8[at]))
                a8[at] ^= np.uint8(1 << prng.randrange(8))
            elif r < 0.28:
                plen[i] = np.uint64(size - 1)  # the directory's length differs
        out = np.zeros((n, size), np.uint8)
        dst = (np.arange(n) * size + out.ctypes.data).astype(np.int64)
        status = t.read_rows(o, plen, tg, g, dst, 1e18)
        ref = np.zeros((n, size), np.uint8)
        ops = [ReadOp(int(o[i]), 0, int(plen[i]), int(tg[i]), int(g[i]), int(plen[i]), memoryview(ref[i]))
               for i in range(n)]
        res = t.start_read(ops, 1e18).results
        for i in range(n):
            if status[i] == 0:  # the array path settled it: the per-page path passes it with the same bytes
                assert res[i] is None and bytes(out[i]) == bytes(ref[i]) == data[pick[i]][:int(plen[i])].tobytes()
            else:  # left to the per-page path (which decides it: here always an error) and nothing torn
                assert status[i] == 1 and isinstance(res[i], CorruptionError)
        for at, v in reversed(saved):
            a8[at] = v


@pytest.mark.parametrize("shared", [False, True])
def test_read_rows_reports_only_the_header_rewritten_during_the_copy(shared, monkeypatch):
    from umbp import copies
    if shared:
        _shared(monkeypatch)
    size, pages = 4096, 16
    t, a8, off, tag, gen, data = _arena(pages, size)
    plen = np.full(pages, size, np.uint64)
    out = np.zeros((pages, size), np.uint8)
    dst = (np.arange(pages) * size + out.ctypes.data).astype(np.int64)
    copy = copies.copy_shared
    seq = copies._helper.seq if copies._helper is not None else 0
    for victim in (0, 5, 15):
        def rewrite(*a, victim=victim):  # the copy, then a writer reuses one slot (its header changes)
            copy(*a)
            a8[int(off[victim]) + 8] ^= np.uint8(0xFF)
        monkeypatch.setattr(copies, "copy_shared", rewrite)
        status = t.read_rows(off, plen, tag, gen, dst, 1e18)
        a8[int(off[victim]) + 8] ^= np.uint8(0xFF)
        assert status.tolist() == [2 if i == victim else 0 for i in range(pages)]
    monkeypatch.setattr(copies, "copy_shared", copy)
    assert not t.read_rows(off, plen, tag, gen, dst, 1e18).any() and np.array_equal(out, data)
    assert (copies._helper is not None and copies._helper.seq == seq + 4) == shared  # the helper took a share each


def test_out_addresses_of_2d_outs_reuse_offsets_but_not_addresses():
    from umbp.readbatch import out_addresses
    rng = random.Random(48)
    for _ in range(50):
        n, cols = rng.choice([2, 3, 64]), rng.choice([1, 7, 4096])
        dtype = rng.choice([np.uint8, np.float32, np.int64])
        for out in (np.zeros((n, cols), dtype), np.zeros((n, 2, cols), dtype)):
            addr, cap = out_addresses(out, n)
            row = out.strides[0]
            assert addr.tolist() == [out.ctypes.data + i * row for i in range(n)]
            assert cap.tolist() == [row] * n and not cap.flags.writeable
    a, b = np.zeros((4, 16), np.uint8), np.zeros((4, 16), np.uint8)
    assert out_addresses(a, 4)[0].tolist() != out_addresses(b, 4)[0].tolist()


def test_out_addresses_of_memoryview_lists_and_the_views_it_leaves_to_the_per_page_path():
    """Writable C-contiguous views (SGLang's HiCache backend's outs) give their addresses and sizes; a read-only, a
    strided or an empty view anywhere in the list leaves the whole batch to the per-page path (None)."""
    import ctypes

    from umbp.readbatch import out_addresses
    pool = np.zeros((8, 5000), np.uint8)
    views = [memoryview(pool[i, 100:100 + 1000 + i]) for i in range(8)]
    addr, cap = out_addresses(views, 8)
    assert addr.tolist() == [pool.ctypes.data + i * 5000 + 100 for i in range(8)]
    assert cap.tolist() == [1000 + i for i in range(8)]
    buf = (ctypes.c_ubyte * 4096).from_address(pool.ctypes.data)  # hostmem.view_at's kind: a ctypes array's view
    assert out_addresses([memoryview(buf).cast("B"), views[1]], 2)[0].tolist() == [pool.ctypes.data, addr[1]]
    for odd in (memoryview(bytes(1000)), memoryview(pool[:, 0]), memoryview(pool[0, :0])):
        assert out_addresses(views[:3] + [odd], 4) is None
    assert out_addresses(views[:1], 1) is None  # one page: the per-page path


def test_read_rows_batch_memo_gives_the_full_paths_verdict_after_any_header_change(monkeypatch):
    """A batch read again by its key (``ShmTransport._batches``) skips the bounds and header match only while its
    headers are byte for byte the ones it passed with: after a header changes (a flipped bit in any field, the crc,
    the padding; restored later or not) it answers exactly what the full path answers, bytes included; a slot
    rewritten during a remembered batch's copy is still a torn read."""
    from umbp import copies
    size, pages = 4096, 48
    t, a8, off, tag, gen, data = _arena(pages, size)
    t._batches, t._batch_pages = {}, 0
    prng = random.Random(49)
    batches = [np.array(prng.sample(range(pages), prng.choice([2, 7, 16]))) for _ in range(6)]
    changed: list[tuple[int, int]] = []  # (arena byte, its value before the flip), oldest first
    memo_hits = 0
    for step in range(150):
        pick = batches[prng.randrange(len(batches))]
        n = len(pick)
        o, tg, g, plen = off[pick], tag[pick], gen[pick], np.full(n, size, np.uint64)
        key = b"".join(x.tobytes() for x in (o, plen, tg, g))
        if step % 3 == 1:  # a header changes between reads of remembered batches
            at = int(o[prng.randrange(n)]) + prng.choice([0, 5, 8, 16, 24, 33, 36, 40, 63])
            changed.append((at, int(a8[at])))
            a8[at] ^= np.uint8(1 << prng.randrange(8))
        memo_hits += key in t._batches
        out, ref = np.zeros((n, size), np.uint8), np.zeros((n, size), np.uint8)
        got = t.read_rows(o, plen, tg, g, (np.arange(n) * size + out.ctypes.data).astype(np.int64), 1e18, key)
        want = t.read_rows(o, plen, tg, g, (np.arange(n) * size + ref.ctypes.data).astype(np.int64), 1e18)
        assert got.tolist() == want.tolist(), step
        assert np.array_equal(out, ref), step
        assert all(np.array_equal(out[i], data[pick[i]]) for i in range(n) if got[i] == 0), step
        if prng.random() < 0.3:
            for at, v in reversed(changed):
                a8[at] = v
            changed.clear()
    for at, v in reversed(changed):
        a8[at] = v
    assert memo_hits > 50
    pick = np.arange(8)
    o, tg, g, plen = off[pick], tag[pick], gen[pick], np.full(8, size, np.uint64)
    key = b"".join(x.tobytes() for x in (o, plen, tg, g))
    out = np.zeros((8, size), np.uint8)
    dst = (np.arange(8) * size + out.ctypes.data).astype(np.int64)
    assert not t.read_rows(o, plen, tg, g, dst, 1e18, key).any() and key in t._batches
    copy = copies.copy_shared

    def rewrite(*a):  # the copy, then a writer reuses slot 3 (its header changes)
        copy(*a)
        a8[int(off[3]) + 16] ^= np.uint8(0xFF)
    monkeypatch.setattr(copies, "copy_shared", rewrite)
    assert t.read_rows(o, plen, tg, g, dst, 1e18, key).tolist() == [2 if i == 3 else 0 for i in range(8)]
    monkeypatch.setattr(copies, "copy_shared", copy)
    assert t.read_rows(o, plen, tg, g, dst, 1e18, key).tolist() == [1 if i == 3 else 0 for i in range(8)]
    a8[int(off[3]) + 16] ^= np.uint8(0xFF)
    assert not t.read_rows(o, plen, tg, g, dst, 1e18, key).any() and np.array_equal(out, data[:8])


def test_read_rows_batch_memo_is_bounded_by_pages(monkeypatch):
    import transport.shm as shm
    size, pages = 4096, 32
    t, a8, off, tag, gen, data = _arena(pages, size)
    t._batches, t._batch_pages = {}, 0
    monkeypatch.setattr(shm, "BATCH_MEMO_PAGES", 20)
    out = np.zeros((7, size), np.uint8)
    dst = (np.arange(7) * size + out.ctypes.data).astype(np.int64)
    keys = []
    for b in range(4):
        pick = np.arange(b * 7, b * 7 + 7)
        o, tg, g, plen = off[pick], tag[pick], gen[pick], np.full(7, size, np.uint64)
        keys.append(b"".join(x.tobytes() for x in (o, plen, tg, g)))
        for _ in range(2):  # read twice: the second is remembered, the count does not grow
            assert not t.read_rows(o, plen, tg, g, dst, 1e18, keys[-1]).any()
            assert np.array_equal(out, data[pick])
        assert list(t._batches) == keys[-2:] and t._batch_pages == 7 * len(t._batches)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_learn_rows_says_same_only_when_settle_rows_serves_every_page(seed):
    """``learn_rows`` returning True lets ``get_into`` skip ``settle_rows`` (``Speculation.settle_all``): on random
    answers (hits, moves, misses, capabilities that change) it does so only when ``settle_rows`` would have found
    every page read ahead served, and the counters come out the same."""
    from umbp.speculate import Speculation
    rng = random.Random(seed)
    universe = [f"key-{i}".encode() for i in range(48)]
    pages: dict = {}
    fast, slow = Speculation(limit=40), Speculation(limit=40)
    nodes = ["n0", "n1", "n2"]
    sames = 0
    for step in range(400):
        keys = rng.sample(universe, rng.choice([2, 8, 16]))
        stable = {k: pages[k] for k in keys if k in pages}
        if rng.random() < 0.6 and len(stable) == len(keys):
            rows = np.array([(*stable[k], 0) for k in keys], answerrows.LOC_ROW)
        else:
            rows = _rows(rng, len(keys), pages, keys, len(nodes))
        caps = [b"c%d" % (step % 2)] * len(nodes) if rng.random() < 0.2 else []
        guess, other = fast.cache.rows(keys), slow.cache.rows(keys)
        assert (guess is None) == (other is None)
        same = fast.cache.learn_rows(keys, rows, nodes, caps, None if guess is None else guess[0])
        slow.cache.learn_rows(keys, rows, nodes, caps)
        if guess is None:
            assert not same
            continue
        numbers = np.array([slow.cache.node_number(n) for n in nodes], np.int64)
        hit = rows["node"] != answerrows.NO_NODE
        node = np.where(hit, numbers[np.where(hit, rows["node"], 0)], -1)
        ok = np.ones(len(keys), bool)
        done = slow.settle_rows(other, ok, rows, node)
        if same:
            sames += 1
            assert done.all() and hit.all(), step
            fast.settle_all(len(keys))
        else:
            fast.settle_rows(guess, ok, rows, node)
        assert (fast.hits, fast.wasted, fast.skip) == (slow.hits, slow.wasted, slow.skip), step
        fast.skip = slow.skip = 0
    assert sames > 20


@pytest.mark.parametrize("threaded", [False, True])
def test_read_rows_into_rows_outs_agrees_with_start_read(threaded, monkeypatch):
    """``read_rows`` with ``geom`` (each out a ``Rows``: the payload cut into rows ``row`` bytes long, ``stride``
    apart, the last row short) lands the bytes exactly where ``start_read`` with the same ``Rows`` does and leaves
    every byte between the rows alone, for payloads of whole rows and of a short last row; on the calling thread and
    on copy threads."""
    from transport.base import ReadOp
    from umbp import copies
    from umbp.buffers import Rows
    if threaded:
        monkeypatch.setattr(copies, "SERIAL_BYTES", 0)
        monkeypatch.setattr(copies, "MIN_BYTES_PER_THREAD", 1)
        monkeypatch.setattr(copies, "_limit", 4)  # set_max_threads(4), undone after the test
    size, pages = 4096 * 3, 24
    t, a8, off, tag, gen, data = _arena(pages, size)
    prng = random.Random(50)
    for row, stride in ((5000, 5000), (4096, 6000), (1000, 1500), (size, size + 64)):
        count = -(-size // row)
        span = (count - 1) * stride + row
        n = prng.choice([2, 7, 24])
        pick = np.array(prng.sample(range(pages), n))
        plen = np.array([size if prng.random() < 0.7 else prng.randrange(1, size) for _ in range(n)], np.uint64)
        pool, ref = np.full(n * span, 0xEE, np.uint8), np.full(n * span, 0xEE, np.uint8)
        outs = [Rows(memoryview(pool[i * span:(i + 1) * span]), row, stride, count) for i in range(n)]
        refs = [Rows(memoryview(ref[i * span:(i + 1) * span]), row, stride, count) for i in range(n)]
        o, tg, g = off[pick], tag[pick], gen[pick]
        for i in range(n):  # the directory's length: the object's header says it too
            a8[int(o[i]):int(o[i]) + 64] = np.frombuffer(
                objformat.pack_object_header(int(tg[i]), int(g[i]), int(plen[i])), np.uint8)
        dst = np.array([x.address for x in outs], np.int64)
        status = t.read_rows(o, plen, tg, g, dst, time.monotonic() + 30, None, (row, stride))
        ops = [ReadOp(int(o[i]), 0, int(plen[i]), int(tg[i]), int(g[i]), int(plen[i]), refs[i], b"")
               for i in range(n)]
        res = t.start_read(ops, time.monotonic() + 30).results
        assert status.tolist() == [0] * n and res == [None] * n
        assert np.array_equal(pool, ref), (row, stride)
        for i in range(n):
            assert outs[i].gather(int(plen[i])) == data[pick[i]][:int(plen[i])].tobytes()
        for i in range(n):
            a8[int(o[i]):int(o[i]) + 64] = np.frombuffer(
                objformat.pack_object_header(int(tg[i]), int(g[i]), size), np.uint8)
