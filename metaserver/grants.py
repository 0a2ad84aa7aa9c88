"""What the metaserver hands out with an ALLOC answer in a closed pool: the object tags and the write capabilities
(umbp/auth.py), one capability per node per batch.

An ALLOC answer is ``{"items": [[NEW, node, off, size, gen, tag, cap_index] | [state], ...], "caps": [cap, ...]}``:
``caps[cap_index]`` is the capability of the item's node, covering every slot (offset, payload length, generation)
of this batch on that node, so a batch costs one MAC per node instead of one per key and the capability crosses the
wire once per node. In an open pool the capabilities are b"". A LOOKUP answer's tags and read capabilities come
the same way, per node, from the table's columns (``TableDirectory.lookup_granted``). ``dataplane.py`` calls
``grant_writes``; the benches call it to measure the service's per-key work.
"""

from __future__ import annotations

from typing import Callable

from metaserver.entry import NEW
from umbp.auth import Tokens, write_capability


def grant_writes(tokens: Tokens, node: Callable, ns: str, keys: list, items: list, deadline_ms: int,
                 rank: int | None = None) -> tuple[list, list[bytes], list[int]]:
    """Turn the directory's ALLOC items into the answer's: a NEW ``(NEW, node_id, off, plen, gen)`` becomes
    ``(NEW, node_id, off, plen, gen, tag, cap_index)``. ``node(node_id)`` gives the member (``cap_key``,
    ``cap_epoch``) or None. ``rank``: the items are that rank's sub-slots of shared entries (tags of (key, rank)).
    Returns (items, caps, indices of the NEW items)."""
    new = [i for i, it in enumerate(items) if it[0] == NEW]
    if not new:
        return items, [], new
    tags = tokens.tags(ns, [keys[i] for i in new], rank)
    index: dict[str, int] = {}
    slots: list[list] = []
    out = list(items)
    for i, tag in zip(new, tags):
        _, node_id, off, plen, gen = items[i]
        ix = index.get(node_id)
        if ix is None:
            ix = index[node_id] = len(slots)
            slots.append([])
        slots[ix].append((off, plen, gen))
        out[i] = (NEW, node_id, off, plen, gen, tag, ix)
    caps = []
    for node_id, ix in index.items():
        member = node(node_id)
        caps.append(write_capability(member.cap_key, slots[ix], member.cap_epoch, deadline_ms)
                    if member is not None else b"")
    return out, caps, new
