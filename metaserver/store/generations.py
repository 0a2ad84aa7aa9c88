"""The generation counter of the metaserver (``GenCounter``), on ``metaserver.store.persist.EtcdStore``.

generations are reserved from ``{prefix}/gen`` in ranges of ``GEN_RANGE`` with a compare-and-swap
transaction, and refilled in the background at half a range, so allocations almost never wait on etcd.
Generations are unique and increasing across restarts; a crash wastes at most the rest of a range.
"""

from __future__ import annotations

import asyncio
from collections import deque

from metaserver.store.persist import EtcdStore
from transport.wire import Status
from umbp.errors import Unavailable

GEN_RANGE = 1 << 20


class GenCounter:
    """Hands out unique, increasing generations from ranges reserved in etcd."""

    def __init__(self, store: EtcdStore, span: int = GEN_RANGE, first: int = 1):
        self.store = store
        self.first = first  # the counter's value when its key is absent (a slot's range starts there)
        self.span = span
        self._ranges: deque[list[int]] = deque()  # [next, limit)
        self._refill: asyncio.Task | None = None
        self.issued_below = 0  # every generation handed out so far is below this (write-capability quarantine)

    async def start(self) -> None:
        await self._reserve()
        if self._ranges:
            self.issued_below = max(self.issued_below, self._ranges[0][0])

    def _left(self) -> int:
        return sum(hi - lo for lo, hi in self._ranges)

    def take_nowait(self, n: int) -> int | None:
        """First of ``n`` consecutive fresh generations, or None when the reserved ranges cannot supply them."""
        while self._ranges and self._ranges[0][1] - self._ranges[0][0] < n:
            if len(self._ranges) == 1:
                break
            self._ranges.popleft()  # too little left in this range: skip the rest
        base = None
        if self._ranges and self._ranges[0][1] - self._ranges[0][0] >= n:
            r = self._ranges[0]
            base = r[0]
            r[0] += n
            self.issued_below = r[0]
        if self._left() < max(self.span // 2, n) and (self._refill is None or self._refill.done()):
            self._refill = asyncio.create_task(self._reserve())
        return base

    async def take(self, n: int) -> int:
        for _ in range(100):
            base = self.take_nowait(n)
            if base is not None:
                return base
            if self._refill is not None:
                await asyncio.shield(self._refill)
                if self._refill.exception() is not None:
                    raise self._refill.exception()
            else:
                await self._reserve()
        raise Unavailable("metaserver", "could not reserve generations from etcd", Status.UNAVAILABLE)

    async def _reserve(self) -> None:
        key = self.store.gen_key
        for _ in range(50):
            cur = await self.store.get_value(key)
            lo = self.first if cur is None else int(cur)
            hi = lo + self.span
            if await self.store.compare_and_put(key, str(hi).encode(), cur):
                if self._ranges and self._ranges[-1][1] == lo:
                    self._ranges[-1][1] = hi
                else:
                    self._ranges.append([lo, hi])
                return
        raise Unavailable("metaserver", "generation counter: too much contention on " + key.decode(),
                          Status.UNAVAILABLE)
