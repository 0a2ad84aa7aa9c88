"""Unit tests of quota groups and reservations (umbp/quotarules.py, metaserver/table/quotas.py), pure, no I/O: the
tokens file's pattern quotas, token quotas and reservations; on the columnar directory (``TableDirectory``) a group's
use counted over its namespaces and kept exact through every transition; a flood evicting its own group's pages only,
never pinned or PENDING ones, refused whole (nothing evicted) when they cannot make room; a slot's share of a quota;
global eviction (placement, the watermark pass, EVICT of bytes) passing over a group at its reservation, evict-all
not; the reservations clamped to half the capacity; a group's quota counting its extents held young."""

from itertools import count

import pytest

from metaserver.table.entry import EXISTS, NEW, OVER_QUOTA, Effects
from metaserver.table.quarantine import Quarantine
from metaserver.table.directory import TableDirectory
from metaserver.table.load import load_pages
from transport.objformat import ALIGN, ARENA_DATA_START, OBJ_HEADER_SIZE, object_size
from umbp.auth import Tokens
from umbp.errors import ConfigError
from umbp.quotarules import QuotaGroup, QuotaRules

PAGE = ALIGN - OBJ_HEADER_SIZE  # payload that fills exactly one 4 KiB unit with its header
_gens = count(1000, 1000)  # a request's generations: above every earlier request's


def make(units=8, nodes=("n1",), policy="lru", quotas=None):
    d = TableDirectory(policy=policy, quotas=quotas)
    for n in nodes:
        d.add_space(n, units * ALIGN)
    return d


def put(d, ns, keys, now=0.0):
    items, fx = d.alloc(ns, keys, [PAGE] * len(keys), None, next(_gens), now)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, cfx = d.commit(ns, [k for k, _ in news], [g for _, g in news], now)
    assert all(ok)
    return items, fx, cfx


def keys(prefix, lo, hi=None):
    lo, hi = (0, lo) if hi is None else (lo, hi)
    return [f"{prefix}{i}".encode() for i in range(lo, hi)]


SECRET = "cluster-secret-0123456789"
SZ = object_size(PAGE)  # one 4 KiB unit


def load(tmp_path, text):
    p = tmp_path / "tokens.toml"
    p.write_text(f'cluster_secret = "{SECRET}"\n' + text)
    return Tokens.load(None, str(p), "metaserver")


TOKENS = '''
[[tokens]]
name = "tenant-q"
secret = "tenant-q-secret-0123456789"
namespaces = { "tenant-q/ro" = "r", "tenant-q/*" = "rw", "shared/*" = "r" }
quota = "1MiB"
[[tokens]]
name = "tenant-b"
secret = "tenant-b-secret-0123456789"
namespaces = { "tenant-b" = "rw" }
[quotas]
"tenant-q/special" = "64KiB"
"batch/*" = 8192
[reservations]
"tenant-q/*" = "256KiB"
"batch/*" = 4096
'''


def test_tokens_file_makes_groups_from_patterns_and_token_quotas(tmp_path):
    t = load(tmp_path, TOKENS)
    rules = t.quota_rules
    assert t.quotas == {"tenant-q/special": 64 << 10, "batch/*": 8192}
    assert sorted(rules) == ["batch/*", "tenant-q/special", "token:tenant-q"]
    g = rules.group_of("tenant-q/flood")
    assert (g.name, g.quota, g.reserve) == ("token:tenant-q", 1 << 20, 256 << 10)
    assert rules.group_of("tenant-q/other") is g  # every namespace the pattern grant writes: one group
    assert rules.group_of("tenant-q/special").name == "tenant-q/special"  # an exact [quotas] name comes first
    assert rules.group_of("batch/1") is rules.group_of("batch/2") and rules.group_of("batch/1").reserve == 4096
    assert rules.group_of("tenant-b") is None and rules.group_of("shared/x") is None  # no quota: r only, no quota
    assert rules.reserved == (256 << 10) + 4096


