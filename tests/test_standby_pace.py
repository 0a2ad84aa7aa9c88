"""A warm copy paced while its process serves (``metaserver/ha/warmpace.py``), against a real etcd: it rests and falls
behind while the loop is busy, applies as events come while idle, and a takeover applies what is behind (the taken
table equals a full load); a copy that fails to apply stops and the takeover loads in full."""

from __future__ import annotations

import asyncio
import time

from metaserver.ha import warmpace
from metaserver.store.persist import EtcdStore
from metaserver.ha.standby import WarmDirectory
from metaserver.table.directory import TableDirectory
from test_standby import PREFIX, UNIT, Writer, equals_full_load, take_over, wait_until


def test_copy_under_load_lags_paced_then_catches_up_to_a_full_load(etcd):
    asyncio.run(_paced(etcd.url))


async def _paced(url: str) -> None:
    """A process that serves (here: a task that keeps the event loop busy in 3 ms steps) has its warm copy apply
    paced: it rests (``paused_s``) and falls behind (``lag``) while pages arrive; idle, it applies as they come
    and never rests; a takeover's catch_up applies the backlog, and the taken directory equals a full load."""
    store = EtcdStore(url, PREFIX)
    await store.wait_ready(10)
    w = Writer(store)
    try:
        await w.txn([w.arena("n1", capacity=8192 * UNIT)])
        warm = WarmDirectory(store, TableDirectory)
        warm.start()
        await wait_until(lambda: warm.loaded)
        w.events = 0
        await w.txn([w.page(i, "n1", i) for i in range(100)])
        await wait_until(lambda: warm.dir.objects == 100)
        assert warm.pace.paused_s == 0.0 and warm.backlog.lag == 0  # idle: applied as it came, never rested

        stop = asyncio.Event()

        async def serve() -> None:  # the loop busy answering requests: 3 ms of work, then a yield
            while not stop.is_set():
                t = time.perf_counter()
                while time.perf_counter() - t < 0.003:
                    pass
                await asyncio.sleep(0)

        busy = asyncio.create_task(serve())
        # The copy's backlog at its largest while pages arrive (sampled every loop turn: on a loaded machine the
        # writes themselves are slow and the copy may have caught up again by the time the last one is seen).
        most = [0, 0, 0]  # lag (events), lag_bytes, pages applied at that moment

        async def sample() -> None:
            while not stop.is_set():
                if warm.backlog.lag > most[0]:
                    most[:] = [warm.backlog.lag, warm.backlog.lag_bytes, warm.dir.objects]
                await asyncio.sleep(0)

        sampler = asyncio.create_task(sample())
        share, warmpace.DEFER_SHARE = warmpace.DEFER_SHARE, 0.02  # a slow pace, so the lag outlasts the writes
        try:
            for lo in range(100, 4100, 500):  # 8 x 500 page records (100-op transactions): 4,000 events
                await w.txn([w.page(i, "n1", i) for i in range(lo, lo + 500)])
            last = await store.revision()
            await wait_until(lambda: warm.seen >= last)
            behind, lag_bytes, applied = most
            assert 0 < lag_bytes < warmpace.LAG_MAX_BYTES
            assert warm.pace.paused_s > 0, "the copy never rested while the loop was busy"
        finally:
            warmpace.DEFER_SHARE = share
            stop.set()
            await busy
            await sampler
        print(f"paced copy: rested {warm.pace.paused_s:.3f}s, {behind} of 4,000 events behind, "
              f"{applied} pages applied")
        assert 0 < behind <= 4000 and applied < 4100  # it fell behind while the loop served

        h = await take_over(store, warm, w)
        assert warm.backlog.lag == 0 and not warm.backlog
        assert h.pages == 4100 and h.events == w.events
        h.dir.check()
        assert await equals_full_load(store, h)
    finally:
        await store.close()


def test_a_copy_that_fails_to_apply_stops_and_the_takeover_loads_in_full(etcd):
    asyncio.run(_broken(etcd.url))


async def _broken(url: str) -> None:
    """An exception applying an event (a bug) stops the copy, logged, instead of leaving the watch to queue events
    nobody applies: its task ends and a takeover's catch_up answers False (the caller loads in full)."""
    store = EtcdStore(url, PREFIX)
    await store.wait_ready(10)
    w = Writer(store)
    try:
        await w.txn([w.arena("n1")])
        warm = WarmDirectory(store, TableDirectory)
        warm.start()
        await wait_until(lambda: warm.loaded)

        def bug(events: list) -> None:
            raise RuntimeError("a bug applying events")

        warm.apply = bug  # type: ignore[method-assign]
        await w.txn([w.page(0, "n1", 0)])
        await wait_until(lambda: warm._task.done())
        assert warm.dir.objects == 0 and warm._task.exception() is None  # ended, logged, not raised
        await store.txn([store.op_put(store.leader_key, b"me")])
        assert not await warm.catch_up(await store.revision(), 2.0)
    finally:
        await store.close()


def test_a_takeover_stops_a_copy_it_finds_caught_up_while_it_rests(etcd):
    asyncio.run(_stop_resting(etcd.url))


async def _stop_resting(url: str) -> None:
    """Issue 42's slot that stayed unserved for good: a takeover (``Metaserver._elected``) whose copy is caught up to
    the winning revision while it rests for the serving loop, with later events queued, sets ``hurried`` (``catch_up``
    returns at once) and stops the copy in the same step. Python 3.11's ``asyncio.wait_for`` returns the rest's result
    when the cancel and the event come together, losing the cancel: the copy ran on, ``stop`` waited for it forever,
    and the slot's election with it (its key held, never served). Here ``stop`` ends and the taken directory equals a
    full load."""
    store = EtcdStore(url, PREFIX)
    await store.wait_ready(10)
    w = Writer(store)
    try:
        await w.txn([w.arena("n1", capacity=8192 * UNIT)])
        warm = WarmDirectory(store, TableDirectory)
        warm.start()
        await wait_until(lambda: warm.loaded)
        await store.txn([store.op_put(store.leader_key, b"me")])  # the win, applied before the events after it
        won = await store.revision()
        await wait_until(lambda: warm.rev >= won)

        stop = asyncio.Event()

        async def serve() -> None:  # the loop busy answering requests: 3 ms of work, then a yield
            while not stop.is_set():
                t = time.perf_counter()
                while time.perf_counter() - t < 0.003:
                    pass
                await asyncio.sleep(0)

        busy = asyncio.create_task(serve())
        # After its first slice the copy rests for as long as the test runs (a slice's time / DEFER_SHARE), so it is
        # in that rest, with the later events queued, when the takeover comes.
        share, warmpace.DEFER_SHARE = warmpace.DEFER_SHARE, 1e-6
        try:
            for lo in range(0, 2000, 500):
                await w.txn([w.page(i, "n1", i) for i in range(lo, lo + 500)])
            last = await store.revision()
            await wait_until(lambda: warm.seen >= last)
            assert warm.backlog and warm.pace.paused_s > 0, "the copy is not resting with events queued"
            assert await warm.catch_up(won, 10.0)  # caught up to the win already: returns without a yield ...
            stopping = asyncio.ensure_future(warm.stop())  # ... and the takeover stops the copy, as _elected does
            done, _ = await asyncio.wait({stopping}, timeout=5.0)
            assert done, "the takeover's stop of its resting warm copy never ended"
        finally:
            warmpace.DEFER_SHARE = share
            stop.set()
            await busy
        h = warm.take()
        assert h.pages == 2000 and not warm.backlog
        h.dir.check()
        assert await equals_full_load(store, h)
    finally:
        await store.close()
