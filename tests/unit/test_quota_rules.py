"""Unit tests of quota groups and reservations (umbp/quotarules.py, metaserver/quotas.py), pure, no I/O: the tokens
file's pattern quotas, token quotas and reservations; a group's use counted over its namespaces; a flood evicting its
own group's pages only; a slot's share of a quota; global eviction (placement, the watermark pass) passing over a
group at its reservation, for both policies; the reservations clamped to half the capacity."""

import pytest

from metaserver.directory import NEW, OVER_QUOTA, Effects
from transport.wire import object_size
from umbp.auth import Tokens
from umbp.errors import ConfigError
from umbp.quotarules import QuotaGroup, QuotaRules

from test_metaserver_directory import PAGE, make, put  # noqa: F401  (helpers shared with the core tests)

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
    assert d.group_used == {"token:q": 6 * SZ} and d._group_ns == {"token:q": {"q/flood"}}
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
    from metaserver.quarantine import Quarantine

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
