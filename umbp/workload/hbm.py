"""A DP rank's HBM prefix cache: page keys, LRU within the rank, prefix-preserving.

Holds at most ``capacity`` page keys. A prefill matches the leading run of its prompt's keys that is present
(``match``), then inserts or touches its pages (``insert``). Pages of one chain are touched from the last to the
first, so the first page of a chain is always its most recent: LRU then evicts chain tails before heads and a
cached prefix never loses its start while keeping its end, which is what SGLang's radix cache does by evicting
leaves only. A page shared by many chains (a system prompt) stays hot because every chain touches it.

What it approximates: no pinning of pages under a running request (the replay is a prefill tier: a rank is done
with a request when its prefill ends) and pages, not tokens, are the unit. ``match`` never changes recency.
Cost: ``match`` O(pages matched); ``insert`` O(pages inserted + pages evicted), dict operations only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from umbp.errors import ConfigError


class HbmCache:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ConfigError("hbm", f"capacity must be >= 0 pages, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def match(self, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` present. Does not change recency."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[str]) -> int:
        """Insert or touch ``keys`` (one chain, first page first); returns how many pages were evicted."""
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        evicted = 0
        while len(lru) > self.capacity:
            lru.popitem(last=False)
            evicted += 1
        self.evicted += evicted
        return evicted

    def clear(self) -> None:
        self._lru.clear()