@pytest.mark.parametrize("text, match", [
    ('[[tokens]]\nname = "a"\nsecret = "a-secret-0123456789"\nadmin = true\nquota = "1MiB"\n',
     "admin token .* takes no quota"),
    ('[[tokens]]\nname = "a"\nsecret = "a-secret-0123456789"\nnamespaces = { "x" = "r" }\nquota = "1MiB"\n',
     "quota covers no namespace"),
    ('[[tokens]]\nname = "a"\nsecret = "a-secret-0123456789"\nnamespaces = { "x" = "rw" }\nquota = "lots"\n',
     "quota: expected a size like 512MiB"),
    ('[quotas]\n"a/*" = 4096\n[reservations]\n"b/*" = 1\n', r"reservations.'b/\*': names no quota group"),
    ('[quotas]\n"a/*" = 4096\n[reservations]\n"a/*" = 8192\n', r"8192 bytes is more than the quota"),
    ('[reservations]\n"a" = true\n', r"reservations.'a': expected a size"),
    ('reservations = 5\n', "reservations must be a table"),
])
def test_bad_quota_entries_are_config_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, text)


def test_a_pattern_group_shares_one_quota_and_a_flood_evicts_only_its_own_pages():
    rules = QuotaRules([QuotaGroup("token:q", 6 * SZ, patterns=("q/*",))])
    d = make(units=64, quotas=rules)
    put(d, "other", [f"o{i}".encode() for i in range(20)], now=0.0)
    put(d, "q/a", [b"a0", b"a1"], now=1.0)
    for i in range(40):  # a flood into another namespace of the group, one page at a time
        items, _, _ = put(d, "q/flood", [f"f{i}".encode()], now=2.0 + i)
        assert items[0][0] == NEW
        assert d.group_used["token:q"] <= 6 * SZ
        d.check()
    assert d.exists("q/a", [b"a0", b"a1"]) == [False, False]  # the group's own oldest pages went first
    assert d.exists("q/flood", [f"f{i}".encode() for i in range(40)]) == [False] * 34 + [True] * 6
    assert d.exists("other", [f"o{i}".encode() for i in range(20)]) == [True] * 20  # nothing of another namespace
    assert d.group_used == {"token:q": 6 * SZ}
    assert {ns: u for ns, u in d.ns_used.items() if ns.startswith("q/")} == {"q/flood": 6 * SZ}
    items, _ = d.alloc("q/new", [f"n{i}".encode() for i in range(7)], [PAGE] * 7, None, 9000, 50.0)
    assert [it[0] for it in items] == [OVER_QUOTA] * 7  # more than the group's quota: refused whole
    usage = d.namespace_usage()
    assert usage["q/flood"]["quota_bytes"] == 6 * SZ and usage["other"]["quota_bytes"] is None
    d.check()


