"""An in-process stand-in for the part of ``umbp.Client`` a replay uses: a test double, not a pool.

``MemoryPool`` holds whole pages in a dict with a page budget and LRU eviction (gets and puts refresh recency;
``batch_exists`` and ``prefix_hits`` do not, as in the real pool). Its ``stats()`` has the keys the replay reads
(``capacity_bytes``, ``used_bytes``, ``objects``, ``hits``, ``misses``, ``evictions``). Several ranks may share one
instance; a lock serialises calls. Unit tests use it to check replay logic in milliseconds; the integration tests
and ``umbp demo`` use real pool processes.

Costs: every call O(keys); memory: the pages it holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from umbp.errors import InvalidArgument


class MemoryPool:
    def __init__(self, capacity_pages: int = 1 << 20):
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "puts": 0, "dedup": 0}
        self.calls = {"batch_put": 0, "batch_get_into": 0, "prefix_hits": 0, "batch_exists": 0}

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], parents: Sequence[Any] | None = None
                  ) -> list[bool]:
        if len(keys) != len(values):
            raise InvalidArgument("memorypool", f"batch_put: {len(keys)} keys but {len(values)} values")
        out = []
        with self._lock:
            self.calls["batch_put"] += 1
            for k, v in zip(keys, values):
                if k in self._pages:
                    self._pages.move_to_end(k)
                    self.counters["dedup"] += 1
                    out.append(False)
                    continue
                self._pages[k] = bytes(v)
                self.counters["puts"] += 1
                out.append(True)
                while len(self._pages) > self.capacity_pages:
                    self._pages.popitem(last=False)
                    self.counters["evictions"] += 1
        return out

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[int]:
        sizes = []
        with self._lock:
            self.calls["batch_get_into"] += 1
            for k, o in zip(keys, outs):
                v = self._pages.get(k)
                if v is None:
                    self.counters["misses"] += 1
                    sizes.append(-1)
                    continue
                self._pages.move_to_end(k)
                memoryview(o).cast("B")[:len(v)] = v
                self.counters["hits"] += 1
                sizes.append(len(v))
        return sizes

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self.calls["batch_exists"] += 1
            return [k in self._pages for k in keys]

    def prefix_hits(self, keys: Sequence[str]) -> int:
        with self._lock:
            self.calls["prefix_hits"] += 1
            n = 0
            for k in keys:
                if k not in self._pages:
                    break
                n += 1
            return n

    def evict_all(self) -> int:
        with self._lock:
            n = len(self._pages)
            self._pages.clear()
            self.counters["evictions"] += n
            return n

    def stats(self) -> dict:
        with self._lock:
            used = sum(len(v) for v in self._pages.values())
            size = max((len(v) for v in self._pages.values()), default=0)
            return {"capacity_bytes": self.capacity_pages * size, "used_bytes": used, "objects": len(self._pages),
                    **{k: self.counters[k] for k in ("hits", "misses", "evictions")}}
