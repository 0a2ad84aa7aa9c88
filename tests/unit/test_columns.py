"""metaserver/table/columns.py and metaserver/table/index.py: the columnar page table against a reference model (an ordered
dict per node), its invariant check after every step, leases and zombies, commit rules, block growth across many
rows, and the key index's rebuilds, tombstones, namespaces and keys that are not 32-byte digests."""

from __future__ import annotations

import random
import time
from collections import OrderedDict

import pytest

from metaserver.table.columns import BLOCK, PageTable
from metaserver.table.entry import EXISTS, IN_FLIGHT, NEW, NO_SPACE
from metaserver.table.index import MAX_LOAD, MIN_SLOTS
from metaserver.table.nodes import add_node
from metaserver.table.quarantine import Quarantine
from transport.objformat import object_size
from umbp.errors import ConfigError

from tablekit import PLEN, put, table


class Model:
    """One node of ``slots`` pages: READY keys in recency order (oldest first), and pins per incarnation of a key
    (a key removed while pinned and put again is a new page; the old one holds its slot until unpinned)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.order: OrderedDict[bytes, int] = OrderedDict()  # key -> its incarnation
        self.pins: dict[tuple[bytes, int], int] = {}
        self.zombies: set[tuple[bytes, int]] = set()
        self.leases: dict[int, list[tuple[bytes, int]]] = {}
        self.made = 0

    def used(self) -> int:
        return len(self.order) + len(self.zombies)

    def alloc(self, keys: list[bytes]) -> list[int]:
        """Keys in order: a READY one is a use (most recent now); a new one takes a slot, evicting the least
        recently used unpinned page, and joins the order at its commit (the test commits right after), so after
        this request's uses."""
        out = []
        batch = []  # this request's new keys: PENDING until its commit, so never its own victims
        for k in keys:
            if k in self.order:  # a put of a page already here is a use of it
                self.order.move_to_end(k)
                out.append(EXISTS)
                continue
            while self.used() + len(batch) >= self.slots:
                victim = next((v for v, inc in self.order.items() if not self.pins.get((v, inc))), None)
                if victim is None:
                    break
                del self.order[victim]
            if self.used() + len(batch) >= self.slots:
                out.append(NO_SPACE)
                continue
            batch.append(k)
            out.append(NEW)
        for k in batch:
            self.made += 1
            self.order[k] = self.made
        return out

    def touch(self, pages: list[tuple[bytes, int]]) -> None:
        for k, inc in pages:
            if self.order.get(k) == inc:
                self.order.move_to_end(k)

    def lookup(self, lease: int, keys: list[bytes]) -> list[bool]:
        hits = [(k, self.order[k]) for k in keys if k in self.order]
        for page in hits:
            self.pins[page] = self.pins.get(page, 0) + 1
        self.touch(hits)
        if hits:
            self.leases[lease] = hits
        return [k in self.order for k in keys]

    def release(self, lease: int) -> None:
        hits = self.leases.pop(lease)
        for page in hits:
            self.pins[page] -= 1
            if not self.pins[page]:
                self.zombies.discard(page)
        self.touch(hits)

    def remove(self, keys: list[bytes]) -> None:
        for k in keys:
            inc = self.order.pop(k, None)
            if inc is not None and self.pins.get((k, inc)):
                self.zombies.add((k, inc))


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_an_exact_lru_model(seed):
    rng = random.Random(seed)
    slots = 24
    t, m = table(1, slots), Model(slots)
    universe = [bytes([i]) * 32 for i in range(30)] + [b"key-%d" % i for i in range(30)]  # raw digests and others
    gen = 1
    for _step in range(400):
        op = rng.random()
        if op < 0.4:
            keys = rng.sample(universe, rng.randint(1, 6))
            items = put(t, keys, gen)
            gen += len(keys)
            assert [it[0] for it in items] == m.alloc(keys)
        elif op < 0.65:
            keys = rng.sample(universe, rng.randint(1, 8))
            lease, locs = t.lookup("a", keys)
            assert [loc is not None for loc in locs] == m.lookup(lease, keys)
            assert (lease == 0) == all(loc is None for loc in locs)
        elif op < 0.85 and m.leases:
            lease = rng.choice(list(m.leases))
            assert t.release(lease)
            m.release(lease)
        else:
            keys = rng.sample(universe, rng.randint(1, 3))
            want = [k in m.order for k in keys]
            assert t.remove("a", keys) == want
            m.remove(keys)
        t.check()
        assert t.exists("a", universe) == [k in m.order for k in universe]
    for lease in list(m.leases):
        assert t.release(lease)
    t.check()
    assert t.nodes[0].alloc.used == len(m.order) * object_size(PLEN)


