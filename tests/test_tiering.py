"""The disk tier end to end (issue 47): real etcd, metaserver and node processes, the node started with ``--disk``.
The metaserver's mover demotes a node's least recently used pages to its disk instead of dropping them
(metaserver/ha/tiering.py, metaserver/table/tiers.py), the client reads them back with READV_DISK
(umbp/readbatch.py, umbp/client.py), reads promote them into DRAM again, and the disk's pages outlive the node
process, its DRAM arena and the metaserver. Every read is checked byte for byte."""

from __future__ import annotations

import random
import signal

import numpy as np

from transport import objformat, wire
from umbp.keys import normalize_key

from cluster import eventually

PAGE = 1 << 20
DRAM = "8MiB"  # 7 pages of 1 MiB
DISK = "64MiB"
WATERMARKS = {"env": {"UMBP_HIGH_WATERMARK": "0.5", "UMBP_LOW_WATERMARK": "0.3"}}  # the mover starts early


def tier_cluster(make_cluster, tmp_path, **kw):
    c = make_cluster(nodes=1, capacity=DRAM, metaserver_flags=dict(WATERMARKS),
                     node_flags={"disk": str(tmp_path / "node0.disk"), "disk_capacity": DISK}, **kw)
    return c


def stats(c) -> dict:
    return c.ask("stats")


def put_pages(c, client, rng: random.Random, n: int, prefix: str) -> dict[bytes, bytes]:
    """``n`` pages put one at a time, each after the mover brought DRAM back under the high watermark (a put never
    waits for it: one that finds DRAM full evicts, and these tests count pages that reach the disk)."""
    pages = {f"{prefix}-{i}".encode(): rng.randbytes(PAGE - 512) for i in range(n)}
    for k, v in pages.items():
        eventually(lambda: stats(c)["used_bytes"] <= (4 << 20), 30, "the mover under the high watermark")
        assert client.batch_put([k], [v]) == [True]
    return pages


def offsets(c, keys: list[bytes]) -> list[int]:
    with c.client() as cl:
        ans = cl.admin(wire.Op.LOOKUP, {"ns": cl.namespace, "keys": [normalize_key(k) for k in keys]})
        if ans.get("lease"):  # (a closed connection's leases run out on their own, pinning the pages till then)
            cl.admin(wire.Op.RELEASE, {"lease": ans["lease"]})
        locs = ans["locs"]
    return [loc[1] if loc is not None else -1 for loc in locs]


def gets(client, keys: list[bytes]) -> list:
    """Each page by ``get`` (the per-page path: a fresh ``bytes``), None for a miss."""
    return [client.get(k) for k in keys]


def read_all(client, pages: dict[bytes, bytes]) -> None:
    keys = list(pages)
    got = gets(client, keys)
    wrong = [(i, None if g is None else len(g)) for i, (k, g) in enumerate(zip(keys, got)) if g != pages[k]]
    assert not wrong, f"pages missed (None) or wrong (their length): {wrong}"
    outs = np.zeros((len(keys), PAGE), np.uint8)
    assert client.batch_get_into(keys, list(outs)) == [len(pages[k]) for k in keys]  # the array path too
    for row, k in zip(outs, keys):
        assert row[:len(pages[k])].tobytes() == pages[k]


def test_a_working_set_five_times_dram_stays_whole_on_disk_and_reads_back_byte_exact(make_cluster, tmp_path):
    c = tier_cluster(make_cluster, tmp_path)
    rng = random.Random(47)
    with c.client() as cl:
        pages = put_pages(c, cl, rng, 35, "ws")  # 35 MiB against 8 MiB of DRAM
        eventually(lambda: stats(c)["demotions"] >= 28, 30, "the mover demoted the pages DRAM cannot hold")
        s = stats(c)
        assert s["evictions"] == 0 and s["objects"] == 35, {k: v for k, v in s.items() if k != "nodes"}
        assert s["disk_capacity_bytes"] == 64 << 20 and s["disk_used_bytes"] >= 28 * PAGE
        on_disk = [o for o in offsets(c, list(pages)) if o >= 0 and o & objformat.DISK_BIT]
        assert len(on_disk) >= 28
        read_all(cl, pages)


