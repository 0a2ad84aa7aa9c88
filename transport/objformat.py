"""The byte layout of pages in memory and on disk: the object header every page carries in a node's arena (and disk
file), the arena's superblock with its generation floors, and the disk file's superblock. No I/O. Frames, opcodes and
answers' packed rows are ``transport/wire.py``'s; these two modules are the only places that pack bytes.

Objects in an arena: a 64-byte header (``OBJ_HEADER``), then the payload, aligned to ``ALIGN`` (4 KiB)::

     magic u32 | version u16 | flags u16 | key_hash u64 | generation u64 | payload_len u64 | checksum u32 |
     header_crc u32 | 24 bytes reserved

``header_crc`` catches a torn header, ``checksum`` (optional) the payload; a reader compares key hash, generation
and length with what the metaserver told it, so a slot evicted and reused is detected instead of returned.

Costs: ``pack_object_header`` and ``check_object_header`` one struct and one crc32 each; their array forms
(``pack_object_headers``, ``crc32_rows``) a fixed number of numpy calls a batch.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np

from umbp.errors import CorruptionError


ALIGN = 4096
OBJ_MAGIC = 0x4F424D55  # b"UMBO"
OBJ_VERSION = 1
OBJ_HEADER = struct.Struct("<IHHQQQII24x")
OBJ_HEADER_SIZE = OBJ_HEADER.size  # 64
OBJ_FLAG_CHECKSUM = 1
_OBJ_CRC_SPAN = 36  # everything before header_crc
_OBJ_HEAD = struct.Struct("<IHHQQQI")  # OBJ_HEADER's fields before header_crc (_OBJ_CRC_SPAN bytes)
_OBJ_TAIL = struct.Struct("<I24x")  # header_crc and the padding


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def object_size(payload_len: int) -> int:
    """Bytes an object of ``payload_len`` occupies in an arena (header included, 4 KiB aligned)."""
    return align_up(OBJ_HEADER_SIZE + payload_len)


def key_hash(namespace: str, key: bytes) -> int:
    """64-bit hash of (namespace, key) stored in the object header."""
    h = hashlib.blake2b(namespace.encode() + b"\0" + key, digest_size=8)
    return int.from_bytes(h.digest(), "little")


def pack_object_header(khash: int, generation: int, payload_len: int, checksum: int | None = None) -> bytes:
    """``OBJ_HEADER``'s bytes: the fields before header_crc, then their crc and the padding (two packs)."""
    head = _OBJ_HEAD.pack(OBJ_MAGIC, OBJ_VERSION, 0 if checksum is None else OBJ_FLAG_CHECKSUM, khash, generation,
                          payload_len, checksum or 0)
    return head + _OBJ_TAIL.pack(zlib.crc32(head))


# A batch's headers packed and checked as arrays: rows of 64 bytes read as 8 little-endian words (``OBJ_HEADER``:
# magic|version|flags, key hash, generation, payload length, checksum|header crc, then padding).
_CRC: list = []  # [(36, 256) uint32 table, crc32 of 36 zero bytes]: built on first use


def crc32_rows(rows: np.ndarray) -> np.ndarray:
    """zlib.crc32 of each row of an (n, 36) uint8 array, without a crc call a row: over a fixed length crc32 is
    affine in the bytes, so it is the crc of zeros xored with one table term per byte (36 look-ups, one reduce)."""
    if not _CRC:
        zero = zlib.crc32(bytes(36))
        bits = np.array([[zlib.crc32(bytes(j) + bytes([1 << b]) + bytes(35 - j)) for b in range(8)] for j in range(36)],
                        np.uint32) ^ np.uint32(zero)
        on = (np.arange(256)[:, None] >> np.arange(8)) & 1 == 1
        _CRC[:] = [np.bitwise_xor.reduce(np.where(on, bits[:, None, :], np.uint32(0)), axis=2), np.uint32(zero)]
    table, zero = _CRC
    return np.bitwise_xor.reduce(table[np.arange(36), rows], axis=1) ^ zero


