"""Correctness attacks on the disk tier's mover (issue 47): real etcd, metaserver and node processes.

The mover (metaserver/ha/tiering.py) sends a node one DEMOTE or PROMOTE and, when the round fails for the
connection's sake (closed, reset, timed out), settles it as failed at once (metaserver/table/tiers.py ``finish``):
each row stays where it was and the destination extents go back to their allocator. But a request the mover lost
the answer of may still be in the node's hands (in flight on the network, queued behind other I/O): the node then
writes the move's copy into an extent the metaserver has meanwhile placed a new page on. A PROMOTE zeroes its DRAM
extent's header and copies the promoted page in; a DEMOTE writes its extent with a zeroed header first. Either way a
page committed there is destroyed, and with slow enough I/O (the new page's header written between the PROMOTE's
zeroing and its body copy) it reads as the new key's header over the promoted page's bytes.

The trap (``proxies.Proxy``, test_attack_leases ``node_proxy``) sits between everyone and the node's data port (the
node advertises 127.0.0.2, the proxy listens there and forwards to 127.0.0.1): it tells the mover's connections by
their HELLO (``metaserver-mover``, its ``tag``), and once it catches holds what the mover sends next, closes the
mover's side of that connection (the mover sees it close: a failed round), and later forwards the held request to the
node: a request delayed in the network past the mover's give-up.
"""

from __future__ import annotations

import random
import re
import time

from transport import answerrows, objformat, wire
from umbp.errors import UmbpError
from umbp.node.tiering import readv_disk

from cluster import eventually
from proxies import Proxy
from test_attack_leases import node_proxy
from test_disk_node import deadline, disk_places, header, node_sock, put, whole
from test_tiering import DISK, DRAM, PAGE, WATERMARKS, gets, offsets, put_pages, stats

MOVER = b"metaserver-mover"


def _held_frame(trap: Proxy) -> bool:
    """Whether a whole frame is held."""
    data = trap.pending_bytes()
    if len(data) < wire.HEADER_SIZE:
        return False
    _op, _f, _s, _rid, meta_len, data_len = wire.decode_header(data, "test")
    return len(data) >= wire.HEADER_SIZE + meta_len + data_len


def test_a_promote_the_mover_gave_up_on_never_lands_on_a_page_committed_after(make_cluster, tmp_path):
    """A PROMOTE held in the network while the mover's connection closes: the mover fails the round and frees its
    DRAM destination, a new page is put there, then the PROMOTE reaches the node. Every page committed after the
    give-up must still read back byte-exact."""
    c = make_cluster(nodes=1, capacity=DRAM, metaserver_flags=dict(WATERMARKS),
                     node_flags={"disk": str(tmp_path / "node0.disk"), "disk_capacity": DISK,
                                 "advertise": "127.0.0.2"})
    node = c.nodes[0]
    assert node.host == "127.0.0.2"
    trap = node_proxy(node.port, tag=MOVER)
    try:
        rng = random.Random(4701)
        with c.client() as cl:
            _promote_held(c, trap, cl, rng)
            trap.cut_caught()
            gave_up = re.compile(r"promotion of \d+ pages on node \S+ failed")
            eventually(lambda: gave_up.search(c.metaserver.stderr_text()), 30, "the mover giving the promotion up")
            # DRAM filled to the last extent (no eviction): a freed destination takes one of these pages
            _fill_release_check(c, trap, cl, rng, "pages committed after the mover's give-up, destroyed by its late "
                                "PROMOTE")
    finally:
        trap.close()


def _promote_held(c, trap: Proxy, cl, rng: random.Random) -> None:
    """Pages demoted, then read from disk with DRAM under the low watermark: the mover's PROMOTE of them is held."""
    pages = put_pages(c, cl, rng, 6, "a")  # over the high watermark: the oldest are demoted
    eventually(lambda: stats(c)["demotions"] >= 2, 30, "demotions")
    keys = list(pages)
    demoted = [k for k, o in zip(keys, offsets(c, keys)) if o & objformat.DISK_BIT]
    assert demoted
    # Caught before the removals make room: ``offsets``' LOOKUP already made the demoted pages recent disk reads, so
    # the mover may PROMOTE them the moment DRAM falls under the low watermark (caught after that, the PROMOTE went
    # through uncaught on a loaded machine, the gets below read DRAM, and no frame was ever held).
    trap.catch()
    assert all(cl.batch_remove([k for k in keys if k not in demoted]))  # under the low watermark
    eventually(lambda: stats(c)["used_bytes"] < 0.3 * (8 << 20), 30, "DRAM below the low watermark")
    assert gets(cl, demoted) == [pages[k] for k in demoted]  # read from disk (or held by the PROMOTE's lease)
    eventually(lambda: _held_frame(trap), 30, "the mover's PROMOTE held in the network")


