"""Write capabilities die with their allocation (issue 15, finding 1; umbp/auth.py, metaserver/table/quarantine.py,
``NodeServer.check_write``). A tenant allocates slots, keeps the WRITE capabilities and removes its keys; another
tenant's pages later land in the same slots. The old capabilities must not write there, whatever header the attacker
builds (it may read the victim's namespace, so it knows the victim's tags and generations). Also: a capability writes
its slot once (a second write after the put is refused), and the freed slots are not handed to anybody until the
capabilities' deadline has passed. Real etcd, metaserver and node; the attack goes over raw node sockets."""

from __future__ import annotations

import os
import time

import pytest

from transport import objformat, wire
from transport.framed import FramedSocket
from umbp.auth import with_caps
from umbp.client import Client
from umbp.errors import AuthError, PoolFull

from closedpool import OPS, closed_cluster, scoped_client, tokens_toml
from cluster import eventually

ATTACKER = "attacker-secret-0123456789"
VICTIM = "victim-secret-0123456789"
TOKENS = tokens_toml({"attacker": (ATTACKER, {"attacker": "rw", "victim": "r"}), "victim": (VICTIM, {"victim": "rw"})})
PAGE = 60_000  # one 61,440-byte slot; a 1 MiB node holds 17, 16 stay under the high watermark
SLOTS = 16
CAP_TTL_S = 2.0  # the metaserver's write_cap_ttl_s here: held extents come back after it plus the clock skew


@pytest.fixture
def tiny(make_cluster, tmp_path, monkeypatch):
    return closed_cluster(make_cluster, tmp_path, monkeypatch, TOKENS, nodes=1, capacity="1MiB", lease_ttl=10,
                          metaserver_flags={"env": {"UMBP_WRITE_CAP_TTL_S": str(CAP_TTL_S)}})


def client(cluster, token, ns, **kw) -> Client:
    return scoped_client(cluster.metaserver_addrs, token, ns, **kw)


def deadline() -> float:
    return time.monotonic() + 5


def node_addr(cluster) -> str:
    with client(cluster, OPS, "victim") as c:
        return c.admin(wire.Op.NODES)["nodes"][0]["addr"]


def alloc(sock: FramedSocket, ns: str, keys: list[bytes]) -> list[tuple]:
    items = sock.request(wire.Op.ALLOC, {"ns": ns, "keys": keys, "sizes": [PAGE] * len(keys)}, deadline()).meta
    assert len(items["caps"]) == len({it[1] for it in items["items"]})  # one write capability per node per batch
    items = with_caps(items["items"], items["caps"], 6)
    assert all(it[0] == wire.AllocState.NEW for it in items), items
    return [tuple(it[1:]) for it in items]  # (node_id, offset, payload_len, gen, tag, capability)


def write(sock: FramedSocket, off: int, gen: int, cap: bytes, tag: int, payload: bytes):
    header = objformat.pack_object_header(tag, gen, len(payload))
    return sock.request(wire.Op.WRITE, [off, gen, cap], deadline(), data=[header, payload])


def overlaps(a_off: int, b_off: int) -> bool:
    size = objformat.object_size(PAGE)
    return a_off < b_off + size and b_off < a_off + size