def test_lookup_answers_locations_and_pins_until_release():
    t = table(2, 4)
    keys = [b"k%d" % i for i in range(8)]
    items = put(t, keys, gen=100)
    lease, locs = t.lookup("a", [keys[3], b"missing", keys[0]])
    assert locs[1] is None and lease != 0
    assert locs[0] == items[3][1:] and locs[2] == items[0][1:], "(node, offset, payload_len, gen) as ALLOC gave"
    assert put(t, [b"new"], gen=200)[0][0] == NEW  # evicts an unpinned page of the placed node, not a pinned one
    assert t.exists("a", [keys[3], keys[0]]) == [True, True]
    assert t.release(lease) and not t.release(lease), "a lease is released once"
    t.check()


def test_a_removed_pinned_page_keeps_its_bytes_until_its_last_pin():
    t = table(1, 2)
    put(t, [b"a", b"b"])
    lease, _ = t.lookup("a", [b"a"])
    assert t.remove("a", [b"a"]) == [True]
    t.check()
    assert put(t, [b"c"], gen=10)[0][0] == NEW, "b was evictable"
    lease_c, _ = t.lookup("a", [b"c"])
    assert put(t, [b"d"], gen=11)[0][0] == NO_SPACE, "a's zombie and the pinned c hold both slots"
    t.check()
    assert t.release(lease)
    t.check()
    assert t.nodes[0].alloc.used == object_size(PLEN) and t.exists("a", [b"a", b"c"]) == [False, True]
    assert put(t, [b"d"], gen=12)[0][0] == NEW, "a's bytes came back with its last pin"
    assert t.release(lease_c)
    t.check()


def test_tags_given_at_alloc_come_back_with_the_rows():
    t = table(1, 8)
    keys = [b"t%d" % i for i in range(4)]
    items = t.alloc("a", keys, [PLEN] * 4, 50, tags=[11, 12, 13, 14])
    assert t.commit("a", keys, [it[4] for it in items]) == [True] * 4
    lease, hit, rows = t.lookup_rows("a", [keys[2], b"nope", keys[0]])
    assert hit.tolist() == [True, False, True] and t.cols["tag"].take(rows).tolist() == [13, 11]
    assert t.release(lease)
    t.check()


def test_commit_rules_and_in_flight_keys():
    t = table(1, 4)
    items = t.alloc("a", [b"x", b"y"], [PLEN, PLEN], 7)
    assert [it[0] for it in items] == [NEW, NEW]
    assert t.alloc("a", [b"x"], [PLEN], 9)[0][0] == IN_FLIGHT
    assert t.exists("a", [b"x"]) == [False] and t.lookup("a", [b"x"]) == (0, [None])
    assert t.commit("a", [b"x", b"y", b"z"], [7, 99, 1]) == [True, False, False], "wrong gen, unknown key"
    assert t.commit("a", [b"x"], [7]) == [True], "a retried commit of the same generation"
    assert t.alloc("a", [b"x"], [PLEN], 9)[0][0] == EXISTS
    t.check()


def test_namespaces_are_apart_and_rows_grow_past_a_block():
    t = table(3, BLOCK)  # enough room: nothing evicted
    keys = [i.to_bytes(32, "little") for i in range(BLOCK + 500)]
    for i in range(0, len(keys), 1000):
        put(t, keys[i:i + 1000], gen=1 + i, ns="a")
    put(t, keys[:10], gen=10**6, ns="b")
    t.check()
    assert t.evictions == 0 and t.objects == len(keys) + 10
    assert sum(t.exists("a", keys)) == len(keys) and t.exists("b", keys[9:11]) == [True, False]
    with pytest.raises(ConfigError, match="columns: node 'n0' already has rows"):
        add_node(t, "n0", 1 << 20)