WORD0 = np.uint64(OBJ_MAGIC | OBJ_VERSION << 32)  # a header's first 8 bytes (magic, version, flags 0) as one word
_CRC_FLAT: list = []  # [crc32_rows's table for header bytes 8..35 flat, each one's offset, the crc's constant]


def crc32_headers(heads: np.ndarray) -> np.ndarray:
    """``zlib.crc32`` of each row's first 36 bytes (``heads``: (n, >= 36) uint8) for rows whose first 8 bytes are
    ``WORD0`` (for any other row the value is meaningless: a reader's check fails it on that word): crc32 over a
    fixed length is affine in the bytes (``crc32_rows``), so the constant word's terms fold into one constant and the
    table is looked up flat for the 28 bytes after it (one add, one ``take``, one reduce): 6 against 12 us for 64
    rows on the 2-core VM."""
    if not _CRC_FLAT:
        crc32_rows(np.zeros((1, 36), np.uint8))  # builds the (36, 256) table
        table, zero = _CRC
        word0 = np.frombuffer(WORD0.tobytes(), np.uint8)
        const = np.bitwise_xor.reduce(table[np.arange(8), word0]) ^ zero
        _CRC_FLAT[:] = [np.ascontiguousarray(table[8:], np.uint32).reshape(-1), np.arange(28, dtype=np.intp) * 256,
                        np.uint32(const)]
    flat, at, const = _CRC_FLAT
    return np.bitwise_xor.reduce(flat.take(heads[:, 8:36] + at), axis=1) ^ const