def test_pages_read_from_disk_are_promoted_back_into_dram(make_cluster, tmp_path):
    c = tier_cluster(make_cluster, tmp_path)
    rng = random.Random(48)
    with c.client() as cl:
        pages = put_pages(c, cl, rng, 6, "p")  # 6 MiB: above the high watermark, so the oldest are demoted
        eventually(lambda: stats(c)["demotions"] >= 2, 30, "demotions")
        keys = list(pages)
        demoted = [k for k, o in zip(keys, offsets(c, keys)) if o & objformat.DISK_BIT]
        assert demoted
        assert all(cl.batch_remove([k for k in keys if k not in demoted]))  # room under the low watermark
        eventually(lambda: stats(c)["used_bytes"] < 0.3 * (8 << 20), 30, "DRAM below the low watermark")
        got = gets(cl, demoted)  # read from disk: candidates for promotion
        assert got == [pages[k] for k in demoted]
        eventually(lambda: stats(c)["promotions"] >= 1, 30, "a promotion")
        back = [k for k, o in zip(demoted, offsets(c, demoted)) if o >= 0 and not o & objformat.DISK_BIT]
        assert back
        assert gets(cl, back) == [pages[k] for k in back]


def test_disk_pages_come_back_after_the_node_restarts_with_a_new_dram_arena(make_cluster, tmp_path):
    c = tier_cluster(make_cluster, tmp_path)
    rng = random.Random(49)
    with c.client() as cl:
        pages = put_pages(c, cl, rng, 20, "r")
        eventually(lambda: stats(c)["demotions"] >= 14, 30, "demotions")
    keys = list(pages)
    disk_keys = [k for k, o in zip(keys, offsets(c, keys)) if o & objformat.DISK_BIT]
    node = c.nodes[0]
    node.kill(signal.SIGKILL, wait=True)
    for f in node.arena_files():  # the host's /dev/shm is gone (a reboot): only the disk file survives
        f.unlink()
    node.start()
    c.wait_nodes()
    with c.client() as cl:
        eventually(lambda: gets(cl, disk_keys) == [pages[k] for k in disk_keys], 30,
                   "every disk page back, byte-exact, after the restart")
        got = gets(cl, keys)
        assert all(g is None or g == pages[k] for k, g in zip(keys, got))  # DRAM pages: gone or right, never wrong


def test_disk_pages_survive_a_metaserver_restart(make_cluster, tmp_path):
    c = tier_cluster(make_cluster, tmp_path)
    rng = random.Random(50)
    with c.client() as cl:
        pages = put_pages(c, cl, rng, 16, "m")
        eventually(lambda: stats(c)["demotions"] >= 10, 30, "demotions")
    c.metaserver.restart(sig=signal.SIGKILL)
    c.wait_nodes()
    with c.client() as cl:
        eventually(lambda: gets(cl, list(pages)) == list(pages.values()), 30,
                   "every page back from etcd's records, on disk where it was demoted")
        assert stats(c)["nodes"][0]["disk_objects"] >= 10


def test_a_node_killed_while_pages_are_being_demoted_never_serves_wrong_bytes(make_cluster, tmp_path):
    """Pages put past the high watermark in one burst keep the mover busy; the node is SIGKILLed at once (most runs
    inside a DEMOTE round: its copies half-written, its answer never sent), then restarted on the same arena and
    disk. Every page reads back byte-exact or misses, each key is one page, and the pool keeps demoting."""
    c = tier_cluster(make_cluster, tmp_path)
    rng = random.Random(51)
    pages = {f"kill-{i}".encode(): rng.randbytes(PAGE - 512) for i in range(12)}
    with c.client() as cl:
        assert cl.batch_put(list(pages)[:6], list(pages.values())[:6]) == [True] * 6  # 6 MiB: over 4 MiB at once
        # the first round's disk extents are allocated when it is planned, before its DEMOTE is sent
        eventually(lambda: stats(c)["disk_used_bytes"] > 0, 10, "a demotion round planned")
    node = c.nodes[0]
    node.kill(signal.SIGKILL, wait=True)
    node.start()
    c.wait_nodes()
    with c.client() as cl:
        got = gets(cl, list(pages)[:6])
        assert all(g is None or g == pages[k] for k, g in zip(pages, got)), "a page read back with other bytes"
        found = sum(g is not None for g in got)
        assert stats(c)["objects"] == found  # no key filed twice (a copy and its source both READY)
        for k, v in list(pages.items())[6:]:  # and the pool goes on: more puts are demoted, read back byte-exact
            eventually(lambda: stats(c)["used_bytes"] <= (4 << 20), 30, "the mover under the high watermark")
            assert cl.batch_put([k], [v]) == [True]
        later = gets(cl, list(pages)[6:])
        assert later == list(pages.values())[6:]
