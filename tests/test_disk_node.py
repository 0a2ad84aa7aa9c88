"""The disk tier, node side (issue 47; umbp/node/disk.py, umbp/node/tiering.py): real etcd, metaserver and node
processes, the node started with ``--disk``. The metaserver does not send DEMOTE/PROMOTE yet, so the tests do, as it
would (a connection holding the cluster secret; anyone in an open pool), with places they pick: disk extents, and
DRAM extents past what the metaserver allocated.

Covered: DEMOTE then READV_DISK byte-exact (whole objects and ranges across block boundaries) and PROMOTE back
byte-exact (with a fresh generation); a header that does not match is a CORRUPT failure, never bytes (disk reads, and
DEMOTE sources: never copied); a restart with the same file keeps the bytes and the disk id; a node SIGKILLed in the
middle of a DEMOTE batch never serves a half-written extent as valid; a closed pool's capability and identity rules.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import pytest

from transport import answerrows, objformat, wire
from transport.framed import FramedSocket
from umbp.auth import Tokens, read_capability
from umbp.errors import AuthError, BadRequest, CorruptionError
from umbp.node.tiering import readv_disk

from closedpool import OPS, SECRET, closed_cluster, scoped_client, tokens_toml
from cluster import eventually

HS = objformat.OBJ_HEADER_SIZE
A = objformat.ALIGN
D0 = objformat.DISK_DATA_START
ARENA = "64MiB"
FREE_DRAM = objformat.ARENA_DATA_START + (40 << 20)  # promotions land here: past the few MiB the tests' puts take


def deadline() -> float:
    return time.monotonic() + 20


@pytest.fixture
def disk_cluster(make_cluster, tmp_path):
    path = tmp_path / "node0.disk"  # the test machine's disk (O_DIRECT where its filesystem has it)
    c = make_cluster(nodes=1, capacity=ARENA, node_flags={"disk": str(path), "disk_capacity": "128MiB"})
    c.disk_path = path
    return c


def node_sock(cluster, token: str | None = None) -> contextlib.closing:
    return contextlib.closing(FramedSocket(cluster.nodes[0].addr, "test", deadline(), token=token))


def put(cluster, rng: random.Random, sizes: list[int], ns: str = "default", client=None) -> list[dict]:
    """Objects put through the pool: [{key, payload, tag, gen, plen, dram}], located by LOOKUP."""
    keys = [f"disk-{rng.random()}-{i}".encode() for i in range(len(sizes))]
    payloads = [rng.randbytes(n) for n in sizes]
    c = client or cluster.client()
    try:
        assert all(c.put(k, p) for k, p in zip(keys, payloads))
        locs = c.admin(wire.Op.LOOKUP, {"ns": ns, "keys": keys})["locs"]
    finally:
        if client is None:
            c.close()
    return [{"key": k, "payload": p, "dram": loc[1], "plen": loc[2], "gen": loc[3], "tag": loc[4]}
            for k, p, loc in zip(keys, payloads, locs)]


def disk_places(objs: list[dict], start: int = D0) -> list[int]:
    out, at = [], start
    for o in objs:
        out.append(at)
        at += objformat.object_size(o["plen"]) + A  # a gap block between extents
    return out


def move(sock: FramedSocket, op: int, objs: list[dict], disks: list[int], drams: list[int] | None = None,
         regens: list[int] | None = None, gens: list[int] | None = None) -> dict:
    """One DEMOTE or PROMOTE: the failures by row."""
    rows = answerrows.pack_tier_rows([o["tag"] for o in objs], gens or [o["gen"] for o in objs],
                               [o["plen"] for o in objs], drams or [o["dram"] for o in objs], disks, regens or 0)
    frame = sock.request(op, {"rows": rows}, deadline())
    return wire.vec_failures(frame.meta, len(objs), "test")


def whole(o: dict, addr: int, gen: int | None = None, cap: bytes = b"") -> list:
    return [addr, 0, o["plen"], o["tag"], o["gen"] if gen is None else gen, o["plen"], cap]


def header(o: dict, gen: int | None = None) -> bytes:
    return objformat.pack_object_header(o["tag"], o["gen"] if gen is None else gen, o["plen"])


def test_demote_read_from_disk_then_promote_back_byte_exact(disk_cluster):
    rng = random.Random(47)
    sizes = [100, A - HS, A - HS + 1, 5000, 64 << 10, (1 << 20) - HS, 1 << 20, 3 << 20, 777_777]
    objs = put(disk_cluster, rng, sizes)
    disks = disk_places(objs)
    with node_sock(disk_cluster) as s:
        assert s.request(wire.Op.ARENA_INFO, {}, deadline()).meta["disk_capacity"] == 128 << 20
        assert move(s, wire.Op.DEMOTE, objs, disks) == {}
        got = readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)], deadline())
        assert got == [header(o) + o["payload"] for o in objs]
        # ranges: inside the first block, across the first block's end, far into the object, empty
        big = objs[sizes.index(3 << 20)]
        addr = objformat.DISK_BIT | disks[sizes.index(3 << 20)]
        ranges = [(0, 10), (A - HS - 5, 20), (A - HS, A), (123_457, 1 << 20), ((3 << 20) - 1, 1), (2 << 20, 0)]
        got = readv_disk(s, [[addr, st, n, big["tag"], big["gen"], big["plen"], b""] for st, n in ranges],
                         deadline())
        assert got == [header(big) + big["payload"][st:st + n] for st, n in ranges]
        # promote back, into DRAM extents the metaserver never gave out, with a fresh generation
        drams, at = [], FREE_DRAM
        for o in objs:
            drams.append(at)
            at += objformat.object_size(o["plen"])
        regens = [o["gen"] + 1000 for o in objs]
        assert move(s, wire.Op.PROMOTE, objs, disks, drams, regens) == {}
        dram_ops = [[d, 0, o["plen"], o["tag"], g, o["plen"], b""] for o, d, g in zip(objs, drams, regens)]
        got = readv_disk(s, dram_ops, deadline(), op=wire.Op.READV)
        assert got == [header(o, g) + o["payload"] for o, g in zip(objs, regens)]
        old = readv_disk(s, [[d, 0, o["plen"], o["tag"], o["gen"], o["plen"], b""] for o, d in zip(objs, drams)],
                         deadline(), op=wire.Op.READV)
        assert all(isinstance(x, CorruptionError) and "stale slot" in str(x) for x in old)
        # the pool's own copies were never touched: a plain get still reads them
        with disk_cluster.client() as c:
            assert [c.get(o["key"]) for o in objs] == [o["payload"] for o in objs]


def test_a_header_mismatch_is_corrupt_never_bytes(disk_cluster):
    rng = random.Random(1)
    objs = put(disk_cluster, rng, [9000, 20_000, 300])
    disks = disk_places(objs)
    with node_sock(disk_cluster) as s:
        # the second row names a generation its DRAM header does not carry: refused, and its extent never written
        gens = [objs[0]["gen"], objs[1]["gen"] + 1, objs[2]["gen"]]
        failed = move(s, wire.Op.DEMOTE, objs, disks, gens=gens)
        assert list(failed) == [1] and isinstance(failed[1], CorruptionError) and "source" in str(failed[1])
        ops = [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)]
        got = readv_disk(s, ops, deadline())
        assert got[0] == header(objs[0]) + objs[0]["payload"] and got[2] == header(objs[2]) + objs[2]["payload"]
        assert isinstance(got[1], CorruptionError) and "no object header" in str(got[1])  # zeros: never copied
        # a stale directory view: another generation, another key's tag, another length
        o, addr = objs[0], objformat.DISK_BIT | disks[0]
        bad = [[addr, 0, o["plen"], o["tag"], o["gen"] + 1, o["plen"], b""],
               [addr, 0, o["plen"], o["tag"] ^ 1, o["gen"], o["plen"], b""],
               [addr, 0, 10, o["tag"], o["gen"], o["plen"] - 1, b""],
               whole(o, addr)]
        got = readv_disk(s, bad, deadline())
        assert all(isinstance(x, CorruptionError) for x in got[:3]) and got[3] == header(o) + o["payload"]
        # an extent overwritten in place (a torn header) and a DRAM offset sent as a disk address
        with open(disk_cluster.disk_path, "r+b") as fh:
            fh.seek(disks[2] + 20)
            fh.write(b"\xff")
        got = readv_disk(s, [whole(objs[2], objformat.DISK_BIT | disks[2]), whole(objs[0], disks[0])], deadline())
        assert isinstance(got[0], CorruptionError) and "torn" in str(got[0])
        assert isinstance(got[1], BadRequest) and "not a disk address" in str(got[1])
        # rows outside the disk's data region are refused, the batch's others done
        failed = move(s, wire.Op.DEMOTE, objs[:2], [D0 - A, (128 << 20) + D0 - A])
        assert set(failed) == {0, 1} and all(isinstance(e, BadRequest) for e in failed.values())


def test_restart_keeps_disk_pages_and_disk_id(disk_cluster):
    rng = random.Random(2)
    objs = put(disk_cluster, rng, [50_000, 1 << 20])
    disks = disk_places(objs)
    with node_sock(disk_cluster) as s:
        before = s.request(wire.Op.ARENA_INFO, {}, deadline()).meta
        assert len(before["disk_id"]) == 16 and before["disk_path"] == str(disk_cluster.disk_path)
        assert move(s, wire.Op.DEMOTE, objs, disks) == {}
    node = disk_cluster.nodes[0]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        node.restart(sig=sig)
        with node_sock(disk_cluster) as s:
            info = s.request(wire.Op.ARENA_INFO, {}, deadline()).meta
            assert info["disk_id"] == before["disk_id"] and info["disk_capacity"] == before["disk_capacity"]
            got = readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)], deadline())
            assert got == [header(o) + o["payload"] for o in objs]
    # REGISTER_NODE carried the disk's id (a metaserver from before the disk tier refuses the fields: the node then
    # registers without them, says so, and serves on)
    stderr = node.stderr_text()
    assert "does not know the disk tier" in stderr or "Reject" not in stderr


def test_sigkill_mid_demote_never_reads_a_half_written_extent(make_cluster, tmp_path):
    """Each extent first holds an older object (demoted before), then a batch of newer ones is demoted over them and
    the node is SIGKILLed once the batch's writes reached the file. After the restart every extent reads as the old
    object, the new one, or CORRUPT; never bytes of one under the other's header. The copy's header is written last
    (after the rest of the extent and an fdatasync; the old header zeroed with the rest): which guarantees it."""
    rng = random.Random(3)
    n = 48
    disk_cluster = make_cluster(nodes=1, capacity="160MiB", node_flags={  # one worker: a slower, ordered batch
        "disk": str(tmp_path / "k.disk"), "disk_capacity": "128MiB", "disk_threads": 1})
    disk_cluster.disk_path = tmp_path / "k.disk"
    old = put(disk_cluster, rng, [1 << 20] * n)
    disks = disk_places(old)
    with node_sock(disk_cluster) as s:
        assert move(s, wire.Op.DEMOTE, old, disks) == {}
    new = put(disk_cluster, rng, [1 << 20] * n)
    s = FramedSocket(disk_cluster.nodes[0].addr, "test", deadline())
    rows = answerrows.pack_tier_rows([o["tag"] for o in new], [o["gen"] for o in new], [o["plen"] for o in new],
                               [o["dram"] for o in new], disks)
    s.send([wire.encode(wire.Op.DEMOTE, s.next_id(), {"rows": rows})], deadline())
    fd = os.open(disk_cluster.disk_path, os.O_RDONLY)
    try:
        def started() -> bool:  # the first new extent's payload reached the file: the batch is being written
            return os.pread(fd, 64, disks[0] + HS) == new[0]["payload"][:64]

        eventually(started, timeout=20, interval=0.0005, what="the DEMOTE batch's first extent on disk")
        header_written = os.pread(fd, HS, disks[-1]) == header(new[-1])
    finally:
        os.close(fd)
    node = disk_cluster.nodes[0]
    node.kill(signal.SIGKILL, wait=True)
    s.close()
    node.start()
    counts = {"old": 0, "new": 0, "corrupt": 0}
    with node_sock(disk_cluster) as s:
        got_new = readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(new, disks)], deadline())
        got_old = readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(old, disks)], deadline())
    for o_new, o_old, gn, go in zip(new, old, got_new, got_old):
        assert isinstance(gn, CorruptionError) or gn == header(o_new) + o_new["payload"]
        assert isinstance(go, CorruptionError) or go == header(o_old) + o_old["payload"]
        assert isinstance(gn, CorruptionError) or isinstance(go, CorruptionError)  # never both valid
        counts["new" if not isinstance(gn, CorruptionError) else "old" if not isinstance(go, CorruptionError)
               else "corrupt"] += 1
    assert sum(counts.values()) == n and counts["old"] < n  # the batch had started: something changed
    print(f"after a SIGKILL mid-DEMOTE: {counts} (the last header already written: {header_written})")


def test_closed_pool_capabilities_and_identity(make_cluster, tmp_path, monkeypatch):
    """READV_DISK needs the read capability naming the disk address; DEMOTE/PROMOTE need the cluster secret (an
    admin token is not the metaserver)."""
    path = tmp_path / "closed.disk"
    text = tokens_toml({"tenant": ("tenant-secret-0123456789", {"t": "rw"})})
    cluster = closed_cluster(make_cluster, tmp_path, monkeypatch, text, nodes=1, capacity=ARENA,
                             node_flags={"disk": str(path), "disk_capacity": "16MiB"})
    rng = random.Random(4)
    with scoped_client(cluster.metaserver_addrs, "tenant-secret-0123456789", "t") as c:
        objs = put(cluster, rng, [10_000, 4096], ns="t", client=c)
    disks = disk_places(objs)
    with node_sock(cluster, OPS) as s, pytest.raises(AuthError, match="only the metaserver"):
        move(s, wire.Op.DEMOTE, objs, disks)
    with node_sock(cluster, "tenant-secret-0123456789") as s, pytest.raises(AuthError, match="only the metaserver"):
        move(s, wire.Op.PROMOTE, objs, disks)
    with node_sock(cluster, SECRET) as s:
        info = s.request(wire.Op.ARENA_INFO, {}, deadline()).meta
        assert move(s, wire.Op.DEMOTE, objs, disks) == {}
    key = Tokens(SECRET.encode(), {}).cap_key(info["node_id"], info["arena_id"])
    addrs = [objformat.DISK_BIT | d for d in disks]
    good = read_capability(key, [(a, o["plen"], o["gen"]) for a, o in zip(addrs, objs)])
    dram_grant = read_capability(key, [(d, o["plen"], o["gen"]) for d, o in zip(disks, objs)])  # no disk bit
    with node_sock(cluster, "tenant-secret-0123456789") as s:
        got = readv_disk(s, [whole(o, a, cap=good) for o, a in zip(objs, addrs)], deadline())
        assert got == [header(o) + o["payload"] for o in objs]
        got = readv_disk(s, [whole(o, a, cap=dram_grant) for o, a in zip(objs, addrs)], deadline())
        assert all(isinstance(x, AuthError) for x in got)
        got = readv_disk(s, [whole(o, a, cap=b"") for o, a in zip(objs, addrs)], deadline())
        assert all(isinstance(x, AuthError) for x in got)
        info = s.request(wire.Op.ARENA_INFO, {}, deadline()).meta
        assert info["disk_path"] == ""  # a scoped token is not told where the file is


def test_metrics_count_disk_work(make_cluster, tmp_path):
    import urllib.request

    path = tmp_path / "m.disk"
    cluster = make_cluster(nodes=1, capacity=ARENA, node_flags={"disk": str(path), "disk_capacity": "8MiB",
                                                                "metrics_listen": "127.0.0.1:0"})
    objs = put(cluster, random.Random(5), [5000, 6000])
    disks = disk_places(objs)
    with node_sock(cluster) as s:
        assert move(s, wire.Op.DEMOTE, objs, disks) == {}
        assert move(s, wire.Op.PROMOTE, objs[:1], disks[:1], [FREE_DRAM]) == {}
        readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)], deadline())
    text = urllib.request.urlopen(cluster.nodes[0].metrics_url, timeout=10).read().decode()
    nid = cluster.nodes[0].node_id
    assert f'umbp_node_disk_capacity_bytes{{node_id="{nid}"}} 8.388608e+06' in text
    assert f'umbp_node_tier_moves_total{{move="demote",node_id="{nid}",result="ok"}} 2.0' in text
    assert f'umbp_node_tier_moves_total{{move="promote",node_id="{nid}",result="ok"}} 1.0' in text
    assert f'umbp_node_disk_reads_total{{node_id="{nid}"}} 2.0' in text
    written = [ln for ln in text.splitlines() if ln.startswith("umbp_node_disk_bytes_total") and "write" in ln]
    assert written and float(written[0].split()[-1]) == sum(objformat.object_size(o["plen"]) + A for o in objs)


def test_pipelined_answers_come_back_in_request_order(disk_cluster):
    """Disk reads in flight do not let later answers (a PING, a DRAM READV, a small disk read) overtake them: the
    client matches answers by order. Big answers go out from a sender thread, small ones through the transport."""
    objs = put(disk_cluster, random.Random(6), [3 << 20, 2000, 1 << 20])
    disks = disk_places(objs)
    with node_sock(disk_cluster) as s:
        assert move(s, wire.Op.DEMOTE, objs, disks) == {}
        frames = [(wire.Op.READV_DISK, [whole(objs[0], objformat.DISK_BIT | disks[0])] * 3),
                  (wire.Op.PING, {}),
                  (wire.Op.READV_DISK, [whole(objs[1], objformat.DISK_BIT | disks[1])]),
                  (wire.Op.READV, [whole(objs[2], objs[2]["dram"])]),
                  (wire.Op.READV_DISK, [whole(objs[2], objformat.DISK_BIT | disks[2])] * 2)] * 4
        rids = [s.next_id() for _ in frames]
        s.send([wire.encode(op, rid, meta) for (op, meta), rid in zip(frames, rids)], deadline())
        for (op, meta), rid in zip(frames, rids):
            f = s.recv_frame(deadline())
            assert (f.request_id, f.op, f.status, f.meta if op != wire.Op.PING else None) == (rid, op, 0, None)
            if op != wire.Op.PING:
                want = b"".join(header(x) + x["payload"] for m in meta for x in objs if x["tag"] == m[3])
                assert bytes(f.data) == want