def test_kept_capabilities_cannot_forge_or_destroy_the_next_owners_pages(tiny):
    meta = FramedSocket(tiny.metaserver_addr, "attacker", deadline(), ATTACKER)
    keys = [f"a{i}".encode() for i in range(SLOTS)]
    grants = alloc(meta, "attacker", keys)
    assert len({g[1] for g in grants}) == SLOTS
    # committed without writing (COMMIT does not read the slot), then removed: the capabilities are all it keeps
    assert meta.request(wire.Op.COMMIT, {"ns": "attacker", "keys": keys, "gens": [g[3] for g in grants]},
                        deadline()).meta["ok"] == [True] * SLOTS
    assert meta.request(wire.Op.REMOVE, {"ns": "attacker", "keys": keys}, deadline()).meta["removed"] == [True] * SLOTS

    victim_pages = [os.urandom(PAGE) for _ in range(SLOTS)]
    vkeys = [f"v{i}" for i in range(SLOTS)]
    with client(tiny, VICTIM, "victim", transport="tcp", checksum=True) as v:
        # the removed slots are held until the capabilities' deadline: nobody else is given them before
        with pytest.raises(PoolFull):
            v.batch_put(vkeys, victim_pages)
        t0 = time.monotonic()
        def stored() -> bool:  # the quarantine ends CAP_TTL_S + the 2 s skew margin after the remove
            # True: stored now; False: stored already, by an earlier attempt that fit only some of them (and
            # raised PoolFull for the rest). That attempt's pages may have been evicted for the rest since (the
            # pool holds exactly SLOTS): done once all of them are stored at once
            assert len(v.batch_put(vkeys, victim_pages)) == SLOTS
            return all(v.batch_exists(vkeys))

        eventually(stored, 20, "the freed slots back from quarantine", interval=0.1, errors=(PoolFull,))
        print(f"\nfreed slots placeable again after {time.monotonic() - t0:.1f} s (write_cap_ttl_s {CAP_TTL_S})")

    with client(tiny, ATTACKER, "attacker") as a:  # read rights on victim: tags and generations of its pages
        locs = a.admin(wire.Op.LOOKUP, {"ns": "victim", "keys": [k.encode() for k in vkeys]})["locs"]
    reused = [(g, loc) for g in grants for loc in locs if overlaps(g[1], loc[1])]
    assert len({loc[1] for _, loc in reused}) >= SLOTS - 1  # the victim's pages sit in the attacker's old slots

    node = FramedSocket(node_addr(tiny), "attacker node", deadline(), ATTACKER)
    refused = 0
    for g, loc in reused:
        _, off, _, gen, tag, cap = g
        forged = os.urandom(PAGE)
        for hdr_tag, hdr_gen in ((loc[4], loc[3]), (tag, gen)):  # as the victim's page, or as its own
            with pytest.raises(AuthError, match="expired capability|already holds generation"):
                write(node, off, gen, cap, hdr_tag, forged) if hdr_gen == gen else \
                    node.request(wire.Op.WRITE, [off, gen, cap], deadline(),
                                 data=[objformat.pack_object_header(hdr_tag, hdr_gen, PAGE), forged])
            refused += 1
    assert refused == 2 * len(reused)
    node.close()
    meta.close()
    with client(tiny, VICTIM, "victim", transport="tcp", checksum=True) as v:
        outs = [bytearray(PAGE) for _ in vkeys]
        assert v.batch_get_into(vkeys, outs) == [PAGE] * SLOTS
        assert outs == victim_pages  # every byte the victim's


def test_a_capability_writes_its_slot_once(tiny):
    meta = FramedSocket(tiny.metaserver_addr, "writer", deadline(), ATTACKER)
    (node_id, off, plen, gen, tag, cap), = alloc(meta, "attacker", [b"once"])
    node = FramedSocket(node_addr(tiny), "writer node", deadline(), ATTACKER)
    page = os.urandom(PAGE)
    write(node, off, gen, cap, tag, page)
    assert meta.request(wire.Op.COMMIT, {"ns": "attacker", "keys": [b"once"], "gens": [gen]},
                        deadline()).meta["ok"] == [True]
    for _ in range(2):  # after the commit, the same capability cannot rewrite the page (nor retry the refusal)
        with pytest.raises(AuthError, match=f"already holds generation {gen}"):
            write(node, off, gen, cap, tag, os.urandom(PAGE))
    # a WRITEV carrying it fails that object only, and the node keeps serving the connection
    f = node.request(wire.Op.WRITEV, [[off, gen, cap, objformat.OBJ_HEADER_SIZE + PAGE]], deadline(),
                     data=[objformat.pack_object_header(tag, gen, PAGE), os.urandom(PAGE)])
    assert [e[0] for e in f.meta] == [0] and "already holds" in f.meta[0][2]
    node.close()
    meta.close()
    with client(tiny, ATTACKER, "attacker", checksum=True) as a:
        assert a.get("once") == page


def cap_deadline_ms(cap: bytes) -> int:
    return int.from_bytes(cap[8:16], "little")  # auth._CAP_HEAD: epoch, expires_ms (in the clear, under the MAC)