def test_key_index_rebuilds_keeps_namespaces_apart_and_gives_keys_back():
    """Enough keys for several resizes of the index (it starts at MIN_SLOTS slots), half of them removed (their
    slots emptied), the rest still found in their own namespace only; long keys come back as sent."""
    t = table(2, 200_000)
    raw = [i.to_bytes(32, "little") for i in range(50_000)]
    long = [b"sglang-page-%d" % i for i in range(20_000)]
    for ns, keys in (("a", raw), ("b", long), ("c", raw[:1000])):
        for i in range(0, len(keys), 5000):
            put(t, keys[i:i + 5000], gen=1 + i, ns=ns)
    assert t.evictions == 0 and t.ix.capacity > MIN_SLOTS and t.ix.resizes >= 2, "the index grew"
    live = t.ix.live
    assert t.remove("a", raw[::2]) == [True] * 25_000 and t.ix.live == live - 25_000
    t.check()
    assert t.exists("a", raw) == [i % 2 == 1 for i in range(len(raw))]
    assert sum(t.exists("b", long)) == len(long) and sum(t.exists("c", raw)) == 1000
    assert t.exists("b", raw[:5]) == [False] * 5 and t.exists("zz", long[:3]) == [False] * 3
    lease, locs = t.lookup("b", long[7:9])
    rows = t._find("b", long[7:9]).tolist()
    assert [t.key_of(r) for r in rows] == long[7:9] and t.key_of(int(t._find("a", raw[1:2])[0])) == raw[1]
    assert t.release(lease)
    resizes = t.ix.resizes
    for n in range(40):  # until the index resizes again (bounded: 200k more keys at most)
        if t.ix.resizes > resizes:
            break
        put(t, [b"after-%d-%d" % (n, i) for i in range(5000)], gen=10**7 + n * 5000, ns="a")
    t.check()
    assert t.ix.resizes > resizes and sum(t.exists("a", raw)) == 25_000


def test_keys_that_differ_in_one_word_do_not_pile_up():
    """Raw 32-byte keys a client picks to share three of their four words still land apart: every word is hashed,
    so 5,000 such keys in the smallest index are filed without a move and none waits in the stash."""
    t = table(1, 6000)
    keys = [b"\x07" * 24 + i.to_bytes(8, "little") for i in range(5000)]
    for i in range(0, 5000, 1000):
        put(t, keys[i:i + 1000], gen=1 + i)
    t.check()
    assert t.ix.kicks == 0 and not len(t.ix.stash), t.ix.kicks
    assert sum(t.exists("a", keys)) == 5000


def test_a_key_named_twice_in_a_lookup_is_pinned_twice_and_freed_once():
    t = table(1, 4)
    put(t, [b"x", b"y"])
    lease, locs = t.lookup("a", [b"x", b"y", b"x"])
    assert locs[0] == locs[2] is not None
    (row,) = t._find("a", [b"x"]).tolist()
    assert t.cols["pins"][row] == 2
    t.check()
    assert t.remove("a", [b"x"]) == [True]
    assert t.release(lease)
    t.check()
    assert t.nodes[0].alloc.used == object_size(PLEN), "x's bytes came back once, with its last pin"


def test_leases_belong_to_their_owner_and_expire_in_budgeted_steps():
    t = PageTable(read_lease_s=10.0)
    add_node(t, "n0", 8 * object_size(PLEN))
    put(t, [b"p", b"q"])
    mine, other = object(), object()
    l1, _ = t.lookup("a", [b"p"], now=100.0, owner=mine)
    l2, _ = t.lookup("a", [b"q"], now=101.0, owner=mine)
    l3, _ = t.lookup("a", [b"p", b"q"], now=102.0)
    assert not t.release(l1, owner=other) and l1 in t.leases, "another connection cannot release it"
    assert t.release(l1, owner=mine) and not t.release(l1, owner=mine)
    assert t.expire_leases(111.5, budget=10) == 1, "l1 was released by its owner; l2 ran out at 111"
    assert set(t.leases) == {l3}
    assert t.expire_leases(200.0, budget=0) == 0 and set(t.leases) == {l3}, "no budget, no work"
    assert t.expire_leases(200.0, budget=1) == 1 and not t.leases
    t.check()
    assert t.cols["pins"].sum() == 0