def pack_object_headers(tags: np.ndarray, gens: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``pack_object_header`` (no payload checksum) of n objects as one (n, 64) uint8 array, row i object i's
    header bytes: a fixed number of numpy calls, the crc by ``crc32_headers``."""
    n = len(gens)
    w = np.zeros((n, OBJ_HEADER_SIZE // 8), np.uint64)  # the header as 8 words (OBJ_HEADER's layout)
    w[:, 0] = WORD0
    w[:, 1] = tags
    w[:, 2] = gens
    w[:, 3] = lens
    raw = w.view(np.uint8)
    raw.view("<u4")[:, 9] = crc32_headers(raw)  # header_crc: bytes 36..39, after the payload checksum (0)
    return raw


def check_object_header(buf: bytes | memoryview, component: str, khash: int, generation: int,
                        payload_len: int) -> int | None:
    """Validate an object header against what the directory says; return the payload checksum if present.
    CorruptionError when the slot holds another object, a torn header, or nothing."""
    if len(buf) < OBJ_HEADER_SIZE:
        raise CorruptionError(component, f"object header of {len(buf)} bytes, expected {OBJ_HEADER_SIZE}")
    magic, version, flags, kh, gen, plen, csum, hcrc = OBJ_HEADER.unpack_from(buf)
    if magic != OBJ_MAGIC or version != OBJ_VERSION:
        raise CorruptionError(component, "no object header at this location (slot empty or overwritten)")
    if zlib.crc32(bytes(buf[:_OBJ_CRC_SPAN])) != hcrc:
        raise CorruptionError(component, "torn object header (header crc mismatch)")
    if kh != khash or gen != generation:
        raise CorruptionError(component, f"stale slot: holds generation {gen} of another key, expected {generation}")
    if plen != payload_len:
        raise CorruptionError(component, f"object length {plen} does not match the directory's {payload_len}")
    return csum if flags & OBJ_FLAG_CHECKSUM else None


def payload_checksum(data: bytes | memoryview | list) -> int:
    """crc32 of a payload, given whole or as the list of parts it is written from."""
    if isinstance(data, list):
        crc = 0
        for part in data:
            crc = zlib.crc32(part, crc)
        return crc
    return zlib.crc32(data)


# ---------------------------------------------------------------------------------------------------------------
# Arena superblock: the first ALIGN bytes of every arena file. Objects live in [ALIGN, ALIGN + capacity).

ARENA_MAGIC = b"UMBPAREN"
ARENA_SUPER = struct.Struct("<8sI16sQQ")  # magic, version, arena_id (uuid bytes), capacity, created_ns
ARENA_VERSION = 1
ARENA_DATA_START = ALIGN
# Generation floors (umbp/node/server.py ``publish_floors``), published in the superblock's page for same-host shm
# writers to compare before they copy (``stale_gens``): u64 little-endian words from ARENA_FLOORS_AT, a one-slot
# pool's floor first, then slot s's at word 1 + s for s < ARENA_FLOOR_SLOTS (a slot past them is not published).
ARENA_FLOORS_AT = 512
ARENA_FLOOR_SLOTS = (ALIGN - ARENA_FLOORS_AT) // 8 - 1
SLOT_GEN_SHIFT = 52  # slot s of a partitioned pool counts generations from (s << 52) + 1 (at most 1024 slots)


def floor_words(arena) -> np.ndarray:
    """The mapped arena's generation floor words (a writable view where the mapping is)."""
    return np.frombuffer(arena, "<u8", 1 + ARENA_FLOOR_SLOTS, ARENA_FLOORS_AT)


def stale_gens(words: np.ndarray, gens: np.ndarray) -> np.ndarray:
    """Which of ``gens`` are below their term's floor as ``words`` publish it: writes a deposed leader granted."""
    if words[0]:
        return gens < words[0]
    slot = gens >> np.uint64(SLOT_GEN_SHIFT)
    fl = words[1 + np.minimum(slot, ARENA_FLOOR_SLOTS - 1).astype(np.int64)]
    return (gens < fl) & (slot < ARENA_FLOOR_SLOTS)


class NotAnArena(CorruptionError, ValueError):
    """The bytes at the start of a mapped file are no arena superblock (a ValueError too, for older callers)."""


def pack_superblock(arena_id: bytes, capacity: int, created_ns: int) -> bytes:
    return ARENA_SUPER.pack(ARENA_MAGIC, ARENA_VERSION, arena_id, capacity, created_ns)


def unpack_superblock(buf) -> tuple[bytes, int]:
    """(arena_id, capacity) from an arena's first bytes; NotAnArena if it is not an arena."""
    if len(buf) < ARENA_SUPER.size:
        raise NotAnArena("arena", f"not a UMBP arena ({len(buf)} bytes, shorter than a superblock)")
    magic, version, arena_id, capacity, _created = ARENA_SUPER.unpack_from(buf)
    if magic != ARENA_MAGIC or version != ARENA_VERSION:
        raise NotAnArena("arena", "not a UMBP arena (bad superblock)")
    return arena_id, capacity


# ---------------------------------------------------------------------------------------------------------------
# The disk tier: a node's disk file is a superblock (``ARENA_SUPER`` with ``DISK_MAGIC``) then ``disk_capacity`` bytes
# of objects laid out as in the arena (the same header, 4 KiB aligned), offsets from ``DISK_DATA_START``. A disk
# address outside the node (READV_DISK ops, read capabilities, directory rows) is ``DISK_BIT | offset``: never a
# DRAM offset, so no grant or row of one tier reads the other.
DISK_MAGIC = b"UMBPDISK"
DISK_DATA_START = ALIGN
DISK_BIT = 1 << 63


def pack_disk_superblock(disk_id: bytes, capacity: int, created_ns: int) -> bytes:
    return ARENA_SUPER.pack(DISK_MAGIC, ARENA_VERSION, disk_id, capacity, created_ns)


def unpack_disk_superblock(buf) -> tuple[bytes, int]:
    """(disk_id, capacity) from a disk file's first bytes; NotAnArena if it is not a disk arena."""
    if len(buf) < ARENA_SUPER.size:
        raise NotAnArena("disk", "not a UMBP disk arena (shorter than a superblock)")
    magic, version, disk_id, capacity, _created = ARENA_SUPER.unpack_from(buf)
    if magic != DISK_MAGIC or version != ARENA_VERSION:
        raise NotAnArena("disk", "not a UMBP disk arena (bad superblock)")
    return disk_id, capacity