def test_a_retried_alloc_never_renews_its_capability(tiny):
    """Issue 42, finding 1: ALLOC with a token, wait past the quarantine's hold, ALLOC again with the same token (as a
    client whose answer was lost): the same place and generation come back, but with the first answer's deadline at
    most. Then ABORT frees the extent at once, another tenant's 8 KiB pages land in it, and the kept capability must
    write none of their bytes."""
    first = FramedSocket(tiny.metaserver_addr, "attacker", deadline(), ATTACKER)
    req = {"ns": "attacker", "keys": [b"r"], "sizes": [PAGE], "token": 77}
    a = first.request(wire.Op.ALLOC, req, deadline()).meta
    (state, node_id, off, plen, gen, tag, _), cap = a["items"][0], a["caps"][0]
    assert state == wire.AllocState.NEW
    time.sleep(CAP_TTL_S + 2.5)  # the attack's own wait: past the hold (write_cap_ttl_s + the 2 s clock skew)
    retry = FramedSocket(tiny.metaserver_addr, "attacker again", deadline(), ATTACKER)
    b = retry.request(wire.Op.ALLOC, req, deadline()).meta
    assert b["items"][0][:5] == [state, node_id, off, plen, gen]  # the same place: ALLOC stays idempotent
    renewed = b["caps"][0]
    assert cap_deadline_ms(renewed) <= cap_deadline_ms(cap), "a retry extended the capability"
    node = FramedSocket(node_addr(tiny), "attacker node", deadline(), ATTACKER)
    with pytest.raises(AuthError, match="expired capability"):
        write(node, off, gen, renewed, tag, os.urandom(PAGE))
    assert retry.request(wire.Op.ABORT, {"ns": "attacker", "keys": [b"r"], "gens": [gen]}, deadline()).meta
    first.close()
    retry.close()

    small = 8192
    pages = [os.urandom(small) for _ in range(48)]
    keys = [f"v{i}" for i in range(len(pages))]
    with client(tiny, VICTIM, "victim", transport="tcp") as v:
        stored = v.batch_put(keys, pages)
    kept = [k for k, ok in zip(keys, stored) if ok]
    assert len(kept) >= 40
    with client(tiny, ATTACKER, "attacker") as a:  # read rights on victim: where its pages lie
        locs = a.admin(wire.Op.LOOKUP, {"ns": "victim", "keys": [k.encode() for k in kept]})["locs"]
    inside = [loc for loc in locs if loc is not None and off <= loc[1] < off + objformat.object_size(PAGE)]
    assert inside, "no victim page landed in the aborted extent"
    for _ in range(3):
        with pytest.raises(AuthError):
            write(node, off, gen, renewed, tag, os.urandom(PAGE))
    node.close()
    with client(tiny, VICTIM, "victim", transport="tcp") as v:
        outs = [bytearray(small) for _ in kept]
        assert v.batch_get_into(kept, outs) == [small] * len(kept)
        assert outs == [pages[keys.index(k)] for k in kept]  # every byte the victim's


def test_a_poisoned_header_generation_does_not_block_other_tenants(tiny):
    """Issue 42, finding 2: a tenant writes its slots with header generation 2**64 - 1 (bytes it chooses) and removes
    its keys. Once the quarantine gives the slots back, another tenant's TCP puts that land there must be stored,
    byte for byte: the node judges a write by the metaserver's capability, never by a header a client wrote."""
    meta = FramedSocket(tiny.metaserver_addr, "attacker", deadline(), ATTACKER)
    keys = [f"p{i}".encode() for i in range(SLOTS)]
    grants = alloc(meta, "attacker", keys)
    node = FramedSocket(node_addr(tiny), "attacker node", deadline(), ATTACKER)
    for _, off, _, gen, tag, cap in grants:
        node.request(wire.Op.WRITE, [off, gen, cap], deadline(),
                     data=[objformat.pack_object_header(tag, (1 << 64) - 1, PAGE), os.urandom(PAGE)])
    node.close()
    assert meta.request(wire.Op.COMMIT, {"ns": "attacker", "keys": keys, "gens": [g[3] for g in grants]},
                        deadline()).meta["ok"] == [True] * SLOTS
    assert meta.request(wire.Op.REMOVE, {"ns": "attacker", "keys": keys}, deadline()).meta["removed"] == [True] * SLOTS
    meta.close()
    pages = [os.urandom(PAGE) for _ in range(SLOTS)]
    vkeys = [f"v{i}" for i in range(SLOTS)]
    with client(tiny, VICTIM, "victim", transport="tcp") as v:
        def stored() -> bool:  # the slots come back CAP_TTL_S + the 2 s skew after the remove
            v.batch_put(vkeys, pages)
            return all(v.batch_exists(vkeys))

        eventually(stored, 20, lambda: f"the victim's pages stored: {v.batch_exists(vkeys).count(True)} of {SLOTS}",
                   interval=0.1, errors=(PoolFull,))
        outs = [bytearray(PAGE) for _ in vkeys]
        assert v.batch_get_into(vkeys, outs) == [PAGE] * SLOTS
        assert outs == pages
