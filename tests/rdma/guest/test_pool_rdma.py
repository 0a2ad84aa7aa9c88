"""Pool-level tests of the RDMA transport (transport/rdma_link.py) against real verbs, run inside the Soft-RoCE guest.

One real pool per module (umbp.launcher.LocalPool: etcd, metaserver, two storage nodes as child processes, all in
this guest, rxe0 on lo). Clients force ``transport="rdma"`` unless a test is about the choice itself. Every data
check is byte-exact against the bytes that were put. The SIGKILL test breaks a node, so it runs last.

Run by tests/rdma/test_rdma_guest.py (``python tests/rdma/testbed.py run -- python3 -m pytest tests/rdma/guest``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import umbp
import umbp.client
from transport import objformat, wire
from transport.base import ReadOp
from transport.rdma import rdma_available
from umbp.errors import CorruptionError, TransportError, UmbpError
from umbp.launcher import LocalPool, find_etcd

KiB, MiB = 1 << 10, 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _skip_loudly(reason: str) -> None:
    bar = "!" * 100
    sys.stderr.write(f"\n{bar}\n!! RDMA POOL TESTS SKIPPED: {reason}\n{bar}\n")
    pytest.skip(f"RDMA pool tests skipped: {reason}")


def _need_guest() -> None:
    if not os.environ.get("UMBP_RDMA_GUEST"):
        _skip_loudly("not inside the Soft-RoCE guest (UMBP_RDMA_GUEST unset); run tests/rdma/testbed.py")
    ok, why = rdma_available()
    if not ok:
        _skip_loudly(why)


@pytest.fixture(scope="module")
def pool():
    _need_guest()
    probe = subprocess.run([sys.executable, "-c", "import aetcd, uvloop, msgpack"], capture_output=True, text=True, check=False)
    assert probe.returncode == 0, f"{sys.executable} cannot import the pool's dependencies:\n{probe.stderr}"
    etcd = "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else find_etcd()
    assert etcd, "no etcd binary (/usr/bin/etcd on the host's root)"
    p = LocalPool(nodes=2, capacity="192MiB", lease_ttl=4)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def rdma_client(pool, **kw) -> umbp.Client:
    return umbp.Client(pool.metaserver, transport=kw.pop("transport", "rdma"), **kw)


def nodes_json(pool) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "umbp", "nodes", "--json", "--metaserver", pool.metaserver],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def locate(client: umbp.Client, keys) -> list:
    """[node_id, offset, size, generation] (or None) per key, straight from the metaserver (lease released)."""
    kb = [umbp.client.normalize_key(k) for k in keys]
    dl = time.monotonic() + 30
    reply = client._meta.call(wire.Op.LOOKUP, {"ns": client.namespace, "keys": kb}, dl)
    if reply.get("lease"):
        client._meta.call(wire.Op.RELEASE, {"lease": reply["lease"]}, dl)
    return reply["locs"]


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------------------------------------------------- tests

def test_nodes_advertise_rdma(pool):
    nodes = nodes_json(pool)
    assert len(nodes) == 2, nodes
    for n in nodes:
        assert n["alive"], n
        assert "rdma" in n["transports"], n


SIZES = [1, 63, 64, 65, 4095, 4096, 4097, 64 * KiB, 64 * KiB + 1, MiB - 1, MiB, 3 * MiB + 5, 4 * MiB]


def test_round_trips_many_sizes(pool):
    with rdma_client(pool, namespace="sizes") as c:
        vals = {f"s{n}": rand(n, n) for n in SIZES}
        for k, v in vals.items():
            assert c.put(k, v) is True
            assert c.put(k, v) is False  # dedup
        for k, v in vals.items():
            assert c.get(k) == v, k
            out = bytearray(len(v) + 17)
            assert c.get_into(k, out) == len(v)
            assert out[:len(v)] == v, k
        assert c.get("absent") is None
        names = c.transport_names()
        assert names and set(names.values()) == {"rdma"}, names
        assert len(names) == 2, "the keys should have spread over both nodes"


def test_batch_64_registered_zero_copy(pool):
    n, size = 64, 256 * KiB
    with rdma_client(pool, namespace="reg") as c:
        src = np.frombuffer(rand(n * size, 1), dtype=np.uint8).copy()
        dst = np.zeros(n * size + 4096, dtype=np.uint8)
        c.register_buffer(src)
        c.register_buffer(dst)
        keys = [f"r{i}" for i in range(n)]
        sizes = [size - (i * 4093) % size if i % 3 else size for i in range(n)]  # some not 64-byte multiples
        assert c.batch_put(keys, [src[i * size:i * size + sizes[i]] for i in range(n)]) == [True] * n
        outs = [dst[i * size:i * size + sizes[i]] for i in range(n)]
        assert c.batch_get_into(keys, outs) == sizes
        for i in range(n):
            assert np.array_equal(outs[i], src[i * size:i * size + sizes[i]]), i
        ts = list(c._transports.values())
        assert ts and all(t.name == "rdma" for t in ts)
        for t in ts:  # the outs and the payloads really were inside registered memory: the zero-copy path
            assert all(t._local(memoryview(o)) is not None for o in outs)
            assert t._local(memoryview(src[:size]).toreadonly()) is not None
            assert len(t.registered) == 2, "each buffer registered once per transport"
        # a second read into the same slices after scribbling over them
        dst[:] = 0xAB
        assert c.batch_get_into(keys, outs) == sizes
        assert all(np.array_equal(outs[i], src[i * size:i * size + sizes[i]]) for i in range(n))


def test_batch_64_unregistered_staging(pool):
    n = 64
    with rdma_client(pool, namespace="unreg") as c:
        vals = [rand(1 + (i * 7919) % (300 * KiB), 100 + i) for i in range(n)]
        keys = [f"u{i}" for i in range(n)]
        assert c.batch_put(keys, vals) == [True] * n
        outs = [bytearray(len(v)) for v in vals]
        assert c.batch_get_into(keys, outs) == [len(v) for v in vals]
        assert all(o == v for o, v in zip(outs, vals))
        # mixed batch: misses interleaved with hits
        mixed = [k if i % 2 else f"miss{i}" for i, k in enumerate(keys)]
        outs = [bytearray(len(v)) for v in vals]
        got = c.batch_get_into(mixed, outs)
        for i, v in enumerate(vals):
            if i % 2:
                assert got[i] == len(v) and outs[i] == v
            else:
                assert got[i] == -1


def test_batch_larger_than_staging(pool, monkeypatch):
    monkeypatch.setenv("UMBP_STAGING_BYTES", str(MiB))
    n = 64
    with rdma_client(pool, namespace="staging") as c:
        assert c.config.staging_bytes == MiB
        vals = [rand(64 * KiB + 7 * i, 500 + i) for i in range(n)]  # ~4.2 MiB: several waves through 1 MiB
        vals.append(rand(4 * MiB, 999))  # bigger than the staging area: registered for the batch
        vals.append(rand(MiB, 998))  # exactly the staging area
        keys = [f"w{i}" for i in range(len(vals))]
        assert c.batch_put(keys, vals) == [True] * len(vals)
        outs = [bytearray(len(v)) for v in vals]
        assert c.batch_get_into(keys, outs) == [len(v) for v in vals]
        for i, (o, v) in enumerate(zip(outs, vals)):
            assert o == v, i
        ts = list(c._transports.values())
        assert ts and all(t.name == "rdma" and t.staging.length == MiB for t in ts)
        assert all(not t.registered for t in ts), "temporary registrations must be dropped after the batch"
        assert c.get(keys[-2]) == vals[-2]


def test_a_write_past_its_deadline_is_not_posted(pool, monkeypatch):
    """A one-sided RDMA write cannot be refused by the node, so the client posts none past the ALLOC answer's
    ``write_until_ms`` (transport/rdma_link.py ``_post_wave``): with the client's wall clock an hour ahead, the put
    fails naming the deadline, nothing is stored; with it back, the same put lands byte-exact."""
    val = rand(64 * KiB, 4711)
    with rdma_client(pool, namespace="late") as c:
        real = time.time
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() + 3600.0)
            with pytest.raises(UmbpError, match="deadline"):
                c.batch_put(["late"], [val])
        assert c.get("late") is None
        assert c.batch_put(["late"], [val]) == [True]
        assert c.get("late") == val


def test_a_write_a_deposed_term_granted_is_not_posted(pool):
    """A one-sided RDMA write cannot be refused by the node either, so before a wave of writes the client reads the
    generation floors the node publishes in its arena's superblock page (one RDMA READ) and posts no op below its
    slot's floor (transport/rdma_link.py ``_stale_from``). A partitioned pool of its own (4 slots, one node): once a
    FENCE raised one slot's floor above every generation its leader hands out (as a new leader's would above a
    deposed one's), an RDMA put of that slot's keys fails naming the deposed term and nothing is stored, while the
    other slots' puts in the same batch land byte-exact."""
    from transport import slotrules
    from transport.framed import FramedSocket

    del pool  # this test needs a partitioned pool; the module's pool stays up for the others
    slots, size = 4, 64 * KiB
    sp = LocalPool(nodes=1, capacity="64MiB", lease_ttl=4, slots=slots)
    sp.start()
    try:
        keys = [f"fence-{i}".encode() for i in range(24)]
        slot_of = {k: slotrules.slot_of("default", k, slots) for k in keys}
        s = slot_of[keys[0]]
        mine = [k for k in keys if slot_of[k] == s]
        other = [k for k in keys if slot_of[k] != s]
        assert len(mine) >= 3 and other
        with rdma_client(sp) as c:
            first = rand(size, 5100)
            assert c.batch_put([mine[0]], [first]) == [True]
            assert set(c.transport_names().values()) == {"rdma"}
            gen = c.admin(wire.Op.LOOKUP, {"ns": "default", "keys": [mine[0]]})["locs"][0][3]
            epoch = slotrules.SLOT_EPOCH | (gen + (1 << 40))  # the slot's leader grants below this from now on
            (node,) = nodes_json(sp)
            with contextlib.closing(FramedSocket(node["addr"], "test", time.monotonic() + 30)) as ctl:
                assert ctl.request(wire.Op.FENCE, {"epoch": epoch, "slots": slots},
                                   time.monotonic() + 30).meta == {"floor": epoch}
            stale = [rand(size, 5101 + i) for i in range(2)]
            with pytest.raises(UmbpError, match="deposed metaserver term"):
                c.batch_put(mine[1:3], stale)
            assert c.batch_exists(mine[1:3]) == [False, False]
            assert c.get(mine[0]) == first  # written before the FENCE: kept
            fresh = [rand(size, 5200 + i) for i in range(len(other))]
            assert c.batch_put(other, fresh) == [True] * len(other)
            assert [c.get(k) for k in other] == fresh
            assert c.batch_exists(mine[1:3]) == [False, False]
    finally:
        sp.stop()


