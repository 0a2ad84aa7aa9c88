"""Zero-copy access to pages on same-host nodes: ``Mapped``, the part of ``umbp.Client`` behind ``Client.mapped(keys)``
(held as ``client.maps``; it reads the client's metaserver connection, transports, lock and counters through its
client). ``mapped`` yields the mapped arenas and each page's place in them under one read lease, for a GPU gather
that reads the arena itself. Headers are checked on entry and again on exit (a slot rewritten meanwhile raises
``CorruptionError``); the lease is released on exit, also on error. Cost: one LOOKUP, one transport lookup per node,
one header read per page.

The part refers to its client weakly: the client holds the part, and a strong reference back would make a cycle,
so a client dropped without ``close()`` would wait for the cyclic collector (frozen in some processes) instead of
closing at once. ``mapped`` hands its context its client strongly, so the client lives while the caller is inside.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Sequence

from transport import objformat, wire
from umbp.errors import CorruptionError, TransportError
from umbp.keys import normalize_keys


@dataclass
class MappedPages:
    """What ``Client.mapped`` yields: ``locs[i]`` is ``(node_id, payload_offset, payload_len)`` in
    ``arenas[node_id]`` (the node's whole arena, mapped shared and writable), or None for a miss / a page that is
    not mapped."""

    locs: list[tuple[str, int, int] | None]
    arenas: dict[str, memoryview]


class Mapped:
    """``Client.mapped`` (see the module docstring)."""

    def __init__(self, client: Any):
        self._client = weakref.ref(client)

    def mapped(self, keys: Sequence[Any]) -> ContextManager[MappedPages]:
        """Zero-copy access to pages held by same-host nodes, for a GPU gather that reads the mapped arena.

        One LOOKUP takes a read lease (the pages cannot be evicted or their slots reused while it lasts, up to the
        metaserver's ``read_lease_s``); the object headers are checked now and again on exit, so bytes that changed
        under the caller raise ``CorruptionError`` on exit (treat what was read as garbage then). Pages on nodes
        that are not reachable over shm, and misses, have ``locs[i] = None``: fetch those with
        ``batch_get_ranges_into``. Blocks for the LOOKUP only; the lease is released on exit, also on error."""
        return _mapped(self._client(), keys)


@contextlib.contextmanager
def _mapped(c: Any, keys: Sequence[Any]) -> Iterator[MappedPages]:
    """``Mapped.mapped`` for client ``c`` (held strongly by the generator while the caller is inside)."""
    kb = normalize_keys(keys)
    ns = c.namespace
    with c._lock:
        deadline = c._deadline()
        reply = c._meta.call(wire.Op.LOOKUP, {"ns": ns, "keys": kb}, deadline) if kb else {"locs": []}
        lease = reply.get("lease", 0)
    m = MappedPages([None] * len(kb), {})
    checks: list[tuple[memoryview, int, bytes, int]] = []  # (arena, header offset, header bytes, size)
    arenas: dict[str, memoryview | None] = {}
    hs = objformat.OBJ_HEADER_SIZE
    try:
        for i, loc in enumerate(reply["locs"]):
            if loc is None:
                continue
            node_id, off, size, gen, khash, _cap = loc
            if node_id not in arenas:  # one transport lookup per node, not per page
                with c._lock:
                    try:
                        t = c._transport_for(node_id, deadline)
                    except TransportError:
                        t = None
                arenas[node_id] = t.arena if t is not None and t.name == "shm" else None
            arena = arenas[node_id]
            if arena is None or off & objformat.DISK_BIT:  # on its disk tier: not in the arena (fetch it)
                continue
            head = bytes(arena[off:off + hs])
            objformat.check_object_header(head, c.component, khash, gen, size)
            m.arenas[node_id] = arena
            m.locs[i] = (node_id, off + hs, size)
            checks.append((arena, off, head, size))
        yield m
        # Unchanged header bytes prove the slot still holds what was checked on entry (a reused slot always
        # gets a new header: another generation, at least).
        for arena, off, head, _size in checks:
            if arena[off:off + hs] != head:
                raise CorruptionError(c.component, f"slot at {off} was rewritten while it was mapped")
        c.count(gets=len(checks), bytes_mapped=sum(ck[3] for ck in checks))
    finally:
        if lease:
            with c._lock:
                c._meta.send_noreply(wire.Op.RELEASE, {"lease": lease}, c._deadline())
