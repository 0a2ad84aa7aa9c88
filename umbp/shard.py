"""A client that writes and reads one rank's part of TP-sharded pages (``Client(..., shard=(rank, nranks))``).

``ShardedMeta`` wraps the client's metaserver layer (``umbp.slotrouter.MetaRouter``: ``call``, ``submit``/``result``/
``forget``, ``send_noreply``, ``close``, ``address``, ``sent``) and adds ``"shard": [rank, nranks]`` to every ALLOC,
COMMIT and LOOKUP, so the metaserver keeps ONE row per logical page whose ``nranks`` sub-slots the ranks fill
(``metaserver/table/shared.py``). Everything else of the client (puts, gets, read-ahead, transports, CUDA paths) is
unchanged: a sub-slot is a normal object slot with its own header, tag and capability.

The contract: ``put``/``batch_put`` of a rank returns True once that rank's part is written; the page becomes
visible (``exists``, ``prefix_hits``, gets of every rank) when all ``nranks`` parts are. A rank reads exactly its own
part; a page written without ``shard`` (or with another ``nranks``) is a miss for it, and a sharded page is a miss
for a plain client. ``exists``, ``prefix_hits`` and ``remove`` name logical keys, as for any client. Every rank of a
page must use the same part size (the metaserver answers IN_FLIGHT to a rank whose size differs while the page is
PENDING).
"""

from __future__ import annotations

from typing import Any

from transport.wire import Op

_SHARDED_OPS = frozenset({Op.ALLOC, Op.COMMIT, Op.LOOKUP})


class ShardedMeta:
    """The client's metaserver layer with ``"shard"`` added to ALLOC, COMMIT and LOOKUP (a copy of the meta)."""

    def __init__(self, inner: Any, shard: tuple[int, int]):
        self.inner = inner
        self.shard = [shard[0], shard[1]]

    def _meta(self, op: int, meta: Any) -> Any:
        if op in _SHARDED_OPS and type(meta) is dict:
            return {**meta, "shard": self.shard}
        return meta

    def call(self, op: int, meta: Any, deadline: float) -> Any:
        return self.inner.call(op, self._meta(op, meta), deadline)

    def submit(self, op: int, meta: Any, deadline: float) -> Any:
        return self.inner.submit(op, self._meta(op, meta), deadline)

    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        self.inner.send_noreply(op, self._meta(op, meta), deadline)

    def __getattr__(self, name: str) -> Any:  # result, forget, close, address, sent, ...
        return getattr(self.inner, name)
