"""The metaserver's collector policy (``metaserver/store/gcpolicy.py``): automatic full collections off, steps that
collect what is not frozen and freeze what survives a long one, ``thaw`` for dropped directories (a dropped table
is cyclic garbage that would stay frozen without it), a load frozen under the policy. The property that makes
freezing the directory safe (every way the table drops pages leaves no cyclic garbage) is checked in
tests/unit/test_tablelinks.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from metaserver.store import gcpolicy
from metaserver.store.gcpolicy import NEVER, GcPolicy
from metaserver.store.fullload import gc_paused


class Cycle:
    """A two-object reference cycle: garbage only a collection frees."""

    def __init__(self):
        self.other = [self]


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
