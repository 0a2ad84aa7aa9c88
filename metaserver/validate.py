"""Request validation: every field of every request meta is type- and range-checked here, before any handler runs.

A violation raises ``Reject(message, status)`` (a ``BadRequest``) naming the field ("keys[3] must be bytes"); the server prefixes the
component and opcode ("metaserver: ALLOC: keys[3] must be bytes") and answers BAD_REQUEST. Unknown fields are
rejected too, so a client typo is an error rather than a silently ignored option.

Costs: key lists are checked with C-level passes (``map(type, ...)``, ``max(map(len, ...))``), about 50 ns per key
on the 2-core VM; the slow per-index scan only runs to name the offending element once a pass has failed. Packed keys
(``wire.pack_keys``: one bytes value of keys of one length, made ``PackedKeys`` by ``unpack_keys`` as a request
arrives) cost a length check whatever their count (and one numpy call for widths of 64..68 bytes). Keys and parents
come back in the pool's digest form (``keyform.digest_key``: a 64-hex key as its 32 raw bytes), converted only when
a batch holds a key that may be one (64 bytes, or 65..68 ending in a digit; clients send the raw form already).
"""

from __future__ import annotations

from typing import Any

from transport import wire
from transport.keyform import KEY32, PackedKeys, digest_forms, digest_key
from transport.wire import Status
from umbp.config import MAX_SHARDS
from umbp.errors import BadRequest

MAX_KEY = wire.MAX_KEY_BYTES
MAX_NS = 128
MAX_PAYLOAD = 1 << 40


class Reject(BadRequest):
    """A request the metaserver refuses; ``extra`` rides along in the error answer's meta."""

    def __init__(self, message: str, status: int = Status.BAD_REQUEST, **extra: Any):
        super().__init__("metaserver", message, status)
        self.status = status
        self.message = message
        self.extra = extra


def fields(meta: Any, allowed: frozenset[str], required: tuple[str, ...] = ()) -> dict:
    if meta is None:
        meta = {}
    if type(meta) is not dict:
        raise Reject("request meta must be a map")
    if not meta.keys() <= allowed:
        bad = sorted(str(k) for k in meta.keys() - allowed)
        raise Reject(f"unknown field {bad[0]!r}")
    for name in required:
        if name not in meta:
            raise Reject(f"missing field {name!r}")
    return meta


def ns(meta: dict) -> str:
    v = meta.get("ns")
    if type(v) is not str:
        raise Reject("ns must be a string")
    if not v or len(v) > MAX_NS or len(v.encode()) > MAX_NS:
        raise Reject(f"ns must be 1..{MAX_NS} bytes")
    return v


KEY_LISTS = (list, PackedKeys)  # what a request's validated-or-not ``keys`` may be: a list, or packed keys


def unpack_keys(meta: Any) -> None:
    """A keyed request's packed ``keys`` (bytes, and ``key_width`` unless 32: ``wire.pack_keys``) made ``PackedKeys``
    in place, ``key_width`` taken out, before any handler or slot routing reads them, so every reader sees a sequence
    of keys; Reject when the width is not 1..MAX_KEY or the bytes are not whole keys. Keys that may be a digest key's
    text (64 bytes, or 65..68 ending in a digit) become the list of their digest forms, as listed keys do (``keys``).
    Anything else is left for the handlers' validation."""
    if type(meta) is not dict or type(meta.get("keys")) is not bytes:
        return
    blob, w = meta["keys"], meta.pop("key_width", KEY32)
    if type(w) is not int or not 0 < w <= MAX_KEY:
        raise Reject(f"key_width must be an integer 1..{MAX_KEY}")
    if len(blob) % w:
        raise Reject(f"packed keys of {w} bytes each: {len(blob)} bytes is not a whole number of them")
    p = PackedKeys(blob, w)
    if p.may_hold_digest_text():
        meta["keys"] = digest_forms(p.tolist(), [w] * len(p))
    else:
        meta["keys"] = p


def keys(meta: dict, max_n: int, name: str = "keys") -> list[bytes] | PackedKeys:
    v = meta.get(name)
    if type(v) is PackedKeys:  # (``unpack_keys``: keys of one length, in their digest form)
        if len(v) > max_n:
            raise Reject(f"{name} holds {len(v)} keys, more than the limit of {max_n}")
        return v
    if type(v) is not list:
        raise Reject(f"{name} must be a list of bytes")
    if len(v) > max_n:
        raise Reject(f"{name} holds {len(v)} keys, more than the limit of {max_n}")
    if v:
        types = set(map(type, v))
        if types != {bytes}:
            i = next(i for i, k in enumerate(v) if type(k) is not bytes)
            raise Reject(f"{name}[{i}] must be bytes")
        lens = list(map(len, v))
        longest = max(lens)
        if longest > MAX_KEY or min(lens) == 0:
            i = next(i for i, n in enumerate(lens) if not 0 < n <= MAX_KEY)
            raise Reject(f"{name}[{i}] must be 1..{MAX_KEY} bytes")
        if longest >= 64:  # digest keys sent as hex text: the directory keeps their raw form (umbp.keys)
            v = digest_forms(v, lens)
    return v


def ints(meta: dict, name: str, n: int, lo: int, hi: int) -> list[int]:
    v = meta.get(name)
    if type(v) is not list:
        raise Reject(f"{name} must be a list of integers")
    if len(v) != n:
        raise Reject(f"{name} has {len(v)} items, keys has {n}")
    if v:
        if set(map(type, v)) != {int}:
            i = next(i for i, x in enumerate(v) if type(x) is not int)
            raise Reject(f"{name}[{i}] must be an integer")
        if min(v) < lo or max(v) > hi:
            i = next(i for i, x in enumerate(v) if not lo <= x <= hi)
            raise Reject(f"{name}[{i}] must be within {lo}..{hi}")
    return v


