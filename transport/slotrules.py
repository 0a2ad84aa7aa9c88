"""The slot rules of a partitioned pool, shared by clients, metaservers and nodes: which slot a key belongs to
(``slot_of``, ``slots_of``: ``objformat.key_hash`` mod the slot count, computed without a round trip), which slot a
write-capability epoch names (``SLOT_EPOCH``, ``SLOT_GEN_SHIFT``, ``epoch_slot``) and which region of a node arena
a slot owns (``slot_region``). They pack no bytes; ``transport/wire.py`` does that.
"""

from __future__ import annotations

import hashlib

from transport.objformat import ALIGN, ARENA_DATA_START, SLOT_GEN_SHIFT, key_hash


def slot_of(namespace: str, key: bytes | str, slots: int) -> int:
    """The slot of (namespace, key) in a pool partitioned into ``slots`` slots: ``key_hash`` mod ``slots``, the same
    on every client and metaserver (``metaserver/ha/partition.py``, ``umbp/slotrouter.py``)."""
    if type(key) is str:
        key = key.encode()
    return key_hash(namespace, key) % slots if slots > 1 else 0


def slots_of(namespace: str, keys: list, slots: int) -> list[int]:
    """``slot_of`` of every key of one namespace (bytes or str; anything else gets -1, for the caller's validation
    to refuse), the namespace hashed once: 0.5 us a key against 1.2 us for ``slot_of`` per key."""
    if slots <= 1:
        return [0 if type(k) in (bytes, str) else -1 for k in keys]
    h0 = hashlib.blake2b(namespace.encode() + b"\0", digest_size=8)
    from_bytes = int.from_bytes
    out = []
    for k in keys:
        tk = type(k)
        if tk is str:
            k = k.encode()
        elif tk is not bytes:
            out.append(-1)
            continue
        h = h0.copy()
        h.update(k)
        out.append(from_bytes(h.digest(), "little") % slots)
    return out


SLOT_EPOCH = 1 << 63  # set in the write-capability epoch of a partitioned pool's slot leader (see ``epoch_slot``)


def epoch_slot(epoch: int) -> int | None:
    """The slot whose leader issued a write-capability ``epoch``, None for an unpartitioned pool's epoch. A slot
    leader's epoch is ``SLOT_EPOCH | g`` with g its generations' floor at its takeover, ``(s << 52) + counter``:
    epochs of one slot increase across its terms, and the node keeps one floor per slot."""
    return (epoch >> SLOT_GEN_SHIFT) & 0x3FF if epoch & SLOT_EPOCH else None


def slot_region(slot: int, slots: int, capacity: int) -> tuple[int, int]:
    """(base, size) of slot ``slot``'s region of a node arena of ``capacity`` bytes in a pool of ``slots`` slots:
    ``[ARENA_DATA_START + slot * R, + R)``, R = ``capacity // slots`` rounded down to ALIGN."""
    size = (capacity // slots) // ALIGN * ALIGN
    return ARENA_DATA_START + slot * size, size