def test_layer_parts_and_ranged_reads(pool, monkeypatch):
    """Pages written from one buffer per layer and read back a layer group at a time: parts in registered memory
    (zero copy, one scatter-gather list), parts staged, and a page of parts larger than the staging area."""
    monkeypatch.setenv("UMBP_STAGING_BYTES", str(MiB))
    layers, lb = 8, 24 * KiB + 40
    with rdma_client(pool, namespace="layers") as c:
        reg = np.frombuffer(rand(16 * layers * lb, 7), dtype=np.uint8).copy()
        c.register_buffer(reg)
        pages = [[reg[(p * layers + l) * lb:(p * layers + l + 1) * lb] for l in range(layers)] for p in range(16)]
        pages += [[np.frombuffer(rand(lb, 1000 + p * layers + l), np.uint8) for l in range(layers)] for p in range(16)]
        pages.append([np.frombuffer(rand(160 * KiB, 3000 + l), np.uint8) for l in range(layers)])  # 1.25 MiB
        keys = [f"L{p}" for p in range(len(pages))]
        assert c.batch_put_ranges(keys, pages) == [True] * len(keys)
        sizes = [sum(len(x) for x in ls) for ls in pages]
        whole = [bytearray(n) for n in sizes]
        assert c.batch_get_into(keys, whole) == sizes
        assert all(w == b"".join(x.tobytes() for x in ls) for w, ls in zip(whole, pages))
        outs = np.zeros((len(keys), 2 * 160 * KiB), np.uint8)
        c.register_buffer(outs)
        for g in range(0, layers, 2):  # groups of two layers
            outs[:] = 0
            ranges = [[(g * len(ls[0]), 2 * len(ls[0]))] for ls in pages]
            got = c.batch_get_ranges_into(keys, ranges, [[outs[i]] for i in range(len(keys))])
            assert got == [2 * len(ls[0]) for ls in pages]
            for i, ls in enumerate(pages):
                assert outs[i, :got[i]].tobytes() == ls[g].tobytes() + ls[g + 1].tobytes(), (g, i)
        assert set(c.transport_names().values()) == {"rdma"}
        assert all(len(t.registered) == 2 for t in c._transports.values())