def test_a_slots_share_of_a_quota():
    rules = QuotaRules([QuotaGroup("g", 16 * SZ, reserve=8 * SZ, patterns=("g*",))]).shared(8)
    g = rules.group_of("g1")
    assert (g.quota, g.limit, g.reserve, g.floor) == (16 * SZ, 2 * SZ, 8 * SZ, SZ)
    d = make(units=64, quotas=rules)
    items, _ = d.alloc("g1", [f"k{i}".encode() for i in range(3)], [PAGE] * 3, None, 100, 0.0)
    assert [it[0] for it in items] == [OVER_QUOTA] * 3  # more than the slot's share in one request
    for i in range(5):
        put(d, "g1", [f"k{i}".encode()], now=1.0 + i)
    assert d.group_used["g"] == 2 * SZ and d.objects == 2  # at most the slot's share
    assert d.namespace_usage()["g1"]["quota_bytes"] == 16 * SZ  # STATS names the pool-wide quota
    d.check()


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_global_eviction_passes_over_a_group_at_its_reservation(policy):
    rules = QuotaRules([QuotaGroup("r", 100 * SZ, reserve=10 * SZ, patterns=("r",))])
    d = make(units=32, nodes=("n1", "n2"), policy=policy, quotas=rules)
    put(d, "r", [f"r{i}".encode() for i in range(12)], now=0.0)  # the oldest pages of the pool
    for i in range(100):  # another namespace floods the 64-unit pool
        items, _, _ = put(d, "flood", [f"f{i}".encode()], now=1.0 + i)
        assert items[0][0] == NEW
    assert d.group_used["r"] == 10 * SZ  # its two oldest went, then never below the reservation
    assert d.exists("r", [f"r{i}".encode() for i in range(12)]).count(True) == 10
    assert d.ns_used["flood"] == 54 * SZ
    d.check()
    fx = Effects()  # the background pass down to 25%: the flood's pages only
    n, _ = d.watermark_pass(0.25, 0.25, 10_000, fx)
    assert d.group_used["r"] == 10 * SZ and d.ns_used["flood"] == 6 * SZ
    n, freed = d.evict_bytes(64 * SZ, 10_000, fx)  # an operator's EVICT of bytes: the flood's pages only
    assert (n, freed) == (6, 6 * SZ) and d.group_used["r"] == 10 * SZ and "flood" not in d.ns_used
    d.check()
    n, _, done = d.evict_all(10_000, fx)  # an operator's EVICT --all takes every page
    assert done and d.objects == 0
    d.check()


def test_reservations_are_clamped_to_half_the_capacity():
    rules = QuotaRules([QuotaGroup("r", 100 * SZ, reserve=40 * SZ, patterns=("r",))])
    d = make(units=32, quotas=rules)  # 32 units: at most 16 held back
    assert rules.floor(rules.group_of("r"), d.capacity) == 16 * SZ
    put(d, "r", [f"r{i}".encode() for i in range(20)], now=0.0)
    for i in range(40):
        assert put(d, "flood", [f"f{i}".encode()], now=1.0 + i)[0][0][0] == NEW
    assert d.group_used["r"] == 16 * SZ
    d.check()


def test_a_groups_quota_counts_its_extents_held_young():
    """Closed pools: a page freed young waits out its write capability in the quarantine, taking arena space; its
    group counts it until then, and quota eviction takes old pages only (a young one would stay held)."""
    rules = QuotaRules([QuotaGroup("token:q", 6 * SZ, patterns=("q/*",))])
    d = make(units=64, quotas=rules)
    d.quarantine = Quarantine(hold_s=60.0, keep_s=60.0)
    d.quarantine.start(0.0, 0)  # every generation from 0 on is young
    put(d, "q/a", [f"a{i}".encode() for i in range(6)], now=1.0)
    items, _ = d.alloc("q/a", [b"new"], [PAGE], None, 9000, 2.0)
    assert items[0][0] == OVER_QUOTA and d.objects == 6  # all six young: evicting one frees nothing of the quota
    d.remove("q/a", [b"a5"])
    assert d.group_used["token:q"] == 5 * SZ and d.group_held("token:q") == SZ  # held, and counted
    items, _ = d.alloc("q/a", [b"new"], [PAGE], None, 9001, 3.0)
    assert items[0][0] == OVER_QUOTA
    d.quarantine.young_gen = 1 << 62  # the write capabilities of every page so far are dead: they are old now
    items, _, _ = put(d, "q/a", [b"new"], now=4.0)
    assert items[0][0] == NEW and d.exists("q/a", [b"a0"]) == [False]  # its oldest page went, freed at once
    assert d.group_used["token:q"] == 5 * SZ and d.group_held("token:q") == SZ
    assert d.group_held("token:q", now=1e12) == 0  # given back at its time: forgotten
    d.check()