def _fill_release_check(c, trap: Proxy, cl, rng: random.Random,
                        what: str = "pages committed after the PROMOTE was sent, destroyed by it") -> None:
    """DRAM filled to its last free extent with fresh pages (no eviction), the held PROMOTE released to the node,
    then every fresh page read back: byte-exact or the failure names it."""
    fresh: dict[bytes, bytes] = {}
    for i in range(16):
        s = stats(c)
        if s["used_bytes"] + PAGE > s["capacity_bytes"]:
            break
        k, v = f"fresh-{i}".encode(), rng.randbytes(PAGE - 512)
        assert cl.batch_put([k], [v]) == [True]
        fresh[k] = v
    assert fresh and stats(c)["evictions"] == 0
    trap.release()  # the PROMOTE reaches the node now
    eventually(lambda: trap.answered > 0, 30, "the node's answer to the late PROMOTE")
    bad = []
    for k, v in fresh.items():
        try:
            got = cl.get(k)
        except UmbpError as e:
            bad.append((k, repr(e)))
            continue
        if got != v:
            bad.append((k, None if got is None else len(got)))
    assert not bad, f"{what}: {bad}"


def test_a_promote_in_flight_at_a_clean_metaserver_stop_never_lands_on_the_next_leaders_pages(make_cluster,
                                                                                               tmp_path):
    """A PROMOTE held in the network while its metaserver stops cleanly (SIGTERM: it hands its open allocations on
    to the next leader, persistence-and-fencing.md 'Handing on open allocations'). The next leader must keep the
    PROMOTE's destination out of placement as it keeps a writer's open allocation: every page it commits reads
    back byte-exact after the PROMOTE reaches the node."""
    c = make_cluster(nodes=1, capacity=DRAM, metaserver_flags=dict(WATERMARKS),
                     node_flags={"disk": str(tmp_path / "node0.disk"), "disk_capacity": DISK,
                                 "advertise": "127.0.0.2"})
    node = c.nodes[0]
    trap = node_proxy(node.port, tag=MOVER)
    try:
        rng = random.Random(4702)
        with c.client() as cl:
            _promote_held(c, trap, cl, rng)
        c.metaserver.restart()  # SIGTERM: a clean stop, then a new leader's full load
        c.wait_nodes()
        with c.client() as cl:
            _fill_release_check(c, trap, cl, rng)
    finally:
        trap.close()


def test_a_move_that_reaches_the_node_past_its_deadline_copies_nothing(make_cluster, tmp_path):
    """The node side of the same guard: a DEMOTE or PROMOTE whose ``until_ms`` has passed when it arrives (its
    mover gave it up and may have placed other pages in its extents) fails every row and writes nothing: the disk
    extent keeps what it held, the DRAM extent's page still reads back."""
    c = make_cluster(nodes=1, capacity="64MiB", node_flags={"disk": str(tmp_path / "node0.disk"),
                                                            "disk_capacity": "128MiB"})
    rng = random.Random(4705)
    objs = put(c, rng, [5000, 1 << 20])
    disks = disk_places(objs)
    rows = answerrows.pack_tier_rows([o["tag"] for o in objs], [o["gen"] for o in objs], [o["plen"] for o in objs],
                               [o["dram"] for o in objs], disks, 0)
    past = int(time.time() * 1000) - 1
    with node_sock(c) as s:
        frame = s.request(wire.Op.DEMOTE, {"rows": rows, "until_ms": past}, deadline())
        failed = wire.vec_failures(frame.meta, len(objs), "test")
        assert sorted(failed) == [0, 1] and all("deadline" in str(e) for e in failed.values())
        got = readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)], deadline())
        assert all(isinstance(g, UmbpError) for g in got)  # nothing was copied
        frame = s.request(wire.Op.DEMOTE, {"rows": rows, "until_ms": past + 60_000}, deadline())
        assert wire.vec_failures(frame.meta, len(objs), "test") == {}  # in time: copied
        assert readv_disk(s, [whole(o, objformat.DISK_BIT | d) for o, d in zip(objs, disks)], deadline()) == \
            [header(o) + o["payload"] for o in objs]
        # a late PROMOTE onto the pages' own DRAM extents: it would zero their headers and write there
        frame = s.request(wire.Op.PROMOTE, {"rows": rows, "until_ms": past}, deadline())
        assert sorted(wire.vec_failures(frame.meta, len(objs), "test")) == [0, 1]
    with c.client() as cl:
        assert [cl.get(o["key"]) for o in objs] == [o["payload"] for o in objs]