def test_leases_released_together_unpin_shared_rows_stamp_in_order_and_free_a_zombie_once():
    t = table(1, 4)
    put(t, [b"x", b"y", b"z"])
    mine, other = object(), object()
    a, _ = t.lookup("a", [b"x", b"y"], owner=mine)
    b, _ = t.lookup("a", [b"y", b"x"], owner=mine)
    c, _ = t.lookup("a", [b"z"], owner=other)
    x, y, z = t._find("a", [b"x", b"y", b"z"]).tolist()
    assert t.remove("a", [b"x"]) == [True]  # x a zombie under two leases
    assert t.nodes[0].alloc.used == 3 * object_size(PLEN)
    # c is another owner's, 7 unknown, b named twice: a and b released, each once, in one pass
    assert t.release_many([(a, mine), (c, mine), (7, mine), (b, mine), (b, mine)]) == 2
    assert set(t.leases) == {c} and t.cols["pins"][[x, y, z]].tolist() == [0, 0, 1]
    assert t.nodes[0].alloc.used == 2 * object_size(PLEN), "x's bytes came back once, with its last pin"
    st = t.cols["stamp"]
    assert st[y] > st[z], "b's rows were stamped last, as releasing a then b would"
    t.check()
    assert t.disown(c, other) and not t.disown(c, other), "taken from its owner once"
    assert c in t.leases and t.cols["pins"][z] == 1, "still pinned until its release"
    assert not t.release(c, other), "nor released by its former owner"
    assert t.release_many([(c, None)]) == 1 and t.cols["pins"].sum() == 0
    t.check()


def test_uncommitted_rows_expire_oldest_first_within_a_budget():
    t = PageTable(pending_ttl_s=30.0)
    add_node(t, "n0", 8 * object_size(PLEN))
    old = t.alloc("a", [b"o1", b"o2"], [PLEN, PLEN], 1, now=100.0)
    new = t.alloc("a", [b"n1"], [PLEN], 3, now=120.0)
    assert [it[0] for it in old + new] == [NEW] * 3
    t.check()
    assert t.expire_pending(129.9, budget=10) == 0, "nothing is due yet"
    assert t.expire_pending(131.0, budget=1) == 1 and t.expire_pending(131.0, budget=10) == 1, "o1, then o2"
    t.check()
    assert t.alloc("a", [b"o1"], [PLEN], 9, now=131.0)[0][0] == NEW, "an expired key can be written again"
    assert t.commit("a", [b"n1"], [3]) == [True] and t.expire_pending(1000.0, budget=10) == 1, "only o1's new row"
    t.check()
    assert t.exists("a", [b"o1", b"o2", b"n1"]) == [False, False, True]
    assert t.nodes[0].alloc.used == object_size(PLEN)


def test_the_tables_step_drains_a_key_index_resize():
    """A page table whose index is mid-resize: ``step`` drains it in budgeted slices and every page stays found."""
    t = table(1, 40_000)
    keys: list[bytes] = []
    # 1,000 keys at a time until an insert leaves a resize under way: the smallest index resizes at MAX_LOAD x
    # MIN_SLOTS rows, or sooner when a row was kicked into the stash (random bucket salts: about 1 run in 150), and
    # that earlier drain may end before the keys do; the next resize comes at about 34k rows, before the node is full
    while t.ix.old is None or len(keys) < MAX_LOAD * MIN_SLOTS:
        assert len(keys) < 39_000, "no resize under way after 39k keys"
        batch = [i.to_bytes(32, "little") for i in range(len(keys), len(keys) + 1000)]
        put(t, batch, gen=1 + len(keys))
        keys += batch
    slices = 0
    while t.step(2048):
        slices += 1
        assert slices < 1000
    assert slices >= 2 and t.ix.old is None
    t.check()
    assert sum(t.exists("a", keys)) == len(keys)