def test_stale_generation_is_detected(pool):
    """Remove a key, put another of the same size into the freed slot, then read the old location over RDMA:
    CorruptionError, never the old or the new bytes as data; through the client the old key is a miss."""
    from transport.rdma_link import RdmaTransport

    size = 200 * KiB
    with rdma_client(pool, namespace="stale") as c:
        old = rand(size, 1)
        assert c.put("old", old)
        (node_id, off, _sz, gen, *_), = locate(c, ["old"])
        assert c.remove("old")
        new = rand(size, 2)
        reused = None
        for i in range(8):  # best-fit gives the freed extent back to the next object of the same size
            assert c.put(f"new{i}", new)
            loc = locate(c, [f"new{i}"])[0]
            if loc[0] == node_id and loc[1] == off:
                reused = loc
                break
        assert reused is not None, "the freed slot was not reused"
        assert reused[3] != gen
        assert c.get("old") is None  # the directory says miss
        info = {n["node_id"]: n for n in nodes_json(pool)}[node_id]
        t = RdmaTransport(node_id, info["addr"], 2 * MiB, time.monotonic() + 30)
        try:
            ns = c.namespace
            outs = [bytearray(size), bytearray(size)]
            ops = [ReadOp(off, 0, size, objformat.key_hash(ns, b"old"), gen, size, memoryview(outs[0])),
                   ReadOp(off, 0, size, objformat.key_hash(ns, f"new{i}".encode()), reused[3], size,
                          memoryview(outs[1]))]
            res = t.finish(t.start_read(ops, time.monotonic() + 30), time.monotonic() + 30)
            assert isinstance(res[0], CorruptionError), res
            assert "stale" in str(res[0])
            assert outs[0] == bytearray(size), "bytes of a stale read reached the caller's buffer"
            assert res[1] is None and outs[1] == new
            # the same with the destination registered (payload lands in place; the result still says corrupt)
            reg = np.zeros(size, dtype=np.uint8)
            t.register(memoryview(reg))
            res = t.finish(t.start_read([ReadOp(off, 0, size, objformat.key_hash(ns, b"old"), gen, size,
                                                memoryview(reg))], time.monotonic() + 30), time.monotonic() + 30)
            assert isinstance(res[0], CorruptionError), res
        finally:
            t.close()


