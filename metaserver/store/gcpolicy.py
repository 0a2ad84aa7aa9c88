"""The metaserver's garbage-collector policy: no collection walks everything the process holds while it serves.

Why: CPython runs a full collection whenever the objects that reached its oldest generation since the last one
exceed a quarter of those it holds, and the event loop stands still while it walks them: answers, heartbeats and the
election's lease renewals wait. The page table keeps its pages in numpy columns, so what it holds of tracked objects
grows with its commit records (a ``TableRecord`` per up to ``BATCH_PAGES`` pages), orphans, PENDING writers and
connections, not a Python object per page: 1 M pages committed under prefix-lru are about 10k tracked objects, a full
collection 5 ms on the 2-core VM. What makes millions of them is a load: a full load's or a warm copy's parse makes
an ``entry.Entry`` a page until the table files it (``fullload.gc_paused`` keeps the collector off meanwhile). The
policy bounds a collection's pause by what one step adds, whatever the process holds.

What this does instead (``GcPolicy``, installed once per process by ``metaserver/server.py``):

- automatic collections stop at generation 1 (generation 2's threshold is set out of reach); the young
  collections run as before and stay cheap;
- ``step`` (every ``every_s``, from ``run``) collects everything not frozen, which is what was made since the last
  freeze, and when that walk took ``freeze_s`` or more it freezes the survivors (``gc.freeze``: the permanent
  generation, which no collection walks). So a step walks at most what one ``every_s`` adds on top of what fits
  in ``freeze_s``: its pause does not grow with what the process holds;
- a full load (``fullload.gc_paused``) freezes what it built when it ends.

What it relies on, and what it tolerates:

- a frozen object is still freed by reference counting when its last reference goes. The table drops pages without
  leaving cycles behind (``tests/unit/test_tablelinks.py`` churns, evicts, removes and drops nodes of a table and
  finds no cyclic garbage), so freezing it leaks nothing;
- cyclic garbage made of frozen objects is not collected while they stay frozen. A whole table that is dropped (a
  deposed leader's, a warm copy stopped or reloaded: the table and its parts refer to each other) is such garbage:
  those places call ``thaw``, which unfreezes everything, so the next step walks and collects it (that one step is as
  long as a full collection was: it is paid when the process changes role, not periodically while it serves).
  Anything else that is frozen and later becomes cyclic garbage (an object that lived across a freeze inside a cycle)
  stays until the next thaw; ``frozen`` (the metric ``umbp_metaserver_gc_frozen_objects``) shows whether that grows.

Costs: a step is one ``gc.collect()`` over the unfrozen objects (a few ms on a quiet process; bounded as above
under churn) plus ``gc.freeze()`` (O(1): it splices lists).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("umbp.metaserver")

NEVER = 2**31 - 1  # generation 2's threshold: out of reach of the young collections' count
STEP_EVERY_S = 1.0
FREEZE_AFTER_S = 0.02  # a step whose walk took this long freezes its survivors

_installed: "GcPolicy | None" = None


class GcPolicy:
    """Process-wide (the collector is): at most one installed at a time. Counters for the metrics: ``steps``,
    ``freezes``, ``thaws`` and ``max_pause_s`` (the longest step's collection)."""

    def __init__(self, every_s: float = STEP_EVERY_S, freeze_s: float = FREEZE_AFTER_S):
        self.every_s = every_s
        self.freeze_s = freeze_s
        self.steps = self.freezes = self.thaws = 0
        self.max_pause_s = 0.0
        self._saved: tuple[int, int, int] | None = None

    @property
    def frozen(self) -> int:
        return gc.get_freeze_count()

    def install(self) -> "GcPolicy":
        """Stop automatic full collections for this process (``uninstall`` puts the thresholds back)."""
        global _installed
        if _installed is not None and _installed is not self:
            raise RuntimeError("metaserver: a GC policy is installed already")
        if self._saved is None:
            self._saved = gc.get_threshold()
            t0, t1, _ = self._saved
            gc.set_threshold(t0, t1, NEVER)
        _installed = self
        return self

    def uninstall(self) -> None:
        global _installed
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        if _installed is self:
            _installed = None

    def step(self) -> float:
        """Collect what is not frozen; freeze the survivors when that took ``freeze_s`` or more. Blocks the
        calling thread for the collection; returns its duration in seconds."""
        t0 = time.perf_counter()
        gc.collect()
        dt = time.perf_counter() - t0
        self.steps += 1
        if dt > self.max_pause_s:
            self.max_pause_s = dt
        if dt >= self.freeze_s:
            gc.freeze()
            self.freezes += 1
        return dt

    async def run(self) -> None:
        """``step`` every ``every_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            self.step()


def installed() -> GcPolicy | None:
    return _installed


def thaw(why: str) -> None:
    """Something big was dropped that may be cyclic garbage of frozen objects (a whole directory): unfreeze
    everything, so the next step collects it. A no-op without an installed policy (nothing is kept frozen)."""
    p = _installed
    if p is None:
        return
    n = gc.get_freeze_count()
    gc.unfreeze()
    p.thaws += 1
    if n:
        log.info("metaserver: %s: %d frozen objects unfrozen for the next collection step", why, n)


def loaded() -> None:
    """A full load ended (``fullload.gc_paused``): with a policy installed its survivors stay frozen."""
    gc.freeze()