def test_quota_evicts_within_the_namespace_then_refuses():
    """An exact-name quota: the namespace's own least recently used pages make room, never a pinned one; a request
    that cannot fit even so is refused whole and evicts nothing."""
    d = make(units=64, quotas={"small": 4 * SZ})
    put(d, "big", keys("b", 10), now=0.0)
    for i in range(4):
        put(d, "small", [f"s{i}".encode()], now=1.0 + i)
    assert d.ns_used["small"] == 4 * SZ
    d.lookup("small", [b"s0"], 9.0)  # s0 pinned (and the most recent): never evicted
    items, _, _ = put(d, "small", [b"s4", b"s5"], now=10.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert d.exists("small", keys("s", 6)) == [True, False, False, True, True, True]
    assert d.ns_used["small"] == 4 * SZ and d.objects == 14
    assert d.exists("big", keys("b", 10)) == [True] * 10  # the other namespace untouched
    # s0 pinned, s3..s5 evictable: 4 new keys cannot fit, and the refusal evicts nothing
    items, _ = d.alloc("small", keys("t", 4), [PAGE] * 4, None, 5000, 11.0)
    assert [it[0] for it in items] == [OVER_QUOTA] * 4
    assert d.exists("small", [b"s0", b"s3", b"s4", b"s5"]) == [True] * 4 and d.pending == 0
    items, _ = d.alloc("small", [b"huge"], [5 * SZ], None, 6000, 12.0)
    assert items[0][0] == OVER_QUOTA  # larger than the quota itself
    items, _ = d.alloc("small", keys("t", 3), [PAGE] * 3, None, 7000, 13.0)
    assert [it[0] for it in items] == [NEW] * 3  # 3 fit after evicting s3..s5, oldest first
    assert d.exists("small", [b"s0", b"s3", b"s4", b"s5"]) == [True, False, False, False]
    assert d.ns_used["small"] == 4 * SZ and d.group_used == {"small": 4 * SZ}
    d.check()


def test_quota_eviction_takes_no_pending_page_and_spares_the_requests_own_keys():
    """PENDING pages count but are never evicted; a READY key the ALLOC names again (EXISTS: a use) is not taken to
    make room for its new keys; a key given twice counts once."""
    d = make(units=64, quotas={"q": 6 * SZ})
    put(d, "q", keys("k", 4))
    items, _ = d.alloc("q", [b"p0", b"p1"], [PAGE] * 2, None, next(_gens), 1.0)  # PENDING, never committed
    assert [it[0] for it in items] == [NEW, NEW] and d.ns_used["q"] == 6 * SZ
    items, _ = d.alloc("q", [b"k0", b"n0", b"n0"], [PAGE] * 3, None, next(_gens), 2.0)
    assert [it[0] for it in items] == [EXISTS, NEW, EXISTS]
    assert d.exists("q", keys("k", 4)) == [True, False, True, True]  # k1 went, not k0 (named by the request)
    items, _ = d.alloc("q", keys("m", 5), [PAGE] * 5, None, next(_gens), 3.0)
    assert [it[0] for it in items] == [OVER_QUOTA] * 5  # 3 PENDING, 3 READY: at most 3 can go
    assert d.exists("q", [b"k0", b"k2", b"k3"]) == [True] * 3 and d.pending == 3
    d.check()


def test_use_is_exact_through_every_transition():
    """Use (extents of READY and PENDING rows) per namespace and group after ALLOC, COMMIT, ABORT, a retried ALLOC,
    REMOVE of a pinned page, PENDING expiry, DRAIN, node loss in slices, a full node's eviction and a load: ``check``
    recounts it from the columns each time."""
    rules = QuotaRules([QuotaGroup("g", 1000 * SZ, patterns=("g/*",))])
    d = make(units=16, nodes=("n1", "n2"), quotas=rules)
    gen = next(_gens)
    items, _ = d.alloc("g/a", keys("a", 6), [PAGE] * 6, None, gen, 0.0, token=7)
    assert d.ns_used == {"g/a": 6 * SZ} and d.group_used == {"g": 6 * SZ}
    d.alloc("g/a", keys("a", 6), [PAGE] * 6, None, next(_gens), 0.0, token=7)  # retried: its places again
    assert d.ns_used == {"g/a": 6 * SZ}
    d.commit("g/a", keys("a", 4), [gen + i for i in range(4)], 0.0)
    d.abort("g/a", [b"a4"], [gen + 4])
    assert d.ns_used == {"g/a": 5 * SZ}
    d.check()
    assert d.expire_pending(1e9, 10) == 1  # a5 never committed
    assert d.ns_used == {"g/a": 4 * SZ}
    lease, _ = d.lookup("g/a", [b"a0"], 0.0)
    assert d.remove("g/a", [b"a0"])[0] == [True]  # pinned: GONE, its extent kept, no longer used
    assert d.ns_used == {"g/a": 3 * SZ}
    d.check()
    d.release(lease)
    put(d, "g/b", keys("b", 10))
    put(d, "plain", keys("p", 4))  # no group: counted per namespace only
    assert d.group_used == {"g": 13 * SZ} and d.ns_used["plain"] == 4 * SZ
    d.check()
    d.drain("n1")
    d.check()
    d.detach_space("n2")
    while d.drop_slice("n2", 2)[1] is None:
        pass
    d.check()
    assert d.ns_used == {} and d.group_used == {} and d.objects == 0
    d.add_space("n3", 8 * ALIGN)
    put(d, "g/c", keys("c", 12))  # 8 units: a full node evicts its own oldest
    assert d.group_used == {"g": 8 * SZ}
    d.check()
    d.add_space("n4", 8 * ALIGN)  # a takeover's load files its pages
    bad = load_pages(d, "n4", ["g/d"] * 3, keys("d", 3), [ARENA_DATA_START + i * ALIGN for i in range(3)],
                     [PAGE] * 3, [1, 2, 3])
    assert bad == [] and d.group_used == {"g": 11 * SZ} and d.ns_used["g/d"] == 3 * SZ
    d.check()


def test_a_reserved_group_with_more_old_pages_than_a_queue_hides_no_victim():
    """A node's candidate queue (1,024 of its oldest pages) full of a reserved group's pages: global eviction still
    finds the node's other pages (a refill leaves out the rows of groups at their floor)."""
    rules = QuotaRules([QuotaGroup("r", 4000 * SZ, reserve=2000 * SZ, patterns=("r",))])
    d = make(units=3000, quotas=rules)  # the floor is clamped to 1,500 units
    put(d, "r", keys("r", 1600))
    put(d, "b", keys("b", 1400))
    items, _, _ = put(d, "b", keys("b", 1400, 1600))
    assert [it[0] for it in items] == [NEW] * 200
    assert d.group_used == {"r": 1500 * SZ} and d.ns_used["b"] == 1500 * SZ
    assert d.exists("r", keys("r", 1600)) == [False] * 100 + [True] * 1500  # the group's oldest 100, then spared
    assert d.exists("b", keys("b", 1600)) == [False] * 100 + [True] * 1500  # then b's own oldest
    d.check()


def test_one_request_past_its_quota_by_more_than_a_gathered_batch():
    d = make(units=4096, quotas={"q": 2000 * SZ})
    put(d, "q", keys("k", 2000))
    items, _, _ = put(d, "q", keys("n", 1500))
    assert [it[0] for it in items] == [NEW] * 1500
    assert d.exists("q", keys("k", 2000)) == [False] * 1500 + [True] * 500  # oldest first
    assert d.ns_used == {"q": 2000 * SZ}
    d.check()


def test_a_shared_pages_extent_counts_whole():
    """A TP-sharded page (``"shard": [rank, n]``) takes one extent of n object slots: its group counts all of it
    from the first rank's ALLOC."""
    d = make(units=64, quotas={"s": 4 * SZ})
    items, _ = d.alloc("s", keys("k", 3), [PAGE] * 3, None, next(_gens), 0.0, shard=(0, 2))
    assert [it[0] for it in items] == [OVER_QUOTA] * 3  # 3 pages of 2 slots: past 4
    items, _ = d.alloc("s", keys("k", 2), [PAGE] * 2, None, next(_gens), 0.0, shard=(0, 2))
    assert [it[0] for it in items] == [NEW] * 2 and d.ns_used == {"s": 4 * SZ}
    d.check()