def _auto_round_trip(pool, ns: str, seed: int) -> set[str]:
    """16 pages of 100 KiB through a transport="auto" client; returns the transports it picked."""
    with umbp.Client(pool.metaserver, namespace=ns, transport="auto") as c:
        vals = [rand(100 * KiB, seed + i) for i in range(16)]
        keys = [f"{ns}/{i}" for i in range(16)]
        c.batch_put(keys, vals)
        outs = [bytearray(len(v)) for v in vals]
        assert c.batch_get_into(keys, outs) == [len(v) for v in vals]
        assert outs == vals
        names = c.transport_names()
        assert names
        return set(names.values())


def test_auto_picks_shm_on_the_same_host(pool):
    assert _auto_round_trip(pool, "auto", 40) == {"shm"}


def test_auto_uses_rdma_when_shm_is_unavailable(pool, monkeypatch):
    def no_shm(node_id, *a, **k):
        raise TransportError(f"transport shm {node_id}", "arena not mappable here (test: other host)")

    monkeypatch.setattr(umbp.client, "ShmTransport", no_shm)
    assert _auto_round_trip(pool, "auto2", 60) == {"rdma"}


WORKER = textwrap.dedent("""
    import sys, hashlib, numpy as np, umbp
    me, addr = sys.argv[1], sys.argv[2]
    n, size = 32, 256 << 10
    with umbp.Client(addr, namespace="conc", transport="rdma") as c:
        buf = np.zeros(n * size, dtype=np.uint8)
        c.register_buffer(buf)
        for rnd in range(3):
            rng = np.random.default_rng([int(me), rnd])
            src = rng.integers(0, 256, n * size, dtype=np.uint8)
            keys = [f"{me}-{rnd}-{i}" for i in range(n)]
            assert c.batch_put(keys, [src[i * size:(i + 1) * size] for i in range(n)]) == [True] * n
            buf[:] = 0
            outs = [buf[i * size:(i + 1) * size] for i in range(n)]
            assert c.batch_get_into(keys, outs) == [size] * n
            assert np.array_equal(buf, src), f"worker {me} round {rnd}: bytes differ"
            unreg = [bytearray(size) for _ in range(n)]
            assert c.batch_get_into(keys, unreg) == [size] * n
            assert all(bytes(u) == src[i * size:(i + 1) * size].tobytes() for i, u in enumerate(unreg))
        assert set(c.transport_names().values()) == {"rdma"}
    print("WORKER-OK", me, flush=True)
""")


