"""The slot rules of a partitioned pool, shared by clients, metaservers and nodes: which slot a key belongs to
(``slots_of``, ``slot_of``, computed without a round trip), which slot a write-capability epoch names
(``SLOT_EPOCH``, ``SLOT_GEN_SHIFT``, ``epoch_slot``) and which region of a node arena a slot owns (``slot_region``).
They pack no bytes; ``transport/wire.py`` does that.

A key's slot is a rule of the pool, fixed when the pool is created (``{prefix}/slots/rule`` in etcd,
``metaserver/ha/slots.py``) and told to clients in the LEADER answer (``"slot_rule"``):
- ``RULE_DIGEST`` (2, pools created since it exists): the bits of the key's digest, the form the metaserver's key
  index files (``keyform.digests``: a 32-byte key is its own digest, any other its blake2b): the four digest words
  mixed (``slots_of_digests``), mod S. A batch of 32-byte keys (SGLang's page hashes) costs a fixed number of numpy
  calls, no hash a key (128 keys on the 2-core VM: about 55 -> 15 us listed, 11 packed); another key costs its
  blake2b, as under rule 1 (a few us a batch more: docs/benchmarks/slots.md). The namespace plays no part: a key's
  slot is the same in every namespace.
- ``RULE_KEY_HASH`` (1, pools created before): ``objformat.key_hash(ns, key)`` (blake2b of ns, 0, key) mod S, a
  blake2b a key (0.37 us). A pool without a rule key is of this rule, so pools keep their keys' slots across
  upgrades.
A client of a release without rule 2 routes a rule-2 pool's keys by rule 1: its ALLOCs are refused by name (the
metaserver checks every ALLOC key's slot), its other requests miss; it never reads or writes another key's bytes.
"""

from __future__ import annotations

import hashlib

import numpy as np

from transport.keyform import digests
from transport.objformat import ALIGN, ARENA_DATA_START, SLOT_GEN_SHIFT

RULE_KEY_HASH = 1
RULE_DIGEST = 2
RULES = (RULE_KEY_HASH, RULE_DIGEST)
_WEIGHTS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], np.uint64)
_FMIX1, _FMIX2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # murmur3's fmix64
_S33 = np.uint64(33)


def slot_of(namespace: str, key: bytes | str, slots: int, rule: int = RULE_DIGEST) -> int:
    """The slot of (namespace, key) in a pool partitioned into ``slots`` slots under ``rule``: the same on every
    client and metaserver (``metaserver/ha/partition.py``, ``umbp/slotrouter.py``)."""
    return int(slots_of(namespace, [key], slots, rule)[0])


def slots_of(namespace: str, keys, slots: int, rule: int = RULE_DIGEST) -> np.ndarray:
    """``slot_of`` of every key of one namespace (a list of bytes or str, or ``PackedKeys``) as an int64 array; a
    key that is neither bytes nor str gets -1, for the caller's validation to refuse."""
    if slots <= 1:
        return np.array([0 if type(k) in (bytes, str) else -1 for k in keys], np.int64)
    if rule == RULE_DIGEST:
        try:
            return slots_of_digests(digests(keys)[0], slots)
        except TypeError:  # a str key, or no key at all: encoded or marked one by one
            out = np.full(len(keys), -1, np.int64)
            at, ks = [], []
            for i, k in enumerate(keys):
                if type(k) in (bytes, str):
                    at.append(i)
                    ks.append(k.encode() if type(k) is str else k)
            out[at] = slots_of_digests(digests(ks)[0], slots)
            return out
    if rule != RULE_KEY_HASH:
        raise ValueError(f"unknown slot rule {rule!r} (this release knows {RULES})")
    h0 = hashlib.blake2b(namespace.encode() + b"\0", digest_size=8)  # the namespace hashed once: 0.37 us a key
    from_bytes = int.from_bytes
    got = []
    for k in keys:
        tk = type(k)
        if tk is str:
            k = k.encode()
        elif tk is not bytes:
            got.append(-1)
            continue
        h = h0.copy()
        h.update(k)
        got.append(from_bytes(h.digest(), "little") % slots)
    return np.array(got, np.int64)


def slots_of_digests(dig: np.ndarray, slots: int) -> np.ndarray:
    """``RULE_DIGEST``'s slots (int64) of (n, 4) uint64 key digests (``keyform.digests``): the words weighed by four
    odd constants and summed, then murmur3's 64-bit finalizer, so every bit of a key moves its slot (a key's varying
    bytes may be anywhere: ``b"%032d" % i`` varies only the top bytes of its last word), mod ``slots``."""
    h = dig @ _WEIGHTS  # (wraps, as meant)
    h ^= h >> _S33
    h *= _FMIX1
    h ^= h >> _S33
    h *= _FMIX2
    h ^= h >> _S33
    h %= np.uint64(slots)
    return h.view(np.int64)


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