def parents(meta: dict, n: int) -> list | None:
    v = meta.get("parents")
    if v is None:
        return None
    if type(v) is not list:
        raise Reject("parents must be a list of bytes or nil")
    if len(v) != n:
        raise Reject(f"parents has {len(v)} items, keys has {n}")
    out = v
    for i, p in enumerate(v):
        if p is None:
            continue
        if type(p) is not bytes or not 0 < (k := len(p)) <= MAX_KEY:
            raise Reject(f"parents[{i}] must be 1..{MAX_KEY} bytes or nil")
        # a parent in a digest key's text form (64 hex, or a rank key ending in a digit) is named by its digest,
        # as keys are (``keyform.digest_forms``); SGLang's page names end in a letter and are their own form
        if k == 64 or (64 < k <= 68 and 48 <= p[-1] <= 57):
            if out is v:
                out = list(v)
            out[i] = digest_key(p)
    return out


def shard(meta: dict) -> tuple[int, int] | None:
    """``shard``: [rank, n] of a TP-sharded page's writer or reader (``metaserver/table/shared.py``), 0 <= rank < n <=
    MAX_SHARDS; None when absent."""
    v = meta.get("shard")
    if v is None:
        return None
    if (type(v) is not list or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int
            or not 0 <= v[0] < v[1] <= MAX_SHARDS):
        raise Reject(f"shard must be [rank, n] with 0 <= rank < n <= {MAX_SHARDS}, got {v!r}")
    return v[0], v[1]


def string(meta: dict, name: str, *, required: bool = True, max_len: int = 4096, empty: bool = True) -> str | None:
    v = meta.get(name)
    if v is None and not required:
        return None
    if type(v) is not str:
        raise Reject(f"{name} must be a string")
    if len(v) > max_len or (not empty and not v):
        raise Reject(f"{name} must be {0 if empty else 1}..{max_len} characters")
    return v


def boolean(meta: dict, name: str) -> bool:
    """An optional flag: absent is False; anything but a bool is refused."""
    x = meta.get(name, False)
    if type(x) is not bool:
        raise Reject(f"'{name}' must be true or false")
    return x


def integer(meta: dict, name: str, lo: int, hi: int, *, default: int | None = None) -> int:
    v = meta.get(name, default)
    if type(v) is not int:
        raise Reject(f"{name} must be an integer")
    if not lo <= v <= hi:
        raise Reject(f"{name} must be within {lo}..{hi}")
    return v


def number(meta: dict, name: str, lo: float, hi: float) -> float:
    v = meta.get(name)
    if type(v) not in (int, float):
        raise Reject(f"{name} must be a number")
    if not lo <= v <= hi:
        raise Reject(f"{name} must be within {lo}..{hi}")
    return float(v)


def node_id(meta: dict) -> str:
    v = string(meta, "node_id", max_len=128, empty=False)
    if not all(ch.isalnum() or ch in "-_." for ch in v):
        raise Reject("node_id may only hold letters, digits, '-', '_' and '.'")
    return v


def arena_id(meta: dict) -> bytes:
    v = meta.get("arena_id")
    if type(v) is not bytes or len(v) != 16:
        raise Reject("arena_id must be 16 bytes")
    return v


REGISTER_FIELDS = frozenset({"node_id", "host", "port", "pid", "capacity", "arena_id", "arena_path", "boot_id",
                             "hostname", "transports", "lease_ttl", "rdma", "disk_id", "disk_capacity", "disk_path",
                             "disk_direct", "acks_floor"})


def node_description(meta: dict) -> dict:
    fields(meta, REGISTER_FIELDS, ("node_id", "host", "port", "capacity", "arena_id", "lease_ttl"))
    desc = {
        "node_id": node_id(meta),
        "host": string(meta, "host", max_len=255, empty=False),
        "port": integer(meta, "port", 0, 65535),
        "pid": integer(meta, "pid", 0, 1 << 31, default=0),
        "capacity": integer(meta, "capacity", 4096, 1 << 50),
        "arena_id": arena_id(meta),
        "arena_path": string(meta, "arena_path", required=False) or "",
        "boot_id": string(meta, "boot_id", required=False, max_len=128) or "",
        "hostname": string(meta, "hostname", required=False, max_len=255) or "",
        "lease_ttl": number(meta, "lease_ttl", 0.1, 3600.0),
    }
    tr = meta.get("transports", [])
    if type(tr) is not list or not all(type(t) is str for t in tr) or len(tr) > 16:
        raise Reject("transports must be a list of strings")
    desc["transports"] = tr
    rdma = meta.get("rdma")
    if rdma is not None and type(rdma) is not dict:
        raise Reject("rdma must be a map or nil")
    desc["rdma"] = rdma
    if meta.get("acks_floor") is not None:  # its heartbeats say the generation floor it holds (umbp/node/metalink.py)
        if type(meta["acks_floor"]) is not bool:
            raise Reject("acks_floor must be a boolean")
        desc["acks_floor"] = meta["acks_floor"]
    if meta.get("disk_id") is not None:  # its disk tier (umbp node --disk: metaserver/table/tiers.py)
        did = meta["disk_id"]
        if type(did) is not bytes or not 1 <= len(did) <= 64:
            raise Reject("disk_id must be 1..64 bytes")
        desc["disk_id"] = did
        desc["disk_capacity"] = integer(meta, "disk_capacity", 1 << 20, (1 << 44) - (1 << 13))  # u32 4 KiB units
        desc["disk_path"] = string(meta, "disk_path", required=False, max_len=4096) or ""
    return desc
