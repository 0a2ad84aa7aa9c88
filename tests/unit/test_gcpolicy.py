"""The metaserver's collector policy (``metaserver/gcpolicy.py``): automatic full collections off, steps that
collect what is not frozen and freeze what survives a long one, ``thaw`` for dropped directories; and the property
that makes freezing a directory safe: every way the directory drops pages (churn evictions, removes, lease and
PENDING expiry, aborts, drains, node loss in slices, a dropped node, watermark passes) leaves no cyclic garbage, so
reference counting frees them frozen or not. A dropped directory itself is cyclic garbage: that is what ``thaw``
is for, and the test shows it would stay frozen without it."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from metaserver import gcpolicy
from metaserver.directory import NEW, Directory
from metaserver.entry import Effects
from metaserver.gcpolicy import NEVER, GcPolicy
from metaserver.fullload import gc_paused
from transport.wire import ALIGN

PAGE = ALIGN - 64  # one 4 KiB unit with its header


class Cycle:
    """A two-object reference cycle: garbage only a collection frees."""

    def __init__(self):
        self.other = [self]


@contextlib.contextmanager
def collector_off_saving_garbage():
    """gc off (nothing collects behind the test's back) and DEBUG_SAVEALL (what a collection finds is kept in
    gc.garbage to be inspected); everything restored afterwards."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


@pytest.fixture
def policy():
    assert gcpolicy.installed() is None
    p = GcPolicy(every_s=3600, freeze_s=0.0).install()
    try:
        yield p
    finally:
        p.uninstall()
        gc.unfreeze()
        gc.collect()


def put(d: Directory, ns: str, keys: list[bytes], parents: list, now: float, gen: int) -> int:
    items, _fx = d.alloc(ns, keys, [PAGE] * len(keys), parents, gen, now)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    d.commit(ns, [k for k, _ in news], [g for _, g in news], now)
    return len(news)


def chains(d: Directory, start: int, count: int, now: float) -> None:
    """``count`` chains of 6 linked pages (every page names its parent), written as engines write them."""
    for c in range(start, start + count):
        keys = [b"c%05d-p%d" % (c, i) for i in range(6)]
        put(d, "m", keys, [None] + keys[:-1], now, gen=1000 + c * 10)


def garbage_found() -> list[str]:
    n = gc.collect()
    types = sorted({type(o).__name__ for o in gc.garbage})
    gc.garbage.clear()
    return [f"{n} unreachable"] + types if n else []


@pytest.mark.parametrize("policy_name", ["lru", "prefix-lru"])
def test_the_directory_drops_pages_without_cyclic_garbage(policy_name):
    with collector_off_saving_garbage():
        d = Directory(policy=policy_name, pending_ttl_s=5.0, read_lease_s=5.0)
        for n in ("n1", "n2", "n3", "n4"):
            d.add_space(n, 60 * ALIGN)
        chains(d, 0, 40, now=0.0)  # 240 pages into 240 units: full
        assert d.objects == 240
        assert garbage_found() == []

        chains(d, 40, 80, now=1.0)  # churn: every new page evicts an old one
        assert d.evictions >= 480
        lease, locs = d.lookup("m", [b"c%05d-p%d" % (119, i) for i in range(6)], 2.0)  # the newest chain
        assert lease and all(loc is not None for loc in locs)
        d.release(lease)
        d.lookup("m", [b"c%05d-p%d" % (118, i) for i in range(6)], 2.0)  # never released: expires
        d.expire_leases(100.0, 1 << 20)
        items, _ = d.alloc("m", [b"pending-%d" % i for i in range(4)], [PAGE] * 4, None, 5000, 3.0)
        d.abort("m", [b"pending-0", b"pending-1"], [items[0][4], items[1][4]])
        d.expire_pending(100.0, 1 << 20)  # the other two were never committed
        removed, _ = d.remove("m", [b"c%05d-p%d" % (119, i) for i in range(6)])
        assert all(removed)
        assert garbage_found() == []

        d.drain("n1")
        d.detach_space("n2")
        for _ in range(1000):  # node loss in budgeted slices, as the service's tick drops it
            _n, rest = d.drop_slice("n2", 7, Effects())
            if rest is None:
                break
        d.drop_space("n3")
        d.watermark_pass(0.5, 0.2, 1 << 20, Effects())
        before = d.objects
        n, _freed, done = d.evict_all(1 << 20, Effects())
        d.check()
        assert done and n == before - d.objects > 0
        assert garbage_found() == []

        # The control: a dropped directory is cyclic garbage (what gcpolicy.thaw is for), so the check above can fail.
        gone = weakref.ref(d)
        del d
        assert gone() is not None
        assert garbage_found() != []


def test_a_step_collects_what_is_not_frozen_and_freezes_survivors(policy):
    assert gc.get_threshold()[2] == NEVER
    survivor = [[i] for i in range(1000)]  # containers the collector tracks, in no cycle
    dead = weakref.ref(Cycle())
    assert dead() is not None  # a cycle: reference counting alone cannot free it
    policy.step()
    assert dead() is None
    assert policy.steps == 1 and policy.freezes == 1  # freeze_s=0: every step freezes
    frozen = policy.frozen
    assert frozen >= len(survivor)

    # Frozen objects are still freed by reference counting: the permanent generation shrinks as they go.
    survivor.clear()
    assert policy.frozen <= frozen - 1000


def test_frozen_cyclic_garbage_waits_for_thaw(policy):
    c = Cycle()
    ref = weakref.ref(c)
    policy.step()  # c survives (it is referenced) and is frozen
    del c  # now cyclic garbage, frozen
    policy.step()
    assert ref() is not None  # no step walks the permanent generation: it leaks until a thaw
    gcpolicy.thaw("test: a directory dropped")
    assert policy.thaws == 1 and policy.frozen == 0
    policy.step()
    assert ref() is None


def test_no_automatic_full_collection_while_installed(policy):
    full = gc.get_stats()[2]["collections"]
    keep = [[i] for i in range(300_000)]  # survivors enough to trigger CPython's full collection on its own
    assert gc.get_stats()[2]["collections"] == full
    policy.uninstall()
    try:
        more = [[i] for i in range(300_000)]
        assert gc.get_stats()[2]["collections"] > full  # the control: without the policy one runs
    finally:
        policy.install()
    del keep, more


def test_uninstall_restores_thresholds_and_one_policy_at_a_time():
    before = gc.get_threshold()
    p = GcPolicy().install()
    try:
        with pytest.raises(RuntimeError, match="metaserver: a GC policy is installed already"):
            GcPolicy().install()
        assert gcpolicy.installed() is p
    finally:
        p.uninstall()
    assert gc.get_threshold() == before and gcpolicy.installed() is None
    gcpolicy.thaw("test: nothing installed")  # a no-op without a policy
    assert p.thaws == 0


def test_a_load_stays_frozen_under_the_policy(policy):
    gc.unfreeze()
    with gc_paused():
        built = [Cycle() for _ in range(500)]
    assert policy.frozen >= 500
    gc.unfreeze()
    with gc_paused():
        pass
    del built


def test_a_load_without_the_policy_leaves_nothing_frozen():
    assert gcpolicy.installed() is None
    with gc_paused():
        built = [Cycle() for _ in range(500)]
    assert gc.get_freeze_count() == 0
    del built