def test_two_concurrent_client_processes(pool):
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), pool.metaserver], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=REPO) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "WORKER-OK" in out, out[-3000:]


def test_node_sigkilled_mid_batch_zz_last(pool):
    """SIGKILL one node while a batch read from both is in flight: hits are byte-exact, the rest are misses or a
    TransportError; then the client keeps working against the surviving node (reads, and puts once the dead
    node's lease has expired). Runs last: it leaves the pool with one node."""
    n, size = 48, MiB
    with rdma_client(pool, namespace="kill") as c:
        src = np.frombuffer(rand(n * size, 77), dtype=np.uint8).copy()
        dst = np.zeros(n * size, dtype=np.uint8)
        c.register_buffer(dst)
        keys = [f"k{i}" for i in range(n)]
        assert c.batch_put(keys, [src[i * size:(i + 1) * size] for i in range(n)]) == [True] * n
        where = [loc[0] for loc in locate(c, keys)]
        nodes = {x["node_id"]: x for x in nodes_json(pool)}
        assert len(set(where)) == 2, "keys should be on both nodes"
        victim = where[0]
        survivor = next(x for x in nodes if x != victim)
        outs = [dst[i * size:(i + 1) * size] for i in range(n)]
        assert c.batch_get_into(keys, outs) == [size] * n  # warm: both QPs up
        assert np.array_equal(dst, src)

        dst[:] = 0
        # Kill the victim inside the batch: after the lookup, just before its RDMA READs are posted (its QP is
        # still connected on this side, so the reads go out and must fail by RC retry exhaustion, not hang).
        vt = c._transports[victim]
        proc = next(ch.proc for ch in pool.children if ch.proc.pid == nodes[victim]["pid"])
        orig = vt.start_read

        def start_then_kill(ops, deadline):
            vt.start_read = orig
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return orig(ops, deadline)

        vt.start_read = start_then_kill
        t0 = time.monotonic()
        try:
            got = c.batch_get_into(keys, outs)
            err = None
        except TransportError as e:
            got, err = None, e
        dt = time.monotonic() - t0
        assert proc.poll() is not None
        sys.stderr.write(f"kill test: batch took {dt:.2f}s, "
                         + (f"error {err}" if err else f"{sum(g == size for g in got)} hits, "
                            f"{sum(g == -1 for g in got)} misses ({where.count(victim)} pages on the victim)")
                         + "\n")
        if got is not None:
            for i, g in enumerate(got):
                assert g in (size, -1), g
                if g == size:
                    assert np.array_equal(outs[i], src[i * size:(i + 1) * size]), f"wrong bytes for key {i}"
                if where[i] == survivor:
                    assert g == size, "a page on the surviving node must be read"

        # Works again: the survivor's pages read byte-exact, the victim's are misses (not errors, not bytes).
        dst[:] = 0
        got = c.batch_get_into(keys, outs)
        for i, g in enumerate(got):
            if where[i] == survivor:
                assert g == size and np.array_equal(outs[i], src[i * size:(i + 1) * size]), i
            else:
                assert g == -1, (i, g)

        # Once the victim's lease expires, new pages go to the survivor and round-trip.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if not {x["node_id"]: x for x in nodes_json(pool)}[victim]["alive"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the killed node never went DEAD")
        more = [rand(300 * KiB, 900 + i) for i in range(16)]
        mk = [f"after{i}" for i in range(16)]
        assert c.batch_put(mk, more) == [True] * 16
        assert all(loc[0] == survivor for loc in locate(c, mk))
        mo = [bytearray(len(v)) for v in more]
        assert c.batch_get_into(mk, mo) == [len(v) for v in more]
        assert mo == more
        assert c.transport_names()[survivor] == "rdma"