def test_a_retried_alloc_gets_its_place_back_under_its_token_and_abort_gives_back():
    t = table(1, 8)
    items = t.alloc("a", [b"x", b"y"], [PLEN, PLEN], 7, token=11, owner="c1")
    assert [it[0] for it in items] == [NEW, NEW]
    assert t.alloc("a", [b"x", b"y"], [PLEN, PLEN], 20, token=11, owner="c2") == items, "same places, same gens"
    assert t.writer_of(int(t._find("a", [b"x"])[0])) == "c2", "the retry's connection owns it now"
    assert t.alloc("a", [b"x"], [PLEN], 30, token=12)[0][0] == IN_FLIGHT, "another writer's token"
    assert t.alloc("a", [b"x"], [PLEN - 1], 30, token=11)[0][0] == IN_FLIGHT, "same token, another length"
    z = t.alloc("a", [b"z", b"z"], [PLEN, PLEN], 40)
    assert [it[0] for it in z] == [NEW, EXISTS], "a key given twice: the first is the one stored"
    t.check()
    assert t.abort("a", [b"x", b"y", b"z", b"q"], [7, 99, 40, 1]) == 2, "y's generation differs, q is unknown"
    assert t.writer_of(int(t._find("a", [b"y"])[0])) == "c2" and t._find("a", [b"x", b"z"]).tolist() == [-1, -1]
    assert t.nodes[0].alloc.used == object_size(PLEN), "only y's slot is still allocated"
    t.check()
    assert t.commit("a", [b"y"], [8]) == [True] and t.abort("a", [b"y"], [8]) == 0, "a READY page is not aborted"
    assert [it[0] for it in t.alloc("a", [b"x"], [PLEN], 50)] == [NEW]
    t.check()


def test_young_extents_wait_out_their_write_capabilities_in_the_quarantine():
    """A closed pool's table: an extent freed while its generation is young (remove, eviction, abort) is held for
    the quarantine's hold, not handed to the next writer, and the allocator counts it until released."""
    t = table(1, 4)
    q = Quarantine(hold_s=30.0)
    q.start(time.monotonic(), 1)  # every generation from 1 on is young
    t.quarantine = q
    items = put(t, [b"a", b"b", b"c"], gen=1)
    offs = {it[2] for it in items}
    assert t.remove("a", [b"a"]) == [True]
    assert q.held_bytes == object_size(PLEN) and t.nodes[0].alloc.used == 3 * object_size(PLEN)
    (d,) = put(t, [b"d"], gen=10)
    assert d[0] == NEW and d[2] not in offs, "the fourth slot, not the held one"
    t.check()
    e = t.alloc("a", [b"e"], [PLEN], 20)  # full: the LRU victims are young, so their extents are held too
    assert e == [(NO_SPACE, None, None, None, None)] and t.evictions == 3
    assert t.exists("a", [b"b", b"c", b"d"]) == [False] * 3 and q.held_bytes == 4 * object_size(PLEN)
    t.check()
    assert q.release(time.monotonic() + 31, t.node_by_id, 100) == 4
    assert t.nodes[0].alloc.used == 0
    q.young_gen = 1 << 40  # generations below it are old: freed at once
    put(t, [b"f"], gen=30)
    assert t.remove("a", [b"f"]) == [True] and not q.held and t.nodes[0].alloc.used == 0
    t.check()


def test_a_chain_goes_near_its_parent_unless_that_node_is_much_fuller():
    """Near the parent while that node has at least half the free bytes of the emptiest, else in turn."""
    t = table(3, 100)
    chain = [b"c%d" % i for i in range(10)]
    items = t.alloc("a", chain, [PLEN] * 10, 1, parents=[None] + chain[:-1])
    assert len({it[1] for it in items}) == 1, "one ALLOC of a chain: every page near the first"
    assert t.commit("a", chain, [it[4] for it in items]) == [True] * 10
    home = items[0][1]
    more = t.alloc("a", [b"c10", b"c11"], [PLEN] * 2, 100, parents=[b"c9", b"c10"])
    assert {it[1] for it in more} == {home}, "a later ALLOC near its READY parent"
    other = [it[1] for it in t.alloc("a", [b"x%d" % i for i in range(6)], [PLEN] * 6, 200)]
    assert home in other and len(set(other)) == 3, "no parent: in turn over the nodes"
    # fill the home node until it has less than half the free bytes of the emptiest one
    filler = [b"f%d" % i for i in range(60)]
    t.alloc("a", filler, [PLEN] * 60, 300, parents=[b"c11"] * 60)
    free = {n.node_id: n.alloc.free_bytes for n in t.nodes}
    assert 2 * free[home] < max(free.values()), free
    far = t.alloc("a", [b"c12"], [PLEN], 400, parents=[b"c11"])
    assert far[0][1] != home, "the parent's node is much fuller: placed in turn"
    t.check()
